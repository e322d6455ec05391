"""The nested sections of the ``specexpert`` config (``link``, ``buddy``,
``token_scheduler``, ``lookahead``, ``mesh``, ``quality``) and the strict field types
every config class uses."""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    Strict,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass, is_pydantic_dataclass
from pydantic.fields import FieldInfo

from vllm_specexpert.config.budget_form import budget_value

STRICT = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True, frozen=True)
"""Unknown keys, NaN and infinities are errors; docstrings are the fields' docs."""

Number = Annotated[float, Strict()]
"""A JSON number (an int is accepted; a bool or a string is not)."""
Count = Annotated[int, Strict()]
Flag = Annotated[bool, Strict()]
PATH_MAX = 4096
"""Linux's longest path, its terminating NUL included."""
NAME_MAX = 255
"""The longest file name of the common Linux filesystems (ext4, xfs, btrfs, tmpfs)."""


def _usable_path(path: str) -> str:
    """A path the system calls take: no NUL byte, at most ``PATH_MAX - 1`` bytes, no part
    longer than its filesystem's name limit (of the deepest existing directory above it,
    else :data:`NAME_MAX`)."""
    if "\0" in path:
        raise ValueError("contains a NUL byte, which no file name can hold")
    size = len(os.fsencode(path))
    if size >= PATH_MAX:
        raise ValueError(f"is {size} bytes long; paths end at {PATH_MAX - 1}")
    limit = _name_max(path)
    long = next((part for part in path.split("/") if len(os.fsencode(part)) > limit), None)
    if long is not None:
        raise ValueError(
            f"has a part of {len(os.fsencode(long))} bytes ({long[:20]}...); its filesystem's "
            f"names end at {limit}"
        )
    return path


def _name_max(path: str) -> int:
    for directory in _parents(path):
        if os.path.isdir(directory):
            try:
                return os.pathconf(directory, "PC_NAME_MAX")
            except OSError:
                break
    return NAME_MAX


def _parents(path: str) -> list[str]:
    """``path``'s directories, deepest first (``/`` last)."""
    out, current = [], os.path.dirname(os.path.abspath(path))
    while True:
        out.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            return out
        current = parent


Path = Annotated[str, Strict(), Field(min_length=1), AfterValidator(_usable_path)]

FILE_IN_DIRECTORY_MAX = 32
"""The longest name of a file the plugin reads or writes in a directory it is given (an
expert pack's ``manifest.json.partial``, a predictor's weights; tests/test_config.py
holds every such name to it)."""


def _usable_directory(path: str) -> str:
    """A directory whose files' paths the system calls take: :func:`_usable_path`, with
    room for ``/`` and a name of :data:`FILE_IN_DIRECTORY_MAX` bytes in it."""
    size = len(os.fsencode(path))
    longest = PATH_MAX - 2 - FILE_IN_DIRECTORY_MAX
    if size > longest:
        raise ValueError(
            f"is {size} bytes long; the paths of the files in it would pass the "
            f"{PATH_MAX - 1} a path may have: give at most {longest}"
        )
    return path


Directory = Annotated[Path, AfterValidator(_usable_directory)]
"""A directory the plugin reads files from or writes them to."""


@dataclass(config=STRICT)
class LinkConfig:
    """The emulated link between the slow tier and the device cache.

    On CUDA the real copy engine is used and these fields must be unset. On CPU, every
    expert copy is really performed, and when ``bandwidth_gbps`` is set the copy becomes
    usable only ``latency_us + bytes / bandwidth`` after the link is free, copies being
    serialized like one copy engine. This lets a CPU run reproduce a GPU box's ratio of
    copy time to compute time.
    """

    bandwidth_gbps: Annotated[Number, Field(ge=0.0001, le=10_000)] | None = None
    """Emulated bandwidth in gigabytes per second (1e9 bytes/s, not gigabits).
    PCIe 4.0 x16 moves about 25 GB/s host-to-device in practice; PCIe 3.0 x16 about 12.
    ``None`` (default): no emulation, copies take what the memcpy takes.
    Range: [0.0001, 10000] GB/s (the low end is for tiny test models)."""

    latency_us: Annotated[Number, Field(ge=0, le=1_000_000)] = 0.0
    """Fixed emulated cost in microseconds of each copy (launch + DMA setup); an expert
    is one copy per weight tensor (2 for ``w13`` + ``w2``). Only used when
    ``bandwidth_gbps`` is set. Range: [0, 1e6] us."""

    host_slowdown: Annotated[Number, Field(ge=1, le=1000)] = 14.0
    """Emulated speed of the host for the ``cpu`` and ``auto`` miss policies: an expert
    computed on the host from the slow tier counts as ready only ``host_slowdown`` times
    its measured time on this processor after it started (the device ran the hits
    meanwhile). Default 14: decode-time expert compute is memory-bound, and an
    RTX-4090-class GPU (~1000 GB/s) reads weights about 14x faster than a dual-channel
    DDR5 desktop CPU (~70 GB/s) (an estimate). Only used when ``bandwidth_gbps`` is set;
    without emulation the host compute takes what it takes. Range: [1, 1000]."""

    @property
    def emulated(self) -> bool:
        return self.bandwidth_gbps is not None


