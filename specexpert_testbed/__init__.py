"""What the tests run on, outside the plugin and out of its wheel: the named test models
(:mod:`.fixtures`: tiny random-weight MoE models of every supported architecture, their
quantized and widened variants; ``python -m specexpert_testbed.fixtures`` builds them
ahead, the tests on first use). Importable from the repository (``tests/conftest.py``
puts it on the path).

Nothing in ``vllm_specexpert`` imports it (``tests/test_layout.py`` checks it).
"""
