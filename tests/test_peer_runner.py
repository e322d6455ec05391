"""``peer/run.py``'s bookkeeping (``make test-peer``): a test whose outcome differs
between modes is a difference only if it repeats; one that changes between its own two
runs is flaky, reported, not a difference."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "peer"))

import run


def test_a_difference_must_repeat_in_every_mode():
    differing = run.differences(
        {
            "vanilla": {"a": "passed", "race": "failed", "real": "passed", "same": "failed"},
            "offload": {"a": "passed", "race": "passed", "real": "failed", "same": "failed"},
        }
    )
    assert set(differing) == {"race", "real"}
    # The second run: vanilla's race passed this time; offload's failure repeated.
    kept, flaky = run.split_flaky(
        differing,
        {
            "vanilla": {"race": "passed", "real": "passed"},
            "offload": {"race": "passed", "real": "failed"},
        },
    )
    assert kept == {"real": {"vanilla": "passed", "offload": "failed"}}
    assert flaky == {"race": {"vanilla": ["failed", "passed"], "offload": ["passed", "passed"]}}


def test_a_differing_test_missing_from_the_second_run_is_flaky_not_dropped():
    kept, flaky = run.split_flaky(
        {"t": {"vanilla": "passed", "offload": "failed"}},
        {"vanilla": {"t": "passed"}, "offload": {}},
    )
    assert not kept and flaky["t"]["offload"] == ["failed", "absent"]


def test_junit_names_become_node_ids(tmp_path):
    (tmp_path / "tests" / "openai").mkdir(parents=True)
    (tmp_path / "tests" / "openai" / "test_metrics.py").write_text("")
    assert (
        run.node_id(tmp_path, "tests.openai.test_metrics::test_abort[-multimodal]")
        == "tests/openai/test_metrics.py::test_abort[-multimodal]"
    )
    assert (
        run.node_id(tmp_path, "tests.openai.test_metrics.TestA::test_b")
        == "tests/openai/test_metrics.py::TestA::test_b"
    )