@dataclass(config=STRICT)
class TokenSchedulerConfig:
    """The token scheduler (ExpertFlow §3.3; ``token_scheduler: {}`` for these defaults).
    When more decode sequences are runnable than ``group_size``, each step runs one group
    of them whose predicted routes (``path_predictor``) overlap most; the others keep
    their KV blocks and wait. Prefill is never held back."""

    group_size: Annotated[Count, Field(ge=1, le=4096)] = 8
    """Decode sequences run per step when more are runnable. Range: [1, 4096]."""
    max_wait_steps: Annotated[Count, Field(ge=0, le=1000)] = 4
    """Consecutive steps a runnable decode sequence may be held back: once it has waited
    this long it runs in the next step's group, whatever its route. Range: [0, 1000]."""
    governor: bool = True
    """Group only where grouping pays: the seconds per decode token with one group per
    step and with every runnable sequence are measured, per batch-size bucket, and the
    cheaper one runs (the other is tried again every 64 steps). ``false``: always group."""


@dataclass(config=STRICT)
class BuddyConfig:
    """BuddyMoE's substitution settings (``buddy``, ``auto_buddy`` and ``random`` miss
    policies; BuddyMoE §3). Defaults: the paper's best lists (α = 0.95, |B| <= 16), a TAE
    gate at the 15th percentile (its 10-20 range) and ρ = 1, not the paper's 3: at 8-32
    sequences per step ρ = 3 lost 6-9 % of exact next-token accuracy on the embedded
    model, ρ = 1 keeps ≥ 98 % at 1-128 (``benchmarks/results/batched_accuracy.json``)."""

    alpha: Annotated[Number, Field(gt=0, le=1)] = 0.95
    """Cumulative Frequency Threshold of the buddy lists, in (0, 1]: an expert's buddies are
    its most co-activated peers until their share of its co-activations reaches alpha.
    Range: (0, 1]."""

    k_max: Annotated[Count, Field(ge=1, le=65536)] = 16
    """Longest buddy list per expert. Range: [1, 65536]."""

    tau: Annotated[Number, Field(ge=0, le=1)] | None = None
    """Token Activating Entropy gate in [0, 1]: a token whose normalised routing entropy
    is <= tau keeps its experts (fetch). ``None`` (default): per layer, the
    ``tau_percentile``-th percentile of the calibration's TAE distribution. Range: [0, 1]."""

    tau_percentile: Annotated[Number, Field(ge=0, le=100)] = 15.0
    """Percentile (0-100) of each layer's calibrated TAE used as tau when ``tau`` is
    unset: about this share of tokens is never substituted. Range: [0, 100]."""

    beta: Annotated[Number, Field(gt=0, le=1)] = 0.75
    """Batch distribution gate in (0, 1]: no substitution in a layer call where this share
    or more of the distinct requested experts is missing (broad substitution compounds
    errors; the paper leaves the value to the deployment, this default is ours). Range: (0, 1]."""

    rho: Annotated[Count, Field(ge=1, le=65536)] = 1
    """Replacement budget: at most this many substituted experts per token. The ``beta``
    gate is per layer call, so it blocks most calls of one token (few requested experts,
    most of them missing) and few of a batch's: in a batch, ``rho`` is what bounds the
    harm per token. Range: [1, 65536]."""


SETTINGS_READ_AT_START = {
    "disk": ("path", "queue_depth", "direct", "residency", "host_cache"),
    "lookahead": ("k_max", "draft_budget", "draft_cache"),
    "mesh": ("ray_address", "peers", "placement", "hot_count"),
}
"""Settings of a section read when the engine starts (the pack and its reader, vLLM's
speculative decoding and the draft, the peers and their shards are built then):
``reconfigure`` cannot change them, and a section it is given without them keeps the
running ones."""


