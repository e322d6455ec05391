"""Counters the engine keeps per MoE layer and phase, their JSON form, the writer of
``stats_path``, and the shape of a feature's ``/metrics`` series (:class:`Series`).

Every counter exists twice per layer: for the decode tokens and for the prefill tokens of
the forward passes (which tokens are which comes from vLLM, see
:mod:`vllm_specexpert.layers.forward_phase`). Per-decode-token figures are the decode
counters divided by ``decode_tokens``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from vllm_specexpert.log import init_logger

logger = init_logger(__name__)

PHASES = ("decode", "prefill")

C = TypeVar("C", bound="Counters")


def counter(doc: str) -> Any:
    """A count field of a :class:`Counters`; ``doc`` is its doc and its metric's HELP."""
    return field(default=0, metadata={"help": doc})


def seconds(doc: str) -> Any:
    """A seconds field of a :class:`Counters` (a ``*_seconds_total`` metric)."""
    return field(default=0.0, metadata={"help": doc})


def highest(doc: str, default: float = 0) -> Any:
    """A field of a :class:`Counters` that is a maximum (a gauge), not a count."""
    return field(default=default, metadata={"help": doc, "gauge": True})


@dataclass
class Counters:
    """What every stats dataclass is: fields made by :func:`counter`, :func:`seconds` or
    :func:`highest` (documented: the doc is the metric's HELP), and the one way to add,
    reset and write them. Fields without a doc (a lock, a running state) are not counters."""

    @classmethod
    def counter_fields(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if "help" in f.metadata]

    @classmethod
    def docs(cls) -> dict[str, str]:
        """Each counter's doc, by name."""
        return {f.name: f.metadata["help"] for f in cls.counter_fields()}

    @classmethod
    def gauges(cls) -> set[str]:
        return {f.name for f in cls.counter_fields() if f.metadata.get("gauge")}

    def add(self, other: Counters) -> None:
        """``other``'s counts added (a gauge: the larger)."""
        for f in self.counter_fields():
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, max(mine, theirs) if f.metadata.get("gauge") else mine + theirs)

    def reset(self) -> None:
        """Every counter back to its default."""
        for f in self.counter_fields():
            setattr(self, f.name, f.default)

    def counts(self) -> dict[str, Any]:
        """The counters by name (what ``/metrics`` serves)."""
        return {f.name: getattr(self, f.name) for f in self.counter_fields()}

    def to_dict(self) -> dict[str, Any]:
        """The counters and any figures derived from them (the stats' JSON)."""
        return self.counts()


@dataclass
class PhaseStats(Counters):
    """Counters of one MoE layer for one phase. Expert requests are counted once per
    distinct expert per kernel call (a token batch that needs expert 5 for 30 tokens is
    one request)."""

    calls: int = counter(
        "Layer calls with tokens of this phase (one per forward pass that has some)."
    )
    tokens: int = counter("Tokens of this phase that went through the layer.")
    requests: int = counter("Distinct experts asked for, summed over kernel calls.")
    experts_needed: int = counter(
        "Distinct experts the router chose per layer call (before any miss "
        "policy), summed over calls: the demand a cache must meet, whatever the "
        "token groups."
    )
    hits: int = counter(
        "Requests found resident in the device cache (experts still in flight "
        "from a prefetch count as hits: nothing new is loaded for them)."
    )
    misses: int = counter("Requests that were not resident.")
    loads: int = counter("Experts whose copy into a slot started (on demand or prefetched).")
    evictions: int = counter("Resident experts evicted to make room.")
    region_loads: int = counter(
        "Of ``loads``, those into a shared region's rows: slots every layer's slot "
        "tensors cover after their own, which a layer's demand loads take from any "
        "layer (the longest unused first)."
    )
    read_ahead: int = counter(
        "Of ``loads``, those queued while the layer before computed: the experts this "
        "layer's last call used, read ahead into the shared region where the batch needs "
        "more than the layer's own slots hold."
    )
    read_ahead_unused: int = counter("Of those, experts the call then did not ask for.")
    bytes_loaded: int = counter("Bytes of those copies (including prefetches).")
    stall_s: float = seconds(
        "Seconds the compute waited on this layer's copies (on-demand loads, and "
        "prefetches not finished when the layer needed them; a mapped pack: its pages "
        "read in before a launch)."
    )
    prefetched: int = counter(
        "Experts whose prefetch copy started (a feature's guess, or ``admitted``)."
    )
    admitted: int = counter(
        "Of those, experts a place computed from a copy the cache could hold, then "
        "loaded in the background on an idle link (``admit_host_experts``)."
    )
    bytes_prefetched: int = counter("Bytes of those prefetches (included in ``bytes_loaded``).")
    prefetch_used: int = counter("Prefetched experts the layer then asked for.")
    prefetch_unused: int = counter(
        "Prefetched experts the layer did not ask for and that had already "
        "started moving (wasted link time)."
    )
    prefetch_cancelled: int = counter(
        "Prefetches the layer did not ask for that had not started when it ran: "
        "dropped from the link queue, no link time spent (never counted in "
        "``prefetched``)."
    )
    missed_entries: int = counter(
        "Router-chosen (token, expert) entries whose expert was not resident when "
        "the layer call started; each was fetched or given to a place "
        "(counted in that place's ``<place>_entries``)."
    )
    fetched_entries: int = counter(
        "Missed entries whose expert was loaded on demand (``fetch``, fallbacks)."
    )
    kernel_calls: int = counter(
        "Expert kernel launches on the device (more than ``calls`` when a batch "
        "needed more experts than there are slots and ran in token groups)."
    )
    call_s: float = seconds(
        "Seconds in the layer's calls, whole: the engine's own work, the waits and the "
        "kernels (``call_s - kernel_s - stall_s`` less the places' waits is the "
        "engine's overhead and its features')."
    )
    kernel_s: float = seconds(
        "Seconds of the expert kernel's launches on resident experts (on CUDA, the "
        "launches' host time, not the device's)."
    )
    parts: dict[type[Counters], Counters] = field(default_factory=dict)
    """The counters the running features keep in this phase (their places' among them,
    :mod:`vllm_specexpert.places`), by their class: written out beside the engine's."""

    def part(self, kind: type[C]) -> C:
        """The phase's counters of class ``kind`` (made at first use)."""
        part = self.parts.get(kind)
        if part is None:
            part = self.parts[kind] = kind()
        return part  # type: ignore[return-value]  # (keyed by its own class)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    def count_call(self, tokens: int) -> PhaseStats:
        """Count one layer call of ``tokens`` tokens; returns these counters."""
        self.calls += 1
        self.tokens += tokens
        return self

    def add(self, other: Counters) -> None:
        super().add(other)
        assert isinstance(other, PhaseStats)
        for kind, part in other.parts.items():
            self.part(kind).add(part)

    def reset(self) -> None:
        super().reset()
        for part in self.parts.values():
            part.reset()

    def to_dict(self) -> dict:
        out = super().to_dict()
        for part in self.parts.values():
            out.update(part.to_dict())
        out["hit_rate"] = self.hit_rate
        return out


