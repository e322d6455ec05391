"""A mesh peer's proof that it computes: a few (row, expert) pairs of every layer it
holds, and this host's result of them.

At start, and again after Ray restarts it, each peer computes its check; a peer that
crashes (a kernel its process cannot run: SIGILL), hangs, or answers otherwise than this
host (another checkpoint at the same path, another vLLM build) does not take traffic
(:mod:`.start`, :mod:`.health`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_specexpert.peers.ray_cluster import first_line
from vllm_specexpert.peers.shard import ShardSpec

CHECK_ROWS = 4
"""Rows of a peer's check, each computed by two of its experts per layer."""
CHECK_TOLERANCE = 0.02
"""Largest relative error (per pair, in the L2 norm) of a peer's check against this
host's result. One kernel gives the same bits; vLLM's portable and AMX kernels differ
by bf16 rounding (well under 1 %); other weights give errors of order 1."""

PairReference = Callable[[int, torch.Tensor, np.ndarray], torch.Tensor]
"""``reference(layer, x, experts) -> [N, H]``: expert ``experts[i]`` of decoder layer
``layer`` on row ``i`` of ``x`` (``[N, H]``), unweighted, computed on this host."""


@dataclass
class PeerCheck:
    """Pairs of one layer that a peer computes to prove it works, and this host's
    result of them."""

    layer: int
    x: np.ndarray
    """``[CHECK_ROWS, H]`` bf16 as int16 (the wire form of :meth:`ExpertPeer.compute`)."""
    rows: np.ndarray
    experts: np.ndarray
    expected: torch.Tensor
    """``[N, H]`` float32: ``reference`` of the pairs."""

    def error(self, y: np.ndarray) -> float:
        """The largest relative error of a peer's answer ``y`` over the pairs."""
        got = torch.from_numpy(np.array(y)).view(torch.bfloat16).float()  # (a read-only view)
        if got.shape != self.expected.shape:
            return float("inf")
        scale = self.expected.norm(dim=1).clamp_min(1e-6)
        return float(((got - self.expected).norm(dim=1) / scale).max())


def checks_of(
    spec: ShardSpec, held: dict[int, np.ndarray], seed: int, reference: PairReference
) -> list[PeerCheck]:
    """Per layer of ``spec``, :data:`CHECK_ROWS` rows (drawn from ``seed``) by the first
    and last of the experts ``held`` there, and ``reference``'s result of those pairs."""
    generator = torch.Generator().manual_seed(seed)
    checks = []
    for layer in spec.layers:
        experts = held[layer]
        if not len(experts):
            continue
        experts = np.unique(experts[[0, -1]])
        x = torch.randn(CHECK_ROWS, spec.w13_shape[1], generator=generator).to(torch.bfloat16)
        rows = np.repeat(np.arange(CHECK_ROWS), len(experts))
        pairs = np.tile(experts, CHECK_ROWS)
        expected = reference(layer, x[torch.from_numpy(rows)], pairs).float()
        checks.append(PeerCheck(layer, x.view(torch.int16).numpy(), rows, pairs, expected))
    return checks


def send_check(actor: Any, checks: Iterable[PeerCheck]) -> list[Future]:
    """A peer's check calls to its ``actor`` (an :class:`~.shard.ExpertPeer`), as futures."""
    return [actor.compute.remote(c.layer, c.x, c.rows, c.experts).future() for c in checks]


def check_failure(
    checks: Iterable[PeerCheck], answers: Iterable, timeout: float | None = None
) -> str | None:
    """Why a peer's ``answers`` (futures of its compute calls, one per check) fail the
    ``checks``, or ``None`` when every pair matches this host's."""
    for check, answer in zip(checks, answers, strict=True):
        try:
            y, _ = answer.result(timeout=timeout)
        except Exception as error:  # noqa: BLE001 - died, timed out or raised
            return f"computing layer {check.layer}: {first_line(error)}"
        relative = check.error(y)
        if not relative <= CHECK_TOLERANCE:
            return (
                f"its experts {sorted(set(check.experts.tolist()))} of layer "
                f"{check.layer} differ from this host's (relative error "
                f"{relative:.3g} > {CHECK_TOLERANCE})"
            )
    return None
