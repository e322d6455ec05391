"""Approximate modes at a serving batch size: teacher-forced next-token accuracy along
the decode path with 16 sequences per decode step, against ``fetch`` at the same batch
size, on the trained model's held-out text (budget 0.25; one engine). Each mode keeps the
bar under its quality budget, as users run it, on every CPU, and within a wider margin
alone; a mode below the bar falls back to ``fetch`` at that batch size under the
budget."""

import pytest
from vllm_harness import fix_host_cost, fix_link_cost, make_llm, shutdown

import vllm_specexpert
from specexpert_testbed.fixtures import TRAINED_MODEL
from vllm_specexpert.tools.embedded_model import TRAINED_CALIBRATION_DIR
from vllm_specexpert.tools.teacher_forcing import (
    TeacherForcing,
    held_out_windows,
    teacher_forced,
)

pytestmark = pytest.mark.slow  # (approximate modes' accuracy at a batch: minutes of engines)

PROMPT, FORCED, WINDOWS, BATCH = 16, 32, 64, 16
TARGET = 0.98
TOLERANCE = 0.01
"""The issue's bar is 98 % of exact's accuracy. Over these 2048 positions the two runs
differ at ~12 % of them, so the accuracy ratio has a standard error of about 0.7 points:
the test allows one point below the bar. The fault it is there for (BuddyMoE's rho = 3
in a batch) loses 6-9 points."""

FALLBACK = {"sample": 1.0, "window": 32}
"""The default accuracy budget (0.02), deciding after two passes of 16 sequences."""
FIRST_WINDOW = 32 / (WINDOWS * FORCED) * 0.5
"""What the first window may cost: its 32 positions run the mode before any decision,
and ``drop`` loses less than half of the accuracy (26-34 % in the docs' tables)."""


@pytest.fixture(scope="module")
def llm():
    llm = make_llm(
        TRAINED_MODEL,
        specexpert={
            "budget": 0.25,
            "calibration": str(TRAINED_CALIBRATION_DIR),
            "miss_policy": "drop",
            "quality": FALLBACK,
        },
        max_num_seqs=BATCH,
        logits_processors=[TeacherForcing],
    )
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def windows():
    return held_out_windows(WINDOWS, PROMPT + FORCED)


HOST_COST = (5e-6, 1e-7)
"""Seconds per expert and per row that ``auto_buddy``'s host/link split is made with:
about what this model's host computations cost on a 2-core CPU (measured ~4.6 us and
0.05-0.17 us), beside a copy of :data:`LINK_COST`, so that some misses go to the host
and some to the link. Fixed, not measured: the split decides what becomes resident, and
so the later substitutions; measured, it followed the machine's load (kept 0.966-0.994
over runs of the same test)."""
LINK_COST = 1e-10
"""Seconds per byte of a copy that the split is made with: ~9.8 us per expert of this
model (98 kB). The link is not emulated here, so its own estimate is the memcpy time its
copy thread measures; it stays at this starting guess only while nothing is prefetched
(no predictor, no ``admit_host_experts``), hence fixed too. What is left for the split
to read is the routing: the resident experts (no copy in flight: nothing lands in the
background), the calibration's buddy lists and gates."""


def accuracy(llm, windows, **mode) -> float:
    vllm_specexpert.reconfigure(llm, **{"quality": None, **mode})
    fix_host_cost(llm, *HOST_COST)
    fix_link_cost(llm, LINK_COST)
    top1 = teacher_forced(llm, windows, PROMPT, BATCH)["top1"]
    actual = [t for w in windows for t in w[PROMPT:]]
    return sum(a == b for a, b in zip(top1, actual, strict=True)) / len(actual)


@pytest.fixture(scope="module")
def exact(llm, windows):
    return accuracy(llm, windows, miss_policy="fetch", predictor="none")


ALONE_TOLERANCE = 2 * TOLERANCE
"""What a mode alone (no budget) may keep below the bar, on every CPU: vLLM's kernel
rounds otherwise with AMX than without, and the host/device split and substitutions
follow. Measured: auto_buddy alone kept 0.967 on a CPU with AMX (issue 73), at or above
0.97 on AVX-512 ones. Under its budget every mode keeps the bar's 0.97 on both."""


@pytest.mark.parametrize(
    "mode",
    [
        {"miss_policy": "buddy"},
        {"miss_policy": "auto_buddy"},
        {"miss_policy": "speculate", "predictor": "quasi_hidden"},
    ],
    ids=lambda m: m["miss_policy"],
)
def test_an_approximate_mode_keeps_98_percent_in_a_batch(llm, windows, exact, mode):
    # The promise, as a user runs the mode (under a budget: the default limit, deciding
    # sooner), and the mode alone, within a wider margin (its gates: the rho = 3 fault
    # loses 6-9 points, test_buddymoes_rho_3_does_not_in_a_batch).
    alone = accuracy(llm, windows, **mode) / exact
    kept = accuracy(llm, windows, **mode, quality=FALLBACK) / exact
    print(f"{mode}: kept {kept:.3f} under the budget, {alone:.3f} alone at {BATCH} sequences")
    assert kept >= TARGET - TOLERANCE
    assert alone >= TARGET - ALONE_TOLERANCE


def test_buddymoes_rho_3_does_not_in_a_batch(llm, windows, exact):
    # The defaults' reason (BuddyConfig.rho): three substitutions per token pass the
    # per-call beta gate in a batch, and the accuracy falls below the bar.
    kept = accuracy(llm, windows, miss_policy="buddy", buddy={"rho": 3}) / exact
    print(f"buddy rho=3: kept {kept:.3f}")
    assert kept < TARGET - TOLERANCE


def test_a_mode_below_the_bar_falls_back_to_exact_at_that_batch_size(llm, windows, exact):
    alone = accuracy(llm, windows, miss_policy="drop") / exact
    print(f"drop: kept {alone:.3f} at {BATCH} sequences per step")
    assert alone < TARGET - TOLERANCE  # the mode alone is below the bar here
    kept = accuracy(llm, windows, miss_policy="drop", quality=FALLBACK) / exact
    quality = vllm_specexpert.get_stats(llm)[0]["quality"]
    print(f"drop under the quality budget: kept {kept:.3f}; {quality['batches']}")
    assert kept >= TARGET - TOLERANCE - FIRST_WINDOW
    # Exact for most passes: a 32-token window of drop's sampled results may still come
    # out under budget now and then (the estimate is noisy over so few tokens) and
    # switch the class back for one window.
    passes = WINDOWS // BATCH * FORCED
    assert quality["batches"]["9-32"]["exact_passes"] > passes / 2, quality
    assert quality["batches"]["1"]["sampled_tokens"] == 0  # no pass of another size
    assert not quality["batches"]["1"]["exact"]
