"""How many slots a budget buys on this machine: one pure function of a memory report
and the model's shapes (:func:`fit_budget`); how a budget is written is
:mod:`.budget_form`'s.

A budget is a fraction of each layer's experts, a count per layer, a size (``"12GiB"``,
``"800MB"``: the tier's bytes over all MoE layers, split evenly across them, or pooled
under ``plec``), or ``"auto"``. ``auto`` takes the memory free once the weights are
loaded and leaves, before any slot::

    free      = the device's free memory; on the CPU build min(MemAvailable, what the
                process's cgroup leaves: limit - charged, the least over it and its
                limited ancestors)
    room      = free - (1 - utilization) * total
    kv        = the explicit KV cache size, else min(max_num_seqs * max_model_len *
                KV bytes per token, KV_SHARE * room); the CPU build gives vLLM an
                explicit one when the engine is configured: this, or under the disk
                tier with ``auto``, the batch's that reads the fewest modeled expert
                bytes a token (:func:`best_batch`, of the memory the engine's
                processes and the model's other weights leave)
    workspace = min(max_num_batched_tokens, KERNEL_CHUNK_TOKENS (256)) * top_k
                * moe_intermediate_size * WORKSPACE_BYTES (8) + the slow tier's read buffers
    draft     = with lookahead, what its draft (built after the slots) takes of this memory:
                its slots (bf16, or INT4 where it computes them packed: the disk tier on
                the CPU build), and its INT4 experts on the CPU build (under the disk
                tier, the rows of them it holds: ``lookahead.draft_cache`` as a share)
    slots     = (room - kv - workspace - draft - RESERVE_BYTES) / (MoE layers * (expert
                bytes + draft row bytes)), clamped to [top_k, experts]; below top_k the
                start is refused. ``draft row bytes``: under the disk tier with
                ``lookahead.draft_cache: "auto"``, each slot brings the draft's INT4 row
                (an INT4 expert's bytes), else 0. Where the draft's rows are lent
                (``SpecExpertConfig.lends_draft_rows``), the slots take their bytes
                until the draft first drafts: ``slots * (MoE layers * draft row bytes)
                / (MoE layers * expert bytes)`` slots more a layer.

A rebuild (``reconfigure``) never takes more than the start's space, and within it::

    space = max(the slots it frees, room - workspace - RESERVE_BYTES)

(``room`` counting the freed slots as free): it may keep what runs now, and grow only
where the memory free beyond the slots still covers the passes' workspace and the
reserve. The KV cache is allocated by then (not free, so not taken again); what else is
free is measured again, not taken from the plan (another process, or this one, may have
grown since the start).

``utilization`` is vLLM's ``gpu_memory_utilization`` where vLLM sizes the KV cache from
it (CUDA, and the CPU build without an explicit KV size), else 1. An explicit budget is
checked against the same space: more is refused unless ``allow_budget_beyond_memory``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vllm_specexpert.config.budget_form import parse_size
from vllm_specexpert.config.errors import SpecExpertConfigError
from vllm_specexpert.config.fit import budget_slots

GiB = 1 << 30

RESERVE_BYTES = GiB
"""Left free beyond everything counted (llama.cpp's ``--fit`` keeps the same 1 GiB margin)."""

KV_SHARE = 0.25
"""Without an explicit KV cache size, the KV cache is a full-length cache for
``max_num_seqs`` sequences, or this share of the memory, whichever is smaller: on the CPU
build vLLM is given that size when the engine is configured (:func:`kv_cache_for_batch`,
of the memory free then); on CUDA it is the floor vLLM's own sizing finds left (of the
room)."""

WORKSPACE_BYTES = 8
"""Memory a pass takes per token, per routed expert, per intermediate channel. vLLM's CPU
kernel's scratch measured 2.2 bytes here (its bf16 gate/up output; ``T=4096, top_k=8,
I=8192``), and the allocator keeps a pass's scratch after it, so a later pass needs as
much again. Before the passes ran in chunks (:data:`KERNEL_CHUNK_TOKENS`), on the 1.28x-RAM
disk model (``I=40176``, 2048 tokens a pass) the process
grew by 6.5 GB after sizing (the KV cache's 1 GiB, 4 GB held after vLLM's warm-up pass,
2.5 GB more at its peak); 4 bytes (3.3 GB with the disk's buffers) let ``auto`` take 17.8
GB of slots, and the process was killed out of memory at 23.9 GB of 24.7. With 8 bytes
(6.0 GB) it took 15.3 GB and peaked at 23.3 GB."""

KERNEL_CHUNK_TOKENS = 256
"""Most tokens one expert-kernel launch runs: a longer pass (prefill) runs in chunks of
its rows, so the kernel's scratch (its gate/up output, ``tokens x top_k x
intermediate``) is a chunk's, not ``max_num_batched_tokens``'s, and the workspace is
sized for a chunk. Exact: the kernel computes each token independently of the others in
its launch. On the 1.28x-RAM disk model (2048 tokens a pass) the process held about 5
GB besides its slots before the chunks, 2.7 GB with them (a peak of 18.2 GB with 15.4 GB
of slots resident), its 1 GiB KV cache included."""


def gib(size: float) -> str:
    """``size`` bytes in GiB, or MiB below one GiB."""
    return f"{size / GiB:.1f} GiB" if abs(size) >= GiB else f"{size / 2**20:.1f} MiB"


@dataclass(frozen=True)
class MemoryReport:
    """The memory of the tier being sized, when the weights are loaded: GPU memory on
    CUDA, RAM on the CPU build."""

    total_bytes: int
    free_bytes: int
    """Free now (``cudaMemGetInfo``; ``MemAvailable`` on the CPU build)."""
    utilization: float = 1.0
    """The share of ``total_bytes`` vLLM may use, where it sizes the KV cache from it."""
    kv_cache_bytes: int | None = None
    """The KV cache's explicit size, if given (``kv_cache_memory_bytes``,
    ``VLLM_CPU_KVCACHE_SPACE``)."""
    freed_bytes: int = 0
    """Slots that are freed before the new ones are made (``reconfigure``)."""
    cgroup_limit_bytes: int | None = None
    """The memory limit of the process's cgroup (a container's; the tightest of its
    ancestors'), where one is set; ``free_bytes`` counts what it leaves already."""


@dataclass(frozen=True)
class ModelShapes:
    """What sizing needs of the model and of vLLM's settings."""

    moe_layers: int
    num_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    expert_bytes: int
    """One slot's bytes (an expert in the kernel's form)."""
    moe_intermediate_size: int
    kv_bytes_per_token: int
    """KV cache bytes of one token over all layers."""
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    staging_bytes: int = 0
    """Buffers the slow tier reads through besides the slots (the disk's: a bounce buffer
    per reader thread, where a tensor is not aligned for ``O_DIRECT``)."""
    draft_slot_bytes: int = 0
    """What the ``lookahead`` draft, built after the slots are sized, will take of the
    same memory for its slots (bf16, or INT4 where it computes them packed)..."""
    draft_int4_bytes: int = 0
    """... and for its INT4 experts (where they share it: the CPU build; under the disk
    tier, its rows of them when their count is fixed)."""
    draft_row_bytes: int = 0
    """Over all MoE layers, one INT4 row of the draft per slot when the rows are sized
    with the slots (``lookahead.draft_cache: "auto"``): what each slot per layer brings."""


@dataclass
class SizingSettings:
    """What vLLM's settings tell sizing (the adapter fills it from the vLLM config, and
    counts the MoE layers as the model builds them). An engine built without vLLM has
    none of them: no KV cache, no batched tokens, and its MoE layers given."""

    moe_layers: int = 0
    moe_intermediate_size: int = 0
    utilization: float = 1.0
    """:attr:`MemoryReport.utilization`."""
    kv_cache_bytes: int | None = None
    kv_bytes_per_token: int = 0
    max_num_seqs: int = 0
    max_model_len: int = 0
    max_num_batched_tokens: int = 0
    block_size: int = 0
    """Tokens per block of vLLM's KV cache (0: none; a size given to vLLM holds whole
    blocks)."""
    hidden_size: int = 0
    """The model's hidden size: a probe launch of the expert kernel takes tokens of it
    (0: unknown, no probe)."""
    draft_slot_bytes: int = 0
    """:attr:`ModelShapes.draft_slot_bytes`, counted per MoE layer as the model builds."""
    draft_int4_bytes: int = 0
    """:attr:`ModelShapes.draft_int4_bytes`, counted likewise."""
    draft_row_bytes: int = 0
    """:attr:`ModelShapes.draft_row_bytes`, counted likewise."""
    draft_host_bytes: int = 0
    """What the ``lookahead`` draft will take of the host's memory apart from the
    device's (CUDA: its INT4 experts), which ``disk.host_cache`` is sized around."""

    def count_layer(
        self,
        moe_intermediate_size: int,
        draft_slot_bytes: int = 0,
        draft_int4_bytes: int = 0,
        draft_host_bytes: int = 0,
        draft_row_bytes: int = 0,
    ) -> None:
        """One more MoE layer was built; its ``lookahead`` draft twin will take
        ``draft_slot_bytes`` and ``draft_int4_bytes`` of the memory the slots are sized
        from, ``draft_host_bytes`` of the host's apart from it, and ``draft_row_bytes``
        more per slot of the layer."""
        self.moe_layers += 1
        self.moe_intermediate_size = max(self.moe_intermediate_size, moe_intermediate_size)
        self.draft_slot_bytes += draft_slot_bytes
        self.draft_int4_bytes += draft_int4_bytes
        self.draft_host_bytes += draft_host_bytes
        self.draft_row_bytes += draft_row_bytes

    def shapes(
        self, num_experts: int, top_k: int, expert_bytes: int, staging_bytes: int = 0
    ) -> ModelShapes:
        if self.moe_layers <= 0:
            raise RuntimeError("sizing a budget needs the model's MoE layers: none were counted")
        return ModelShapes(
            moe_layers=self.moe_layers,
            num_experts=num_experts,
            top_k=top_k,
            expert_bytes=expert_bytes,
            moe_intermediate_size=self.moe_intermediate_size,
            kv_bytes_per_token=self.kv_bytes_per_token,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            staging_bytes=staging_bytes,
            draft_slot_bytes=self.draft_slot_bytes,
            draft_int4_bytes=self.draft_int4_bytes,
            draft_row_bytes=self.draft_row_bytes,
        )


@dataclass(frozen=True)
class BudgetFit:
    """What a budget chose: slots per MoE layer, and why (the start line, the stats)."""

    slots_per_layer: int
    num_experts: int
    slot_bytes: int
    """All layers' slots."""
    basis: str
    """What the slots came from: ``budget auto: <the memory's accounting>``, ``budget 12GiB``."""
    parts: dict[str, float] = field(default_factory=dict)
    """The numbers behind ``basis`` (bytes): room, kv, workspace, reserve, space, and
    cgroup_limit where the process's cgroup is limited."""

    @property
    def reason(self) -> str:
        """E.g. ``budget auto: 37 of 64 experts per layer (4.2 GiB): 23.6 GiB free, ...``."""
        source, _, accounting = self.basis.partition(": ")
        chosen = (
            f"{source}: {self.slots_per_layer} of {self.num_experts} experts per layer "
            f"({gib(self.slot_bytes)})"
        )
        return f"{chosen}: {accounting}" if accounting else chosen

    def to_dict(self) -> dict:
        return {
            "slots_per_layer": self.slots_per_layer,
            "slot_bytes": self.slot_bytes,
            "reason": self.reason,
            "basis": self.basis,
            **{f"{k}_bytes": v for k, v in self.parts.items()},
        }


def space_for_slots(
    memory: MemoryReport, shapes: ModelShapes, planned: dict[str, float] | None = None
) -> dict[str, float]:
    """The bytes the slots may take, and the parts it leaves out (module doc).
    ``planned``: the parts sized at engine start, for a rebuild (module doc)."""
    room = memory.free_bytes + memory.freed_bytes - (1 - memory.utilization) * memory.total_bytes
    limit = memory.cgroup_limit_bytes
    cgroup = {} if limit is None else {"cgroup_limit": float(limit)}
    if planned is not None:
        fresh = room - planned["workspace"] - RESERVE_BYTES
        space = min(planned["space"], max(float(memory.freed_bytes), fresh))
        kept = {k: v for k, v in planned.items() if k != "cgroup_limit"}  # (measured now)
        return {**kept, "room": room, "reserve": float(RESERVE_BYTES), "space": space, **cgroup}
    sequence = float(shapes.max_model_len * shapes.kv_bytes_per_token)
    full = shapes.max_num_seqs * sequence
    if memory.kv_cache_bytes is not None:
        kv = float(memory.kv_cache_bytes)
    else:
        kv = _batch_kv(full, room)
    kv_parts = {"kv_per_sequence": sequence, "kv_full": full}
    workspace = (
        min(shapes.max_num_batched_tokens, KERNEL_CHUNK_TOKENS)
        * shapes.top_k
        * shapes.moe_intermediate_size
        * WORKSPACE_BYTES
        + shapes.staging_bytes
    )
    draft = {
        "draft_slots": float(shapes.draft_slot_bytes),
        "draft_int4": float(shapes.draft_int4_bytes),
    }
    space = room - kv - workspace - RESERVE_BYTES - sum(draft.values())
    return {
        "room": room,
        "kv": kv,
        **kv_parts,
        "workspace": float(workspace),
        "reserve": float(RESERVE_BYTES),
        **({k: v for k, v in draft.items() if v}),
        "space": space,
        **cgroup,
    }


def fit_budget(
    budget: float | int | str,
    shapes: ModelShapes,
    memory: MemoryReport | None,
    allow_beyond_memory: bool = False,
    planned: dict[str, float] | None = None,
    rows_unheld: bool = False,
) -> BudgetFit:
    """Slots per MoE layer for ``budget`` (module doc). ``memory``: ``None`` where the
    memory cannot be known (a fraction, count or size is then not checked against it;
    ``auto`` needs it). ``planned``: the start's parts, for a rebuild
    (:func:`space_for_slots`). ``rows_unheld``: the draft's rows are not made yet (lent
    to the slots), so a rebuild counts them too."""
    per_expert_layer = shapes.moe_layers * shapes.expert_bytes
    # What one slot per layer takes of the memory: with the draft's INT4 row, if any, at
    # the start (a rebuild leaves the draft's rows as they were: not freed, not grown).
    rows = shapes.draft_row_bytes if planned is None or rows_unheld else 0
    per_slot = per_expert_layer + rows
    parts = space_for_slots(memory, shapes, planned) if memory is not None else {}
    if rows and memory is not None:
        parts["draft_row"] = float(shapes.draft_row_bytes)
    if budget == "auto":
        if memory is None:
            raise SpecExpertConfigError(
                "budget",
                "'auto' sizes the slots from the memory, and this engine has no memory report",
                "give a fraction, a count or a size",
            )
        fits = math.floor(max(parts["space"], 0.0) / per_slot)
        if fits < shapes.top_k:
            need = shapes.top_k * per_slot - parts["space"]
            raise SpecExpertConfigError(
                "budget",
                f"auto: even top_k ({shapes.top_k}) slots per layer "
                f"({gib(shapes.top_k * per_slot)}) do not fit: {_accounting(parts)}; "
                f"{gib(need)} is missing",
                "free memory (a smaller max_num_seqs, max_model_len or KV cache), or "
                "use a machine with more memory",
            )
        slots = min(fits, shapes.num_experts)
        every = "; every expert fits" if fits >= shapes.num_experts else ""
        return _fit(slots, shapes, f"budget auto: {_accounting(parts)}{every}", parts)
    if isinstance(budget, str):
        size = parse_size(budget)
        fits = size // per_expert_layer
        if fits < shapes.top_k:
            raise SpecExpertConfigError(
                "budget",
                f"{budget} buys {fits} slots per layer ({shapes.moe_layers} MoE layers of "
                f"{shapes.expert_bytes / 2**20:.1f} MiB experts), fewer than top_k "
                f"({shapes.top_k})",
                f"give at least {gib(shapes.top_k * per_expert_layer)}",
            )
        slots = min(fits, shapes.num_experts)
        basis = f"budget {budget}" + ("; every expert" if fits >= shapes.num_experts else "")
    else:
        slots = budget_slots(budget, shapes.num_experts, shapes.top_k)
        basis = f"budget {budget}"
    fit = _fit(slots, shapes, basis, parts)
    if memory is not None and slots * per_slot > parts["space"] and not allow_beyond_memory:
        fits = max(0, math.floor(parts["space"] / per_slot))
        raise SpecExpertConfigError(
            "budget",
            f"{fit.reason} do not fit: {_accounting(parts)}",
            f"a budget of at most {fits} slots per layer, or 'auto', or a smaller KV cache "
            "(max_num_seqs, max_model_len or its size) (or allow_budget_beyond_memory: "
            "true, and the OS may kill the process)",
        )
    return fit


def _fit(slots: int, shapes: ModelShapes, basis: str, parts: dict[str, float]) -> BudgetFit:
    slot_bytes = slots * shapes.moe_layers * shapes.expert_bytes
    return BudgetFit(slots, shapes.num_experts, slot_bytes, basis, parts)


def _accounting(parts: dict[str, float]) -> str:
    limit = parts.get("cgroup_limit")
    cgroup = "" if limit is None else f" (cgroup limit {gib(limit)})"
    named = {
        "slots": parts.get("draft_slots", 0.0),
        "INT4 experts": parts.get("draft_int4", 0.0),
    }
    held = ", ".join(f"{name} {gib(size)}" for name, size in named.items() if size)
    draft = f", lookahead draft {gib(sum(named.values()))} ({held})" if held else ""
    if parts.get("draft_row"):
        row = gib(parts["draft_row"])
        draft += f", and its INT4 experts, {row} with each slot of every layer"
    return (
        f"{gib(parts['room'])} free{cgroup}, KV cache {gib(parts['kv'])}{_kv_holds(parts)}, "
        f"workspace "
        f"{gib(parts['workspace'])}{draft}, reserve {gib(parts['reserve'])}: "
        f"{gib(max(parts['space'], 0.0))} for slots"
    )


def _kv_holds(parts: dict[str, float]) -> str:
    """Whom the KV cache is for: `` (for 16 full-length sequences)``, or where it holds
    fewer than ``max_num_seqs`` asks, `` (for 10 of the 16 ...)``."""
    sequence, full = parts.get("kv_per_sequence", 0.0), parts.get("kv_full", 0.0)
    if sequence <= 0:
        return ""
    # (a share of a room computed in floats: 1.4999999 GiB holds 4 sequences of 0.375)
    wanted, held = round(full / sequence), math.floor(parts["kv"] / sequence + 1e-6)
    if held >= wanted:
        return f" (for {wanted} full-length sequences)"
    return f" (for {held} of the {wanted} full-length sequences max_num_seqs asks)"


def kv_cache_for_batch(settings: SizingSettings, free_bytes: int) -> int:
    """The KV cache the CPU build is given where no size is: ``max_num_seqs``
    full-length sequences, at most :data:`KV_SHARE` of ``free_bytes`` (the memory free
    when the engine is configured, before the weights load), and at least one (vLLM
    refuses less). In whole blocks, with the one vLLM keeps empty (its null block): a
    size of exactly ``max_model_len`` tokens holds one block short of a sequence."""
    one = _kv_for_sequences(settings, 1)
    return int(max(_batch_kv(_kv_for_sequences(settings, settings.max_num_seqs), free_bytes), one))


def _kv_for_sequences(settings: SizingSettings, sequences: int) -> int:
    """A KV cache of ``sequences`` full-length sequences in whole blocks, and vLLM's null
    block."""
    block = max(settings.block_size, 1)
    per_sequence = -(-settings.max_model_len // block) * block * settings.kv_bytes_per_token
    null = block * settings.kv_bytes_per_token if settings.block_size else 0
    return sequences * per_sequence + null


@dataclass(frozen=True)
class RegionSplit:
    """The budget's slots of every layer, split into each layer's own slots and one
    region of rows every layer's tensor covers (:mod:`~vllm_specexpert.tiers.shared_region`)."""

    own: int
    """Slots a layer keeps (its cache's)."""
    rows: int
    """The shared region's rows (0: none, the layer's own slots only)."""


def region_split(
    slots: int, layers: int, num_experts: int, top_k: int, need: int, ahead: int = 0
) -> RegionSplit:
    """How ``layers`` layers' ``slots`` each are split for calls of at most ``need``
    distinct experts (``max_num_seqs * top_k``, at most the layer's experts) to run in
    one launch: none where their own slots hold that many. Else, with L layers of S
    slots and E experts, a call whose own slots hold S' of them misses at most
    ``min(need, E - S')``, which the region holds, with ``ahead`` rows more (the following
    layer's reads while the call computes, :mod:`~vllm_specexpert.read_ahead`): ``L * S'
    + rows = L * S`` gives ``S' = (L*S - E - ahead) / (L - 1)`` when a call may need them
    all (the issue's bound: 1.17x the read-once bound on 8 layers, 1.02x on 48),
    ``(L*S - need - ahead) / L`` when fewer. A layer keeps at least ``top_k``; what is
    left then may hold fewer than a call misses (token groups for that call)."""
    need = min(need, num_experts)
    if layers < 2 or need <= slots:
        return RegionSplit(slots, 0)
    total = layers * slots
    own = (total - need - ahead) // layers
    if need > num_experts - own:  # (a call's own hits may be all S' of them)
        own = (total - num_experts - ahead) // (layers - 1)
    own = max(own, top_k)
    rows = total - layers * own
    return RegionSplit(own, rows) if rows > 0 else RegionSplit(slots, 0)


@dataclass(frozen=True)
class BatchChoice:
    """The KV cache the CPU build gives a slow tier's ``budget: "auto"`` (:func:`best_batch`)."""

    sequences: int
    """Full-length sequences the KV cache holds."""
    kv_bytes: int
    max_num_seqs: int
    max_model_len: int
    slots_per_layer: int
    """What the memory left holds a layer (own slots and the shared region together)."""
    num_experts: int
    bytes_per_token: float
    """Expert bytes a decode step of the batch reads a token, modeled
    (:func:`modeled_bytes_per_token`)."""
    engine_bytes: int = 0
    """What the engine's own processes were counted to take of the memory first."""

    @property
    def reason(self) -> str:
        """The config-time start line's account of the choice."""
        return (
            f"KV cache {gib(self.kv_bytes)} for {self.sequences} full-length "
            f"sequence{'s' if self.sequences != 1 else ''} of "
            f"{self.max_model_len} tokens (max_num_seqs {self.max_num_seqs}): the batch the "
            f"memory serves with the fewest expert bytes read a decode token, "
            f"{self.bytes_per_token / 1e6:.1f} MB modeled, {self.slots_per_layer} of "
            f"{self.num_experts} experts a layer resident beside it"
            + (
                f" and {gib(self.engine_bytes)} for the engine's processes"
                if self.engine_bytes
                else ""
            )
            + " (each token's experts taken uniformly; set kv_cache_memory_bytes for another size)"
        )


def modeled_bytes_per_token(sequences: int, slots_per_layer: int, shapes: ModelShapes) -> float:
    """Expert bytes a decode step of ``sequences`` reads a token, where each token routes
    to ``top_k`` of a layer's experts uniformly and independently and the resident slots
    hold any ``slots_per_layer`` of them: a layer needs ``E (1 - (1 - k/E)^B)`` distinct
    experts and misses the share ``1 - S/E`` of them. The batch shares each read; the
    KV cache of a larger one takes slots."""
    e, k = shapes.num_experts, shapes.top_k
    distinct = e * (1.0 - (1.0 - k / e) ** sequences)
    missed = distinct * (1.0 - min(slots_per_layer, e) / e)
    return shapes.moe_layers * shapes.expert_bytes * missed / sequences


def best_batch(
    settings: SizingSettings, free_bytes: int, shapes: ModelShapes, engine_bytes: int = 0
) -> BatchChoice:
    """The KV cache of the batch, up to ``max_num_seqs`` full-length sequences, that reads
    the fewest modeled expert bytes a decode token (:func:`modeled_bytes_per_token`), the
    slots taking what it leaves of ``free_bytes`` (:func:`space_for_slots`); the larger
    batch at a tie. A batch whose calls could need more experts than a layer's own slots
    and the shared region hold (:func:`region_split`) is not taken (its calls would run
    in token groups), nor one that leaves fewer than ``top_k`` slots a layer; where none
    is left, one sequence. ``free_bytes`` is measured before the engine's processes
    start; the slots share it less ``engine_bytes``, what those will hold. Never larger
    than :func:`kv_cache_for_batch`'s."""
    per_slot = shapes.moe_layers * shapes.expert_bytes
    cap = kv_cache_for_batch(settings, free_bytes)
    left = max(free_bytes - engine_bytes, 0)
    best: BatchChoice | None = None
    for sequences in range(1, max(settings.max_num_seqs, 1) + 1):
        kv = _kv_for_sequences(settings, sequences)
        if kv > cap and sequences > 1:
            break
        memory = MemoryReport(left, left, kv_cache_bytes=kv)
        space = space_for_slots(memory, shapes)["space"]
        slots = min(shapes.num_experts, math.floor(max(space, 0.0) / per_slot))
        need = min(shapes.num_experts, sequences * shapes.top_k)
        split = region_split(slots, shapes.moe_layers, shapes.num_experts, shapes.top_k, need)
        if slots < shapes.top_k or need > split.own + split.rows:
            continue
        cost = modeled_bytes_per_token(sequences, slots, shapes)
        if best is None or cost <= best.bytes_per_token * (1 + 1e-9):
            best = BatchChoice(
                sequences,
                kv,
                settings.max_num_seqs,
                settings.max_model_len,
                slots,
                shapes.num_experts,
                cost,
                engine_bytes,
            )
    if best is None:
        kv = _kv_for_sequences(settings, 1)
        return BatchChoice(
            1,
            kv,
            settings.max_num_seqs,
            settings.max_model_len,
            0,
            shapes.num_experts,
            modeled_bytes_per_token(1, 0, shapes),
            engine_bytes,
        )
    return best


def _batch_kv(full: float, memory: float) -> float:
    """A full-length cache for the batch (``full`` bytes), at most :data:`KV_SHARE` of
    ``memory``."""
    return min(full, KV_SHARE * max(memory, 0.0))
