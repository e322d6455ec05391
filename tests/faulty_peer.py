"""A mesh peer that answers late, or not at all, when a test tells it to: fault injection
kept out of the runtime's :class:`~vllm_specexpert.peers.shard.ExpertPeer`.

:class:`~vllm_specexpert.peers.tier.PeerTier` starts it in place of ``ExpertPeer``
(``peer_class=FaultyPeer``). Ray's workers cannot import this module (it is on the tests'
path only), so Ray pickles the class by value."""

from __future__ import annotations

import os
import sys
import time

import ray.cloudpickle

from vllm_specexpert.peers.shard import ExpertPeer

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class FaultyPeer(ExpertPeer):
    """An :class:`ExpertPeer` whose pings and computes answer :attr:`delay_s` late, and
    not at all while its :attr:`gate` file exists."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay_s = 0.0
        self.gate: str | None = None

    def set_delay(self, seconds: float) -> None:
        """Answer every later call ``seconds`` late: a far-away peer without a network
        between."""
        self.delay_s = seconds

    def hold(self, gate: str) -> None:
        """Answer no call while the file ``gate`` exists: a hung peer, however long its
        caller waits. Removing the file releases it (a call could not: the held calls
        take every thread of the actor). The peer runs on this host."""
        self.gate = gate

    def _wait_to_answer(self) -> None:
        while self.gate is not None and os.path.exists(self.gate):
            time.sleep(0.01)
        time.sleep(self.delay_s)

    def ping(self) -> int:
        self._wait_to_answer()
        return super().ping()

    def compute(self, *args, **kwargs):
        self._wait_to_answer()
        return super().compute(*args, **kwargs)
