"""A clock that moves only when a test moves it: the outcome of an emulated link or host
then depends on what the test did, not on how loaded the machine is."""

from vllm_specexpert.tiers.link import Clock


class ManualClock(Clock):
    """Seconds that pass by :meth:`advance`, or at once to the moment a wait is for (an
    emulated copy waited for lands without real time passing). Also a timer
    (``clock()``), for :attr:`HostExperts.timer`. Not for two threads at once."""

    def __init__(self, now: float = 0.0):
        self.time = now

    def now(self) -> float:
        return self.time

    def __call__(self) -> float:
        return self.time

    def sleep_until(self, deadline: float) -> None:
        self.time = max(self.time, deadline)

    def advance(self, seconds: float) -> None:
        self.time += seconds
