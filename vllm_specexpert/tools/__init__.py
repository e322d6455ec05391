"""Tools around the runtime: the embedded model (its files, its tokenizer, its
training), the corpus, offline calibration and analysis passes, the engine harness of the
demo, tests and benchmarks. The test models and the test cluster are not here but in
``specexpert_testbed``.

Nothing here is imported by what ``vllm serve`` loads (the plugin, the layers, the
engine); ``tests/test_layout.py`` checks it.
"""
