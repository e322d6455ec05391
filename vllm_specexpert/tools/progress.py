"""Progress of the long offline tools (calibrate, analyze, capture, train-estimator,
train-path, eval-path, train-tiny, corpus), shown as vLLM's own commands show theirs: a
tqdm bar on stderr.

On a terminal the bar is redrawn in place, at most once a second. Anywhere else (a log
file, a pipe, CI) tqdm's redraws are carriage returns with no newline until the bar
closes, so whatever reads lines (``tail -n``, a CI log, a line-buffered reader) shows
nothing for the whole run; there each redraw is one line instead, every
:data:`LOG_INTERVAL_S` seconds (also when nothing moved: the run is alive).
"""

from __future__ import annotations

import sys

TERMINAL_INTERVAL_S = 1.0
LOG_INTERVAL_S = 30.0


class _Lines:
    """A stream for tqdm off a terminal: each redraw becomes one line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").rstrip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(desc: str, total: int | None = None, unit: str = "it", iterable=None, **kwargs):
    """A tqdm bar on stderr (see module doc), over ``iterable`` if given; ``total``
    ``None`` (and no sized iterable): a count without end. A postfix set with
    ``refresh=False`` shows at the next redraw."""
    from tqdm import tqdm

    stream = sys.stderr
    if stream.isatty():
        return tqdm(
            iterable,
            desc=desc,
            total=total,
            unit=unit,
            file=stream,
            mininterval=TERMINAL_INTERVAL_S,
            dynamic_ncols=True,
            **kwargs,
        )
    return tqdm(
        iterable,
        desc=desc,
        total=total,
        unit=unit,
        file=_Lines(stream),
        ncols=100,
        mininterval=LOG_INTERVAL_S,
        maxinterval=LOG_INTERVAL_S,
        **kwargs,
    )