@dataclass(config=STRICT)
class LookaheadConfig:
    """MoE-SpeQ's draft lookahead (``lookahead: {}`` for these defaults). The plugin
    sets vLLM's ``speculative_config`` to a ``draft_model`` on the same checkpoint with
    ``k_max`` tokens; the draft is the model with INT4 experts (made at load; under
    ``disk``, the pack's draft regions, ``specexpert pack --draft``), run from its own
    pool. Its routes for the drafted tokens are the target's expert lookahead
    buffer: their experts are prefetched while the draft runs, and the cache evicts by
    them. vLLM verifies the drafted tokens in one target pass (accepted tokens are the
    target's: exact under ``fetch``). Per step a governor picks the draft length from
    measured acceptance and times, and stops drafting for a request whose drafts do not
    pay. bf16/fp16 checkpoints only."""

    k_max: Annotated[Count, Field(ge=1, le=8)] = 4
    """Longest draft (vLLM's ``num_speculative_tokens``); the governor picks 0..k_max
    per step. Range: [1, 8]."""

    k: Annotated[Count, Field(ge=0, le=8)] | None = None
    """A fixed draft length in [0, k_max] instead of the governor (0: no drafted tokens;
    the draft still runs once per step on the step's tokens, to keep its KV cache,
    without its routed experts). ``None`` (default): the governor, which measures each
    length after ``explore_after_tokens``. Range: [0, 8], at most ``k_max``."""

    explore_after_tokens: Annotated[Count, Field(ge=0, le=2**31 - 1)] = 512
    """Decode tokens of a batch size the governor runs without drafts (k = 0) before it
    first tries each length, so that a run of a few tokens never pays for the trials
    (on the disk tier a trial of a bad length ran 0.34x ``fetch``: issue 66). 0: from
    the first step. Range: [0, 2^31 - 1]."""

    draft_budget: Annotated[Number, Field(gt=0, le=1)] | None = None
    """Share of the draft's experts held in its slots, least recently used first out:
    decoded (bf16, the kernel's form) beside its INT4 pool, made again from its INT4
    copy when next needed; under ``disk`` on the CPU build INT4 as vLLM's W4A16 GEMM
    reads them, computed packed with no bf16 copy, the slots its only cache. Unset: 1.0,
    every expert decoded once, at load (fastest; the draft's experts then take bf16
    bytes too); under ``disk``, computed packed, as many as ``draft_cache`` says, else
    the fewest that run a token, ``top_k`` per layer. Range: (0, 1]."""

    draft_cache: Annotated[Number, Field(gt=0, le=1)] | Literal["auto"] = "auto"
    """Under ``disk``: the draft's INT4 experts held in memory per layer (read from the
    pack's draft regions when missing, least recently used out): its slots where it
    computes them packed (the CPU build), else host rows beside its decoded slots.
    ``"auto"`` (default): as many as the target has slots per layer, the two sized
    together (each slot of ``budget`` brings its INT4 row); a number in (0, 1]: that
    share of each layer's. At least ``top_k``. Without ``disk`` the draft's INT4 experts
    are all in memory."""


@dataclass(config=STRICT)
class DiskConfig:
    """The disk tier: routed experts read whole from an expert pack on disk, for models
    whose experts do not fit in memory (``disk: {"path": DIR}``). On the CPU build the
    slots (``budget``) are the only tier above the disk.

    ``path`` is the pack's directory: made from the checkpoint on the first start when
    it is absent (``specexpert pack MODEL --out DIR`` makes it ahead), reused when it
    matches the checkpoint, refused when it does not (another model, or a checkpoint
    changed since)."""

    path: Directory
    """The expert pack's directory."""

    queue_depth: Annotated[Count, Field(ge=1, le=64)] = 4
    """Reads in flight at once (a thread each). Range: [1, 64]."""

    direct: Flag = True
    """Read with ``O_DIRECT`` (no page cache: the slots are the cache). Where the
    filesystem refuses it, reads go through the page cache and the start line says so;
    ``false`` asks for the page cache."""

    residency: Literal["slots", "mapped"] = "slots"
    """Where experts read from the pack are kept for the kernel. ``slots`` (default, the
    faster on the full-size disk benchmark, docs/benchmarks.md): in the slots of
    ``budget``, each expert read there whole, checksummed at every read; every miss
    policy, predictor and cache. ``mapped``: the pack's file is mapped and the kernel
    reads its pages; the page cache is the cache (all the memory the process leaves free;
    ``budget`` sizes nothing), with ``fetch`` and no path predictor or shared pool (the
    faster in the 4 GB miniature); a predictor's prefetch reads the predicted experts'
    pages ahead (``MADV_WILLNEED``). Where the filesystem or kernel refuses the mapping,
    the slots are used and the start line says so."""

    read_ahead_rows: Annotated[Count, Field(ge=0, le=65536)] | Literal["auto"] = "auto"
    """Rows of the shared region (CPU build, slots residency, where a batch may need every
    expert of a layer) kept beside the experts a call needing all of them misses: while a
    layer's launch computes, the following layer's experts are read into them, so that
    the disk does not idle. Each costs every layer ``1 / (layers - 1)`` of an own slot.
    ``"auto"``: as many as the disk reads while the kernel computes a launch of
    ``max_num_seqs`` tokens, where reading beside the kernel pays, probed when the first
    region is made (a few experts read and computed, alone and at once, timed; stats
    ``read_ahead_rows``: ``probe``, and ``hidden``, measured as it runs). Can change at
    run time. Range: an integer in [0, 65536], or "auto"."""

    host_cache: float | int | str | None = None
    """The pinned host memory between the disk and the device slots, on CUDA: written as
    ``budget`` is and sized by the same function from the host's free memory (no KV
    cache or workspace there); ``None`` (default) is ``"auto"``. A device miss is
    copied from these rows when they hold the expert, and read from the disk into a row
    first when not (least recently used out). Refused on the CPU build, whose slots are
    the host memory. Not run on a GPU yet (docs/gpu.md)."""

    @field_validator("host_cache", mode="before")
    @classmethod
    def _host_cache(cls, value: Any) -> float | int | str | None:
        return None if value is None else budget_value(value)


