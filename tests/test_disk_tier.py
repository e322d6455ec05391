"""The disk tier end to end: a model's experts read from its expert pack (made on the
first start), never loaded by vLLM, and greedy output identical to vanilla vLLM's under
``fetch`` with a quarter of the experts in the slots. A pack that is not this model's,
or not whole, is refused at start naming ``disk.path``; a read error mid-generation fails
the requests that needed the expert, and only those."""

import json
import os
import shutil

import pytest
from vllm_harness import (
    MAX_TOKENS,
    PROMPTS,
    cache_invariants,
    greedy,
    make_llm,
    shutdown,
    vanilla_reference,
    vanilla_reference_ahead,
)

import vllm_specexpert
from specexpert_testbed.fixtures import TRAINED_MODEL, model_path, num_moe_layers
from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.tools.harness import start_engine

MODEL = "tiny-wide"


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("disk") / "pack"


@pytest.fixture(scope="module")
def engine(pack_dir):
    vanilla_reference_ahead(MODEL)  # (the other process runs it while this engine starts)
    assert not pack_dir.exists()  # the first start makes it
    llm = make_llm(
        MODEL, specexpert={"budget": 0.25, "disk": {"path": str(pack_dir), "residency": "slots"}}
    )
    yield llm, vanilla_reference(MODEL)
    shutdown(llm)


def expert_parameters(model) -> list[tuple[int, str, int | None]]:
    """Worker side: per offloaded layer, how many experts its vLLM parameter holds,
    where the engine reads its experts from, and the slot pools' reach its kernel
    gave."""
    from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts

    return [
        (
            m.w13_weight.shape[0],
            type(m.engine.layers[m.layer_name].experts).__name__,
            m.engine.layers[m.layer_name].pool_reach,
        )
        for m in model.modules()
        if isinstance(m, OffloadedRoutedExperts)
    ]


def test_the_first_start_made_the_pack_and_vllm_loaded_no_expert(engine, pack_dir):
    llm, _ = engine
    assert (pack_dir / "manifest.json").is_file()
    layers = num_moe_layers(MODEL)
    # (the CPU kernel's 32-bit offsets: every pool is checked against them)
    assert llm.apply_model(expert_parameters)[0] == [(1, "DiskExperts", 2**31 - 1)] * layers


@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_fetch_from_disk_is_identical_to_vanilla(engine, budget):
    llm, reference = engine
    vllm_specexpert.reconfigure(llm, budget=budget)
    outputs = greedy(llm)
    assert [c.token_ids for c in outputs] == [c.token_ids for c in reference]
    assert [c.logprobs for c in outputs] == [c.logprobs for c in reference]
    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["output"] == "exact"
    disk = stats["disk"]
    decode = stats["total"]["decode"]
    prefill = stats["total"]["prefill"]
    # Every expert loaded came from the disk: one read per expert moved.
    assert decode["misses"] > 0
    assert disk["reads"] == decode["loads"] + prefill["loads"]
    assert disk["bytes"] == decode["bytes_loaded"] + prefill["bytes_loaded"]
    # Every slot holds the bytes the pack has for the expert the map says (read again):
    # the own slots and the shared region's rows the layer holds.
    assert llm.apply_model(cache_invariants)[0] == list(stats["resident_per_layer"].values())


@pytest.mark.parametrize(
    "mode",
    [{"predictor": "router"}, {"cache": "lfu"}, {"cache": "static"}],
    ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()),
)
def test_exact_modes_read_ahead_from_disk_and_stay_identical(engine, mode):
    llm, reference = engine
    vllm_specexpert.reconfigure(llm, budget=0.25, miss_policy="fetch", **mode)
    assert [c.token_ids for c in greedy(llm)] == [c.token_ids for c in reference]
    stats = vllm_specexpert.get_stats(llm)[0]
    loads = stats["total"]["decode"]["loads"] + stats["total"]["prefill"]["loads"]
    assert stats["output"] == "exact" and stats["disk"]["reads"] == loads > 0
    if "predictor" in mode:  # its prefetches are disk reads too
        assert stats["total"]["decode"]["prefetched"] > 0


