"""Tools around the runtime: the embedded model (its files, its tokenizer, its
training), the corpus, offline calibration and analysis passes, the engine harness of the
demo, tests and benchmarks, the one-machine Ray cluster of ``mesh-demo`` and the mesh
tests. The test models are not here but in ``specexpert_testbed`` (not in the wheel).

Nothing here is imported by what ``vllm serve`` loads (the plugin, the layers, the
engine); ``tests/test_layout.py`` checks it.
"""