@dataclass(config=STRICT)
class MeshConfig:
    """Experts across machines on Ray (``mesh: {}`` for these defaults). Peers are Ray
    actors; each holds a shard of every MoE layer's routed experts, read from the
    checkpoint on its own node, and computes them for the rows it is sent. A decode
    token's expert that is missing from the device cache and hosted by a peer is computed
    there instead of fetched; the engine keeps the trunk, its cache and the slow tier,
    which serves every expert whose peer is out of rotation (dead, hung, or slower than
    ``rtt_cap_ms``). Prefill tokens run locally (on-demand loading). Needs the ``mesh``
    extra (``pip install 'vllm-specexpert[mesh]'``)."""

    ray_address: Annotated[str, Strict(), Field(min_length=1)] | None = None
    """Address of an existing Ray cluster (what ``ray.init(address=...)`` takes, e.g.
    ``"10.0.0.1:6379"`` or ``"auto"``). ``None`` (default): a local Ray instance is
    started in the worker process, its peers on this machine."""

    peers: Annotated[Count, Field(ge=1, le=256)] = 2
    """How many peer actors. Where the cluster has at least this many nodes besides the
    engine's, one peer per node; otherwise they share the engine's node. Range: [1, 256]."""

    placement: Literal["partition", "replicate_hot"] = "partition"
    """Which experts each peer holds. ``partition`` (default): expert ``e`` of every
    layer on peer ``e mod peers``. ``replicate_hot``: Mesh-LLM's overlapping shards, the
    baseline: each layer's ``hot_count`` most-routed experts (by the calibration's
    counts) are pinned in the engine's own cache, so they never cross the network; the
    rest are dealt to the peers in turn. Needs ``calibration``."""

    hot_count: Annotated[Count, Field(ge=1, le=65536)] = 8
    """Experts per layer that ``replicate_hot`` pins locally; at most the layer's slots
    minus ``top_k``. Range: [1, 65536]."""

    mode: Literal["sync", "early_fire", "no_stop"] = "sync"
    """``sync`` (default): once the router's ids are known, rows go to the peers that
    host their missing experts (equivalent output, as ``cpu``). ``early_fire``: a
    layer's rows go to the peers of the experts predicted for it at the previous layer
    before its router's ids are read; results of rightly predicted experts are kept, the
    rest are sent when the ids are read (same experts: equivalent). ``no_stop``
    (approximate): at layer l the predicted layer l+1 router input (the predictor's
    estimate) goes to the peers of layer l+1's predicted experts at once, and layer l+1
    uses what they computed, with the predicted weights, without waiting for its router
    (two layers' requests in flight: about half a round trip per layer; measured 0.79
    teacher-forced top-1 agreement on the embedded model). ``early_fire`` and ``no_stop``
    need a ``predictor``."""

    rtt_cap_ms: Annotated[Number, Field(gt=0, le=60_000)] = 80.0
    """A peer whose measured network round trip (median of its recent calls, the peer's
    own compute time taken out) exceeds this leaves the rotation: its experts are served
    from the local slow tier until a probe measures it under the cap again. Default 80
    (the mesh notes' cap). Range: (0, 60000] ms."""

    timeout_ms: Annotated[Number, Field(gt=0, le=600_000)] = 2000.0
    """How long a layer call waits for a peer's answer before taking the peer out of
    rotation (hung) and computing its entries locally. Range: (0, 600000] ms."""

    probe_interval_s: Annotated[Number, Field(gt=0, le=3600)] = 2.0
    """Seconds between probes of a peer out of rotation (a Ray actor that died is
    restarted by Ray and rejoins once a probe answers under ``rtt_cap_ms``).
    Range: (0, 3600] s."""