def test_an_approximate_mode_runs_from_disk_and_says_so(engine):
    llm, reference = engine
    vllm_specexpert.reconfigure(llm, budget=0.25, miss_policy="drop", cache="lru")
    outputs = greedy(llm)
    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["output"] == "approximate" and stats["total"]["decode"]["misses"] > 0
    assert len(outputs) == len(reference)


def fail_reads_of(layer_index: int, expert: int | None):
    """Worker side (``apply_model``): reads of ``expert`` of the ``layer_index``-th MoE
    layer fail from now on with an I/O error (``None``: no read fails)."""

    def install(model) -> None:
        import errno

        from vllm_specexpert.layers.routed_experts import OffloadedRoutedExperts

        layers = [m for m in model.modules() if isinstance(m, OffloadedRoutedExperts)]
        disk = layers[0].engine.store.tier("disk")
        file = disk.reader.file
        read = getattr(file, "unbroken_read_into", file.read_into)
        file.unbroken_read_into = read
        if expert is None:
            file.read_into = read
            return
        bad = disk.pack.layers[layers[layer_index].layer_name].tensors[1].at(expert)

        def read_into(buffer, offset, length):
            if offset == bad:
                raise OSError(errno.EIO, "Input/output error (injected by the test)")
            read(buffer, offset, length)

        file.read_into = read_into

    return install


def test_a_read_error_fails_only_the_requests_that_needed_the_expert(engine):
    from vllm import SamplingParams

    llm, reference = engine
    vllm_specexpert.reconfigure(llm, budget=0.25, miss_policy="fetch", cache="lru")
    # An expert of the last layer that some prompts' tokens route to and others' do not
    # (checked below: both kinds must occur), not resident after the reconfigure.
    llm.apply_model(fail_reads_of(num_moe_layers(MODEL) - 1, 20))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.apply_model(fail_reads_of(0, None))
    failed = [o.finish_reason == "error" for o in outputs]
    assert any(failed) and not all(failed), failed
    for output, expected, error in zip(outputs, reference, failed, strict=True):
        if not error:  # the others ran exactly, as vanilla did
            assert list(output.token_ids) == expected.token_ids
    assert vllm_specexpert.get_stats(llm)[0]["disk"]["failed"] > 0
    # The engine is up, and the expert is read again when next needed.
    assert [c.token_ids for c in greedy(llm)] == [c.token_ids for c in reference]


def test_a_failed_pass_leaves_nothing_in_the_prefix_cache(engine):
    # A prompt of several 128-token KV blocks (full blocks enter vLLM's prefix cache)
    # fails: an expert of the second MoE layer unreadable, so every later layer's KV
    # of its tokens was computed without it. Once the expert reads again, the same
    # prompt must give what it gave before the failure, not a hit on those blocks.
    from vllm import SamplingParams

    llm, _ = engine
    text = (model_path(TRAINED_MODEL) / "heldout" / "test.txt").read_text()
    prompt = [text[:1200]]
    assert len(llm.get_tokenizer()(prompt[0]).input_ids) > 2 * 128
    clean = greedy(llm, prompt)
    llm.reset_prefix_cache()
    llm.apply_model(fail_reads_of(1, 40))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        (failed,) = llm.generate(prompt, params, use_tqdm=False)
    finally:
        llm.apply_model(fail_reads_of(0, None))
    assert failed.outputs[0].finish_reason == "error"
    assert greedy(llm, prompt) == clean  # (the logprobs too)


def report_free(free_bytes: int | None):
    """Worker side (``apply_model``): the engine's memory report says ``free_bytes`` of
    RAM are free from now on, the slots a reconfigure frees included (``None``: what
    the machine says)."""

    def install(model) -> None:
        import dataclasses

        import vllm_specexpert.budget_plan as plan_module
        from vllm_specexpert.tiers import memory

        if free_bytes is None:
            plan_module.memory_report = memory.memory_report
            return

        def report(device, settings, freed_bytes=0):
            real = memory.memory_report(device, settings, freed_bytes)
            return dataclasses.replace(real, free_bytes=free_bytes, freed_bytes=0)

        plan_module.memory_report = report

    return install


