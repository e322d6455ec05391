"""What the tests, the benchmarks and the demos run on, outside the plugin: the named test
models (:mod:`.fixtures`: tiny random-weight MoE models of every supported architecture,
their quantized and widened variants) and a multi-node Ray cluster on one machine behind
a real network delay (:mod:`.mesh_cluster`).

Not the runtime: nothing ``vllm serve`` loads imports it (``tests/test_layout.py`` checks
it); the ``specexpert`` command imports it for ``build-fixtures`` and ``mesh-demo`` only.
"""
