"""vllm-specexpert: MoE inference with experts in a slow tier and a device expert cache.

Enable with ``VLLM_PLUGINS=specexpert`` (or no VLLM_PLUGINS at all) and
``additional_config={"specexpert": {...}}``; see :class:`SpecExpertConfig`.

The relation map. Layers from the bottom, each a floor: a module's layer is one above
the highest it imports (a package counts as one), so nothing imports from above and
there is no cycle. ``tests/test_layout.py`` checks that every module is named here, at
its floor::

     1  config/         every setting and its checks: specexpert, sections, rules,
                        errors, modes (each mode's traits, as data), fit (what it needs
                        of the model), sizing (a budget's slots from the memory),
                        budget_form (how a budget is written), switch (what reconfigure
                        can change)
     1  quant_formats   quantized checkpoints' packed experts: read, dequantize,
                        quantize
     1  phases          which tokens of a forward pass are decode, which prefill
     1  log             vLLM's logger for the package
     2  artifacts       manifest and tensors of an artifact directory, model fingerprint
     2  quant_config    a checkpoint's quantization_config -> its experts' format
     2  stats           counters per layer and phase; the stats file; a feature's
                        /metrics series (Series)
     2  triton_kernels/ CUDA kernels: predict (next-layer routing), slots (map, copies),
                        dequantize (packed experts to bf16), estimate (the estimator)
     3  calibration     default vectors, co-activation, TAE percentiles (an artifact)
     3  architectures   the supported MoE architectures and their routing shape
     3  handoff         what the scheduler process hands the workers: StepDemand, its
                        counters
     4  report          the stats dict and the summary line
     3  metrics         /metrics: the snapshot directory and its collector
     2  handback        what the workers hand back: the rows, then the requests, whose
                        experts were unreadable
     3  tiers/          where experts live and how they move: store (slow tier), slots
                        (per-layer and shared pools), shared_region (slot rows every
                        layer's tensor covers: a call's streamed experts), eviction,
                        cache (one layer's residency), loader (copies in flight),
                        link/ (base, cpu, cuda),
                        host (experts computed on the host), staging (host <-> device),
                        disk (the disk tier: a layer's experts read from its pack),
                        mapped (the pack mapped, the kernel on its pages),
                        pack_lease (a read lease: no write to the pack unseen),
                        pack_experts (a pack layer as a slow tier: both residencies),
                        disk_reader (whole-tensor reads at a queue depth, O_DIRECT),
                        kernel_form (experts as the kernel reads them), expert_pack
                        (the disk's file, in the kernel's form), pack_writer
                        (writing a pack, atomically), pack_lock (a pack's lock: engines
                        shared, a writer alone), checkpoint_experts (one expert read
                        from a checkpoint), memory (what the sized tier has free),
                        host_cache (CUDA: pinned host rows between disk and device),
                        slow_tiers (the registry of slow tiers besides the host's:
                        disk)
     4  budget_plan     what a budget comes to in slots per layer, and why (sized from
                        the memory at the first layer and at each reconfigure), and
                        whether the kernel can address its pools
     4  vllm_hooks      every patch of vLLM's code, behaviour given as callbacks
     4  peers/          mesh peers on Ray: tier (the engine's side, of the next four),
                        start (placement; the peers started and checked), calls (rows
                        sent, outputs received, timeouts, failures), health (probes;
                        leaving and rejoining the rotation), peer_state (one peer: its
                        rotation state, its counters), layer_view (one layer's view),
                        shard (a peer's experts and kernel), check (a peer's proof that
                        it computes), ray_cluster (joining Ray)
     4  predict/        next-layer predictors: base, router, quasi_hidden; path (a
                        step's routing path); draft (the lookahead draft's routes, the
                        ELB); estimator_network (the network, its artifact), estimator
                        (its predictors), hybrid (its layers); network_file (a trained
                        network's directory: one saver, one loader)
     4  layer_call      LayerCall: one layer call from the adapter to the kernel (its
                        tokens, routing on the device, then on the host, counters)
     5  places          where entries run besides the slots, one registry per layer
                        (Place, its counters; Dropped: the one every layer has)
     6  policy/         miss policies that only decide (a MissPlan over places): base,
                        context, fetch, stream, speculate, drop (those that need no
                        feature's place), buddies (BuddyMoE's lists and substitution)
     5  planner/        what to load ahead: prefetch, plec (shared pool), lookahead (the
                        draft's routes), governor (the draft length per step),
                        early_fire (rows sent to mesh peers ahead of the router),
                        measured (costs per choice), switch (a technique on where
                        it pays, measured), bytes_judge (a technique on while its
                        ghost residency reads no more than plain frequency's)
     4  stats_writers   the threads that write the stats file and the /metrics snapshot
     6  schedule/       vLLM adapter in the scheduler: scheduler (fails the requests
                        whose experts could not be read), token_scheduler, grouping
     7  layer_state     OffloadedLayer: what every offloaded layer has, its places
     5  device_runs/    how a call's device entries run, chosen when a layer is
                        composed: resident (every expert in the slot of its id),
                        one_launch (the survey of a call; every expert it needs, one
                        launch; its overflow: token_groups, exact, or streamed),
                        kernel_launch (the one way a launch is made)
     7  execute         a miss policy's plan run over the device run and the places;
                        the one place that carries out a plan
     8  layer_checks    what a config needs of the loaded layers, whatever the features
     8  quality/        the quality budget: logits (the model's head, two results
                        compared), budget (batch classes, windows, switches), monitor
                        (sampled rows, their differences, judged at the final norm)
     8  pipeline        a layer's call as stages composed once (on_call, route, the
                        host read, plan, run, finish), the decode call's typed values
     9  read_ahead      the following layer's reads ahead through the shared region,
                        started before a launch (they overlap its compute)
     9  features/       EngineFeature (base: hooks, EngineParts), the registry
                        (__init__): quality, prediction, mesh (peers, early fire),
                        lookahead (governor, the draft's planner), draft_routes (the
                        draft's routes handed to its target), step_demand (path
                        score, PLEC), next_step (a decode call's routes to the
                        residency that predicts from them), scheduler_counters (the
                        token scheduler's, handed over each step); the modes with a
                        place, each one module (place, counters, policies, feature):
                        substitution (buddy, random: buddy lists, gates), host_compute
                        (cpu, auto, auto_buddy), low_bit (lowbit: INT4 copies' slots),
                        mesh (PeersFirst around any policy)
    10  engine          OffloadEngine: the exact spine per layer call, features around
                        it
    11  layers/         vLLM adapter in the worker: routed_experts (the layer, the
                        custom op), slow_tier (a layer's experts allocated, loaded and
                        handed to the store: host, packed, INT4 copies, a slow
                        tier), disk_layers (the disk tier's side: the pack checked
                        against the kernel, CUDA host rows, the draft's regions),
                        draft_sizing (what the lookahead draft's layers take of memory),
                        slot_kernel (vLLM's kernel on slots), engines,
                        packed_experts, int4_copies (lowbit's and the draft's INT4
                        experts), int4_gemm (the draft's, computed packed by vLLM's
                        W4A16 GEMM), pack_form_check (the pack against the kernel),
                        model_classes (wiring after load),
                        forward_phase, lookahead_driver (the draft's rounds),
                        router_free, final_tap, failed_requests (rows -> requests),
                        sizing (what budget sizing needs of vLLM's settings)
    12  worker          the RPCs behind get_stats, reconfigure, reset_stats
    13  validate        engine-config checks where vLLM builds the engine config
    13  __init__        the user API: get_stats, reconfigure, reset_stats
    14  plugins         the vllm.general_plugins entry point and --plugins
    15  tools/          the embedded model, training, corpus, harness, offline passes,
                        demo, server: never imported by the runtime (layers 1-14)
    16  cli             the specexpert command (serve, vllm, the tools by name)

One decode step of layer l, following the router's ids::

    vLLM MoERunner ─► layers.routed_experts.offloaded_forward (custom op)
      ─► engine.run_call ─► the layer's pipeline (pipeline.LayerPipeline), composed
      when the layer was equipped and whenever the features change:
      ├─ on_call:  draft_routes (a draft's routes to its target's lookahead)
      ├─ route:    prediction (recall this layer's; speculate: run it instead;
      │            predict layer l+1), mesh (early fire: rows sent to peers ahead)
      ├─ one host read: the router's ids and the route stages' tensors
      ├─ plan:     prediction (score; prefetch before the kernel), mesh (no_stop
      │            fires layer l+1), step_demand (score the path; PLEC plans),
      │            next_step (markov: the routes, before the loads)
      ├─ run:      quality (samples the other result beside; exact while over) around
      │    execute.resolve: survey ─► policy.plan (only if something is missing)
      │      ─► execute.execute ─► tiers.loader (loads) ─► layers.slot_kernel (vLLM's
      │      kernel on the slots); the layer's places, each a feature's: INT4 copies
      │      (low_bit), peers (mesh, via PeersFirst), host (host_compute); every
      │      expert in the slot of its id: device_runs.resident.launch_resident (the kernel alone)
      └─ finish:   mesh (forget what was fired), step_demand (PLEC: the next group)
    An expert the slow tier cannot supply: the call again without it
    (execute.execute_without)."""