def test_auto_fits_the_slots_under_free_ram_smaller_than_the_model(engine):
    GiB = 1 << 30
    llm, reference = engine
    stats = vllm_specexpert.get_stats(llm)[0]
    start = stats["budget"]  # the memory plan made at start, on this machine's memory
    assert start["kv_bytes"] == GiB  # (VLLM_CPU_KVCACHE_SPACE=1: conftest)
    # The workspace holds one kernel chunk's scratch (min(batched tokens, 256) x top_k x
    # intermediate x 8 B), and the disk's bounce buffers where a tensor needs them.
    config = json.loads((model_path(MODEL) / "config.json").read_text())
    tokens = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    chunk = min(tokens, 256) * config["num_experts_per_tok"] * config["moe_intermediate_size"] * 8
    assert start["workspace_bytes"] >= chunk
    experts = stats["store_bytes"]  # (every expert of every layer, in the pack)
    # Now the machine has, past the workspace and the reserve (1 GiB), free RAM for 0.4
    # of the experts (the KV cache is in use since start): the model is bigger than its
    # RAM (a rebuild's rule: docs/configuration.md).
    free = GiB + int(start["workspace_bytes"]) + int(0.4 * experts)
    llm.apply_model(report_free(free))
    try:
        config = vllm_specexpert.reconfigure(llm, budget="auto")
    finally:
        llm.apply_model(report_free(None))
    assert [c.token_ids for c in greedy(llm)] == [c.token_ids for c in reference]
    stats = vllm_specexpert.get_stats(llm)[0]
    fit = stats["budget"]
    assert fit["room_bytes"] == free and fit["reserve_bytes"] == GiB
    assert fit["slot_bytes"] <= fit["space_bytes"] == int(0.4 * experts)
    slots = fit["slots_per_layer"]  # (the memory's: split into own slots and the region)
    own = set(stats["slots_per_layer"].values())
    rows = set(stats["region_rows_per_layer"].values())
    layers = len(stats["layers"])
    assert len(own) == len(rows) == 1 and layers * own.pop() + rows.pop() == layers * slots
    experts_per_layer = next(iter(stats["experts_per_layer"].values()))
    top_k = json.loads((model_path(MODEL) / "config.json").read_text())["num_experts_per_tok"]
    assert top_k <= slots < experts_per_layer
    assert config["budget"] == "auto"  # (as given: what it came to is the stats' budget)
    assert stats["total"]["decode"]["misses"] > 0
    assert fit["reason"].startswith(f"budget auto: {slots} of {experts_per_layer} experts")


def test_an_explicit_budget_beyond_free_ram_is_refused_and_the_engine_keeps_running(engine):
    llm, reference = engine
    vllm_specexpert.reconfigure(llm, budget=0.25)
    experts = vllm_specexpert.get_stats(llm)[0]["store_bytes"]
    llm.apply_model(report_free((1 << 30) + int(0.3 * experts)))  # 0.3 past the reserve
    try:
        with pytest.raises(SpecExpertConfigError, match="do not fit") as err:
            vllm_specexpert.reconfigure(llm, budget=0.5)
        assert err.value.field_name == "budget"
    finally:
        llm.apply_model(report_free(None))
    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["config"]["budget"] == 0.25  # as it was
    assert [c.token_ids for c in greedy(llm)] == [c.token_ids for c in reference]


