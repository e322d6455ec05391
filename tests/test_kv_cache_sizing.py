"""The CPU build's KV cache, given no size, is sized for the batch when the engine is
configured: ``max_num_seqs`` full-length sequences, which the budget's plan then leaves
room for (issue 66: throughput that grows with the batch needs a KV cache for the batch;
vLLM's own CPU sizing refuses to start unless 0.92 of the node is free, and otherwise
takes that share beside the slots)."""

import os

import pytest

import vllm_specexpert
from vllm_specexpert.tools.embedded_model import TRAINED_MODEL_DIR
from vllm_specexpert.tools.harness import start_engine, stop_engine

SEQS, LENGTH = 2, 200
"""(Not a multiple of vLLM's KV block: a sequence takes whole blocks.)"""


def kv_cache_bytes(model) -> int:
    """Worker side: the bytes of every attention layer's KV cache."""
    from vllm.model_executor.layers.attention import Attention

    tensors = {}
    for module in model.modules():
        if isinstance(module, Attention):
            caches = module.kv_cache  # (a tensor; a list of them per virtual engine before)
            for cache in caches if isinstance(caches, list) else [caches]:
                tensors[cache.data_ptr()] = cache.numel() * cache.element_size()
    return sum(tensors.values())


def kv_bytes_per_token(model) -> int:
    """Worker side: K and V of one token over every attention layer, from the layers."""
    from vllm.model_executor.layers.attention import Attention

    return sum(
        2 * m.num_kv_heads * m.head_size * m.kv_cache_torch_dtype.itemsize
        for m in model.modules()
        if isinstance(m, Attention)
    )


@pytest.fixture(scope="module")
def unsized_engine():
    saved = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # (conftest's 1 GiB)
    try:
        llm = start_engine(
            str(TRAINED_MODEL_DIR), {"budget": 0.5}, max_model_len=LENGTH, max_num_seqs=SEQS
        )
    finally:
        if saved is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved
    yield llm
    stop_engine(llm)


def test_a_kv_cache_given_no_size_holds_max_num_seqs_full_length_sequences(unsized_engine):
    llm = unsized_engine
    per_token = llm.apply_model(kv_bytes_per_token)[0]
    planned = vllm_specexpert.get_stats(llm)[0]["budget"]
    tokens = llm.llm_engine.vllm_config.cache_config.block_size
    allocated = llm.apply_model(kv_cache_bytes)[0]
    # vLLM allocates whole blocks of what it was given, one of them kept empty (its null
    # block): the batch's, not its own share of the node (18-19 GB here) nor another
    # default (VLLM_CPU_KVCACHE_SPACE's GiB). Each sequence takes whole blocks.
    blocks = allocated // (tokens * per_token)
    assert blocks - 1 >= SEQS * -(-LENGTH // tokens)
    assert allocated <= planned["kv_bytes"] < SEQS * LENGTH * per_token + 2 * tokens * per_token