@dataclass
class LayerStats:
    """The counters of one MoE layer, per phase."""

    decode: PhaseStats = field(default_factory=PhaseStats)
    prefill: PhaseStats = field(default_factory=PhaseStats)

    def to_dict(self) -> dict:
        return {phase: getattr(self, phase).to_dict() for phase in PHASES}

    @classmethod
    def sum(cls, layers: Iterable[LayerStats]) -> LayerStats:
        total = cls()
        for layer in layers:
            total.decode.add(layer.decode)
            total.prefill.add(layer.prefill)
        return total


def metric_name(key: str) -> str:
    """A stats key as a metric's name: seconds (``*_s``) as ``*_seconds``."""
    return f"{key[:-2]}_seconds" if key.endswith("_s") else key


@dataclass
class Series:
    """One family of ``/metrics`` series a feature supplies in the worker
    (:meth:`~vllm_specexpert.features.base.EngineFeature.series`). The collector, in the
    API server, sees no feature: it serves the family as given, the engine's labels
    (``model_name``, ``engine``) before :attr:`labels`. A family without samples is
    still served (its HELP and TYPE)."""

    name: str
    """Without the ``specexpert_`` prefix and a counter's ``_total``: ``link_calls``."""
    kind: str
    """``counter`` or ``gauge``."""
    help: str
    labels: tuple[str, ...] = ()
    """Its labels after the engine's."""
    samples: list[tuple[tuple[str, ...], float]] = field(default_factory=list)
    """(the values of :attr:`labels`, the value), one per series."""

    def add(self, value: float, *labels: object) -> Series:
        """One sample (label values as strings); returns the family."""
        self.samples.append((tuple(str(label) for label in labels), float(value)))
        return self


class NotARegularFile(OSError):
    """The stats path names a directory, device, FIFO or socket: never replaced."""


def _refuse_special(target: str) -> None:
    """Raise :class:`NotARegularFile` if ``target`` exists and is not a regular file.
    Writing goes through a rename over the path, which would turn ``/dev/null`` or a
    FIFO into a JSON file (as root, the system's own ``/dev/null``)."""
    try:
        mode = os.stat(target).st_mode
    except OSError:
        return  # nothing there (or no way there: opening it reports that)
    if not stat.S_ISREG(mode):
        kind = (
            "a directory" if stat.S_ISDIR(mode) else "not a regular file (a device, FIFO or socket)"
        )
        raise NotARegularFile(errno.EEXIST, f"{target} is {kind}")


def write_json_atomic(path: str, payload: dict) -> None:
    """Write ``payload`` to ``path`` so that readers never see half a file: a temp file
    beside it, renamed over it. A symlink is followed (the file it names is replaced,
    not the link); anything at the path but a regular file is refused; the directory
    must exist (it is never created here, so a removed directory stays removed)."""
    target = os.path.realpath(path)
    _refuse_special(target)
    # One temp file per thread: a timer and an RPC may write the same file at once.
    tmp = f"{target}.tmp.{os.getpid()}.{threading.get_ident()}"
    try:
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=1, sort_keys=True)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def check_stats_path(path: str) -> None:
    """Raise a config error naming ``stats_path`` unless the stats can be written at
    ``path``: a regular file or nothing there, in a directory that exists or can be
    made and is writable (checked at engine start: a later failure is only logged)."""
    from vllm_specexpert.config import SpecExpertConfigError

    target = os.path.realpath(path)
    try:
        _refuse_special(target)
    except NotARegularFile as error:
        raise SpecExpertConfigError(
            "stats_path",
            f"{error.strerror}; stats are written by replacing the file",
            "give the path of a file (it is created or replaced), or remove stats_path "
            "to write none",
        ) from None
    probe = f"{target}.probe.{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as error:
        raise SpecExpertConfigError(
            "stats_path",
            f"cannot write {path}: {error.strerror or error}",
            "give a path in a writable directory, or remove stats_path",
        ) from None