from __future__ import annotations

from typing import Any

from vllm_specexpert.config import (
    LinkConfig,
    SpecExpertConfig,
    SpecExpertConfigError,
    SpecExpertUnsupportedError,
)

__version__ = "0.1.0"


def _rpc(llm: Any, method: str, *args: Any) -> list[Any]:
    """``llm.collective_rpc`` of one of the plugin's worker methods, after checking that
    the plugin runs in this ``LLM`` (else one error saying why it does not)."""
    import os

    from vllm_specexpert.config import ADDITIONAL_CONFIG_KEY
    from vllm_specexpert.worker import WORKER_EXTENSION

    vllm_config = llm.llm_engine.vllm_config
    if ADDITIONAL_CONFIG_KEY not in (vllm_config.additional_config or {}):
        raise RuntimeError(
            "specexpert: this LLM runs without the plugin: its "
            "additional_config has no 'specexpert' key"
        )
    extension = vllm_config.parallel_config.worker_extension_cls
    if extension != WORKER_EXTENSION:
        plugins = os.environ.get("VLLM_PLUGINS")
        if plugins is not None and "specexpert" not in plugins.split(","):
            raise RuntimeError(
                "specexpert: this LLM runs without the plugin although additional_config "
                f"configures it: VLLM_PLUGINS={plugins!r} kept it from loading; add "
                "specexpert to VLLM_PLUGINS, or unset it"
            )
        raise RuntimeError(
            f"specexpert: worker_extension_cls={extension!r} replaces the "
            "plugin's, so its RPCs are unavailable (stats_path still works)"
        )
    return llm.collective_rpc(method, args=args)


