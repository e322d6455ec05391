"""Tools around the runtime: training and fixtures of test models, the corpus, offline
calibration and analysis passes, the engine harness of the demo, tests and benchmarks.

Nothing here is imported by what ``vllm serve`` loads (the plugin, the layers, the
engine); ``tests/test_layout.py`` checks it.
"""
