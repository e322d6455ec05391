"""One MoE layer's view of the mesh's peer tier: what its executor and planners call to
send (row, expert) pairs to peers and add their answers (:mod:`.tier`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_specexpert.peers.tier import PeerTier, Sent


@dataclass
class PeerJob:
    """One layer call's entries computed by peers: where each one's answer comes from."""

    sources: list[tuple[Sent, np.ndarray, np.ndarray, np.ndarray]]
    """(what was sent, entry rows, entry columns, the pair index of each entry)."""
    reused: int = 0
    """Entries taken from what was fired ahead (Early Fire's hits)."""


@dataclass
class LayerPeers:
    """One layer's view of the peer tier: what its executor and planners call."""

    tier: PeerTier
    layer: int
    """Decoder-layer index."""
    fired: Sent | None = None
    """Pairs of the running call's rows sent ahead of the router (Early Fire): set at
    the call's start by whoever fires, taken by :meth:`stage` instead of sending them
    again."""

    def hosted(self) -> np.ndarray:
        return self.tier.hosted(self.layer)

    def send(self, x: torch.Tensor, tokens: np.ndarray, experts: np.ndarray) -> Sent:
        return self.tier.send(self.layer, x, tokens, experts)

    def stage(self, x: torch.Tensor, ids: np.ndarray, entries: np.ndarray) -> PeerJob:
        """Send the ``entries`` ([T, K] mask over ``ids``) of the call's rows ``x``,
        taking those whose (row, expert) pair was :attr:`fired` ahead from there
        instead."""
        rows, cols = np.nonzero(entries)
        job = PeerJob([])
        fired = self.fired
        if fired is not None and len(fired.tokens):
            num = max(int(ids.max()), int(fired.experts.max())) + 1
            keys = fired.tokens * num + fired.experts
            order = np.argsort(keys, kind="stable")
            wanted = rows * num + ids[rows, cols]
            at = np.minimum(np.searchsorted(keys[order], wanted), len(keys) - 1)
            hit = keys[order][at] == wanted
            if hit.any():
                job.sources.append((fired, rows[hit], cols[hit], order[at][hit]))
            job.reused = int(hit.sum())
            rows, cols = rows[~hit], cols[~hit]
        if len(rows):
            sent = self.send(x, rows, ids[rows, cols])
            job.sources.append((sent, rows, cols, np.arange(len(rows))))
        return job

    def finish(
        self, job: PeerJob, out: torch.Tensor, weights: torch.Tensor, shape: tuple[int, int]
    ) -> np.ndarray:
        """Add the job's answers, times the entries' ``weights`` ([T, K]), to ``out``;
        return the ``[T, K]`` mask of entries no peer answered."""
        failed = np.zeros(shape, dtype=bool)
        acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
        for sent, rows, cols, pairs in job.sources:
            y, done = self.tier.receive(sent)
            ok = done[pairs]
            failed[rows[~ok], cols[~ok]] = True
            if ok.any():
                r, c = (torch.from_numpy(a[ok]).to(out.device) for a in (rows, cols))
                acc.index_add_(
                    0,
                    r,
                    y[torch.from_numpy(pairs[ok])].to(out.device) * weights[r, c].float()[:, None],
                )
        out.copy_((out.float() + acc).to(out.dtype))
        return failed