def change_every_expert(pack_dir, index: int) -> tuple[bytes, object]:
    """Flip a byte of every expert's ``w2_weight`` in the ``index``-th MoE layer of the
    pack at ``pack_dir`` (through the page cache, as a program editing the file would):
    the file as it was, and the layer's manifest entry."""
    from vllm_specexpert.tiers.expert_pack import ExpertPack

    records = pack_dir / "experts.bin"
    saved = records.read_bytes()
    layer = ExpertPack(pack_dir).manifest.layers[index]
    w2 = next(t for t in layer.tensors if t.name == "w2_weight")
    with open(records, "r+b") as f:
        for expert in range(layer.num_experts):
            f.seek(w2.at(expert) + 10)
            f.write(bytes([saved[w2.at(expert) + 10] ^ 0x01]))
    return saved, layer


def test_a_reconfigure_that_cannot_read_an_expert_leaves_the_engine_serving(engine, pack_dir):
    # One byte of every expert's w2_weight in the 4th MoE layer flipped, then a
    # reconfigure: its warm start cannot read them. One error naming disk.path and the
    # experts; the engine serves on as it was, and once the file is whole, exactly.
    llm, reference = engine
    vllm_specexpert.reconfigure(llm, budget=0.25, miss_policy="fetch", cache="lru")
    saved, layer = change_every_expert(pack_dir, 3)
    try:
        with pytest.raises(SpecExpertConfigError) as error:
            vllm_specexpert.reconfigure(llm, budget=0.5)
    finally:
        (pack_dir / "experts.bin").write_bytes(saved)
    assert error.value.field_name == "disk.path" and "\n" not in str(error.value)
    assert f"{layer.name}'s experts [0, 1, 2" in error.value.problem
    assert "does not match its checksum" in error.value.problem
    assert vllm_specexpert.get_stats(llm)[0]["config"]["budget"] == 0.25  # as it was
    assert [c.token_ids for c in greedy(llm)] == [c.token_ids for c in reference]
    vllm_specexpert.reconfigure(llm, budget=0.5)  # whole again: it reads them
    assert [c.token_ids for c in greedy(llm)] == [c.token_ids for c in reference]


def test_a_pack_whose_expert_0_is_unreadable_in_every_layer_starts(engine, pack_dir, tmp_path):
    # The layer's proof of the pack's form read expert 0, and its checksum failure
    # stopped the start. It proves the form on the first expert it can read; expert 0
    # fails only the requests that need it, as any unreadable expert does.
    from vllm import SamplingParams

    from vllm_specexpert.tiers.expert_pack import ExpertPack

    _, reference = engine
    copy = tmp_path / "pack"
    shutil.copytree(pack_dir, copy)
    with open(copy / "experts.bin", "r+b") as f:
        for layer in ExpertPack(copy).manifest.layers:
            w2 = next(t for t in layer.tensors if t.name == "w2_weight")
            f.seek(w2.at(0) + 10)
            byte = f.read(1)[0]
            f.seek(w2.at(0) + 10)
            f.write(bytes([byte ^ 0x01]))
    llm = make_llm(MODEL, specexpert={"budget": 12, "disk": {"path": str(copy)}})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        for output, expected in zip(outputs, reference, strict=True):
            if output.finish_reason != "error":
                assert list(output.token_ids) == expected.token_ids
        assert vllm_specexpert.get_stats(llm)[0]["disk"]["failed"] >= num_moe_layers(MODEL)
    finally:
        shutdown(llm)


def test_the_disk_cannot_change_at_run_time(engine, tmp_path):
    llm, _ = engine
    with pytest.raises(SpecExpertConfigError, match=r"disk.*opened and checked"):
        vllm_specexpert.reconfigure(llm, disk={"path": str(tmp_path), "residency": "slots"})


def test_a_pack_of_another_model_is_refused_at_start(pack_dir):
    # The widened model's pack is not the trained model's (same layer names, other
    # checkpoint files, shapes and bytes).
    with pytest.raises(SpecExpertConfigError, match=r"disk\.path.*another model"):
        start_engine(
            str(model_path(TRAINED_MODEL)), {"budget": 0.25, "disk": {"path": str(pack_dir)}}
        )