@dataclass(config=STRICT)
class QualityConfig:
    """A quality budget for a mode that changes the output (``quality: {}`` for these
    defaults). The engine recomputes a sampled share of decode tokens exactly beside
    the served result (the router's experts, fetched), estimates from the final logits
    how much next-token accuracy the approximate result loses (and how often its top-1
    token flips), and runs exactly (``fetch``) while a window of sampled tokens is over
    budget; it switches back after a window under budget (the approximate result is
    then the one sampled). Decode passes of different batch sizes
    (``batch_classes``) are judged and switched apart."""

    max_accuracy_loss: Annotated[Number, Field(ge=0, le=1)] | None = 0.02
    """Largest estimated share of next-token accuracy the approximate result may lose
    before the engine runs exactly: over a window, ``sum(p[exact top-1] - p[approximate
    top-1]) / sum(p[exact top-1])`` with ``p`` the exact result's next-token
    probabilities (what the two tokens would score if the exact model were calibrated).
    0.02: the 98 % of exact accuracy the approximate modes aim at. ``None``: not
    judged. Range: [0, 1]."""

    max_top1_flip: Annotated[Number, Field(ge=0, le=1)] | None = None
    """Largest share of sampled decode tokens whose top-1 token may differ between the
    exact and the approximate result before the engine runs exactly (stricter than
    ``max_accuracy_loss``: a flip between two near-equal tokens counts in full).
    ``None`` (default): not judged. Range: [0, 1]."""

    sample: Annotated[Number, Field(gt=0, le=1)] = 0.02
    """Share of decode tokens recomputed exactly (each drawn independently; a drawn
    token's every MoE layer call is recomputed). Range: (0, 1]."""

    window: Annotated[Count, Field(ge=1, le=1_000_000)] = 100
    """Sampled tokens per decision (per batch class): the budget is judged over this
    many, then counted anew; while the mode runs, a window that can no longer end under
    budget is judged at once. Range: [1, 1000000]."""

    batch_classes: tuple[Annotated[Count, Field(ge=1, le=65536)], ...] = (1, 8, 32)
    """Upper bounds of the decode batch sizes (sequences per pass) judged and switched
    apart: ``[1, 8, 32]`` gives 1, 2-8, 9-32 and more than 32. An approximate mode's
    accuracy depends on the batch size (a layer call of more tokens misses more
    experts), so it may run exactly at some sizes and approximately at others.
    ``[]``: one class, the whole engine. Strictly increasing, at most 8."""

    confidence: Annotated[Number, Field(ge=0.5, lt=1)] = 0.9
    """One-sided confidence with which a window is held under the limits: the budget
    judges the upper bound of each figure at this confidence, not its point estimate
    (the accuracy loss: a ratio estimator's normal bound over the window's sampled
    tokens; the flip rate: Wilson's bound), so that a mode whose true loss is at the
    limit runs on at most ``1 - confidence`` of its windows. 0.5: the point estimate.
    Range: [0.5, 1)."""

    seed: Annotated[Count, Field(ge=0)] = 0
    """Seed of the token sampling (runs are repeatable)."""

    @field_validator("batch_classes")
    @classmethod
    def _batch_classes(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if len(value) > 8 or any(b <= a for a, b in itertools.pairwise(value)):
            raise ValueError(f"must be strictly increasing and at most 8, got {list(value)}")
        return value

    @model_validator(mode="after")
    def _a_budget(self) -> QualityConfig:
        if self.max_accuracy_loss is None and self.max_top1_flip is None:
            raise ValueError(
                "max_accuracy_loss and max_top1_flip are both null: nothing "
                "to judge; set one of them"
            )
        return self


def fields_of(owner: type) -> dict[str, FieldInfo]:
    """The fields of the config class ``owner`` (a pydantic dataclass) by name."""
    if not is_pydantic_dataclass(owner):
        raise TypeError(f"{owner.__name__} is not a pydantic dataclass")
    return owner.__pydantic_fields__


def default_of(owner: type, name: str) -> Any:
    """The default of field ``name`` of the config class ``owner`` (a section as the
    plain dict ``dataclasses.asdict`` gives)."""
    value = fields_of(owner)[name].get_default(call_default_factory=True)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value
