"""The package's loggers: vLLM's logger class, vLLM's handler and format.

vLLM configures a handler for its own ``vllm`` logger only; a plugin's logger under
another name would print nothing at INFO. :func:`init_logger` gives the
``vllm_specexpert`` loggers vLLM's handlers and level, so plugin lines look like vLLM's
(process name, time, file:line) and follow ``VLLM_LOGGING_LEVEL``.
"""

from __future__ import annotations

import logging

ROOT = "vllm_specexpert"


def init_logger(name: str) -> logging.Logger:
    """vLLM's ``init_logger(name)``, with vLLM's handlers on the package's root logger."""
    from vllm.logger import init_logger as vllm_init_logger

    root = logging.getLogger(ROOT)
    if not root.handlers:
        vllm = logging.getLogger("vllm")
        for handler in vllm.handlers:
            root.addHandler(handler)
        root.setLevel(vllm.level or logging.INFO)
        root.propagate = not vllm.handlers
    return vllm_init_logger(name)
