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

GiB, MiB = 1 << 30, 1 << 20
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


def test_the_disk_tier_under_auto_gives_vllm_the_kv_cache_its_batch_choice_leaves(
    tmp_path, monkeypatch
):
    # The embedded model: a full-length sequence of 1024 tokens holds 2 x 8 layers x 2
    # heads x 64 x 2 B = 4096 B a token, 4 MiB; its 8 x 64 experts of 3 x 256 x 64 x 2 B
    # take 48 MiB. Free 1.5 GiB, less the reserve (1 GiB) and a pass's workspace (256
    # tokens x 4 x 64 x 8 B = 0.5 MiB), less every expert, leaves 463.5 MiB: 115 whole
    # sequences beside vLLM's null block would hold every expert resident (nothing
    # read), but the cache is never larger than the rule without the disk's account
    # gives, 0.25 of the memory (384 MiB): 95 whole sequences and the null block.
    from vllm import EngineArgs

    from vllm_specexpert.config.sizing import MemoryReport

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(
        "vllm_specexpert.layers.sizing.memory_report",
        lambda device, settings: MemoryReport(24 * GiB, 3 * GiB // 2),
    )

    def kv_given(specexpert: dict) -> tuple[int, int]:
        args = EngineArgs(
            model=str(TRAINED_MODEL_DIR),
            max_model_len=1024,
            max_num_seqs=256,
            enforce_eager=True,
            additional_config={"specexpert": specexpert},
        )
        cache = args.create_engine_config().cache_config
        return cache.kv_cache_memory_bytes, cache.block_size

    disk = {"path": str(tmp_path / "pack")}
    kv, block = kv_given({"budget": "auto", "disk": disk})
    assert kv == 95 * 4 * MiB + block * 4096
    assert kv_given({"budget": 0.5, "disk": disk})[0] == 384 * MiB
    # Where vLLM runs the engine core and its worker in processes of their own, each is
    # counted at 1.2x this process's anonymous memory (100 MiB here), and the model's
    # weights besides its experts at their file's bytes (59,180,896 B - 48 MiB = 8.44
    # MiB; the safetensors header included): 463.5 - 248.44 MiB leaves 53 sequences
    # beside every expert (54 would leave 46.6 of the 48 MiB: 62 slots a layer and some
    # read).
    from vllm import envs

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # (what vLLM's platform reads)
    # (what its engine reads: vLLM caches its settings once an engine has started)
    monkeypatch.setattr(envs, "VLLM_ENABLE_V1_MULTIPROCESSING", True, raising=False)
    monkeypatch.setattr("vllm_specexpert.layers.sizing.process_anonymous_bytes", lambda: 100 * MiB)
    assert kv_given({"budget": "auto", "disk": disk})[0] == 53 * 4 * MiB + block * 4096