def other_isa_pack(out) -> str:
    """A pack of the model in the other ISA's prepacked layout; returns that ISA."""
    import torch

    from vllm_specexpert.cli import main
    from vllm_specexpert.tiers.kernel_form import cpu_kernel_form

    other = "vec" if cpu_kernel_form(torch.bfloat16).isa == "amx" else "amx"
    main(["pack", str(model_path(MODEL)), "--out", str(out), "--isa", other])
    return other


def test_a_pack_of_another_isa_is_refused_at_start(tmp_path):
    other = other_isa_pack(tmp_path / "pack")
    with pytest.raises(SpecExpertConfigError, match=rf"disk\.path.*{other} prepacked layout"):
        start_engine(
            str(model_path(MODEL)), {"budget": 0.25, "disk": {"path": str(tmp_path / "pack")}}
        )


def test_a_pack_whose_bytes_are_another_isas_is_refused_by_the_layers_own_proof(tmp_path):
    # The manifest names this machine's ISA (as if written by a build that prepacks
    # otherwise): the checks of the form pass, and the layer's proof, its own runtime
    # form of one checkpoint expert against the pack's bytes, refuses it. Where vLLM's
    # build for this CPU prepacks both ISAs alike (no AMX kernel in it), the other ISA's
    # bytes are this one's: expert 0 then holds expert 1's bytes, its checksum made to
    # match (a writer's wrong offset), which the proof refuses as well.
    import torch

    from vllm_specexpert.tiers.expert_pack import RECORDS_FILE, ExpertPack, checksum
    from vllm_specexpert.tiers.kernel_form import cpu_kernel_form

    other_isa_pack(tmp_path / "pack")
    manifest = json.loads((tmp_path / "pack" / "manifest.json").read_text())
    manifest["form"]["isa"] = cpu_kernel_form(torch.bfloat16).isa
    (tmp_path / "pack" / "manifest.json").write_text(json.dumps(manifest))
    if amx_prepacked_as_vec():
        print("this CPU's vLLM build prepacks amx as vec: expert 0 given expert 1's bytes")
        layer = ExpertPack(tmp_path / "pack").manifest.layers[0]
        with open(tmp_path / "pack" / RECORDS_FILE, "r+b") as f:
            for index, tensor in enumerate(layer.tensors):
                f.seek(tensor.at(1))
                data = f.read(tensor.nbytes)
                f.seek(tensor.at(0))
                f.write(data)
                entry = manifest["layers"][0]["tensors"][index]
                entry["xxh3"][0] = checksum(data, layer.name, 0, tensor.name)
        (tmp_path / "pack" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SpecExpertConfigError, match=r"disk\.path.*expert 0 of .* differs"):
        start_engine(
            str(model_path(MODEL)), {"budget": 0.25, "disk": {"path": str(tmp_path / "pack")}}
        )


def amx_prepacked_as_vec() -> bool:
    """Whether vLLM's kernel build for this CPU orders an ``amx`` prepack as ``vec``."""
    import torch
    from vllm._custom_ops import cpu_prepack_moe_weight

    weight = torch.randn(1, 64, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    return torch.equal(cpu_prepack_moe_weight(weight, "amx"), cpu_prepack_moe_weight(weight, "vec"))


def test_a_truncated_pack_is_refused_at_start(pack_dir, tmp_path):
    copy = tmp_path / "pack"
    shutil.copytree(pack_dir, copy)
    records = copy / "experts.bin"
    os.truncate(records, records.stat().st_size - 4096)
    with pytest.raises(SpecExpertConfigError, match=r"disk\.path.*truncated"):
        start_engine(str(model_path(MODEL)), {"budget": 0.25, "disk": {"path": str(copy)}})


def test_a_directory_of_other_files_is_not_taken_for_a_pack(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SpecExpertConfigError, match=r"disk\.path.*holds other things"):
        start_engine(str(model_path(MODEL)), {"budget": 0.25, "disk": {"path": str(tmp_path)}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_prompts_are_not_degenerate(engine):
    _, reference = engine
    assert len({tuple(c.token_ids) for c in reference}) == len(PROMPTS)