def get_stats(llm: Any) -> list[dict[str, Any]]:
    """Per-worker statistics of an ``LLM`` running with the plugin (one dict per worker)."""
    return _rpc(llm, "specexpert_stats")


def reconfigure(llm: Any, **changes: Any) -> dict[str, Any]:
    """Change the running engine's config, e.g. ``reconfigure(llm, budget=0.25)``.
    Caches are rebuilt without reloading weights; counters restart. Settings kept from
    before that have no effect under the new mode return to their defaults. Returns the
    config; a bad change raises :class:`SpecExpertConfigError` and leaves the engine as
    it was."""
    from vllm_specexpert.worker import CONFIG_ERROR

    SpecExpertConfig.check_changes(changes)
    reply = _rpc(llm, "specexpert_reconfigure", changes)[0]
    if CONFIG_ERROR in reply:
        raise SpecExpertConfigError(*reply[CONFIG_ERROR])
    return reply


def reset_stats(llm: Any) -> None:
    """Zero the counters of every worker."""
    _rpc(llm, "specexpert_reset_stats")


__all__ = [
    "LinkConfig",
    "SpecExpertConfig",
    "SpecExpertConfigError",
    "SpecExpertUnsupportedError",
    "get_stats",
    "reconfigure",
    "reset_stats",
]
