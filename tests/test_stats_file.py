"""``stats_path`` names a file the stats are written to, by replacing it: anything else
at the path (a directory, a device node, a FIFO) is refused at start with one error
naming the field, and is never replaced, also when it appears after start (issue 22,
items 1 and 2). No vLLM engine: the check the plugin runs at engine start and the
writer the engine runs."""

import json
import os
import stat

import pytest
import torch
from moe_reference import random_layer

from vllm_specexpert.config import SpecExpertConfig, SpecExpertConfigError
from vllm_specexpert.engine import OffloadEngine
from vllm_specexpert.stats import check_stats_path, write_json_atomic
from vllm_specexpert.stats_writers import StatsWriter


def fifo(path):
    os.mkfifo(path)
    return path


def null_device(path):
    """A copy of ``/dev/null`` (character device 1:3), as an operator would point at."""
    if os.geteuid() != 0:
        pytest.skip(
            "mknod of a character device needs root; the FIFO case covers special files without it"
        )
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return path


def directory(path):
    path.mkdir()
    return path


SPECIAL = {"fifo": fifo, "device": null_device, "directory": directory}


def kind_of(path) -> int:
    return stat.S_IFMT(os.lstat(path).st_mode)


@pytest.mark.parametrize("make", list(SPECIAL))
def test_a_path_that_is_not_a_regular_file_is_refused_at_start(tmp_path, make):
    path = SPECIAL[make](tmp_path / "stats")
    before = kind_of(path)
    with pytest.raises(SpecExpertConfigError) as info:
        check_stats_path(str(path))
    assert info.value.field_name == "stats_path"
    assert ("a directory" if make == "directory" else "not a regular file") in str(info.value)
    assert kind_of(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats"]  # no probe left


def test_the_engine_refuses_it_too(tmp_path):
    # The engine checks its own rank's path when it starts (the plugin checks rank 0's).
    path = fifo(tmp_path / "stats-1.json")
    engine = OffloadEngine(
        SpecExpertConfig.from_dict(
            {"budget": 0.25, "stats_path": str(tmp_path / "stats-{rank}.json")}
        ),
        torch.device("cpu"),
        rank=1,
    )
    engine.add_layer("layer", random_layer(seed=0), top_k=4, index=0)
    with pytest.raises(SpecExpertConfigError, match="stats_path"):
        engine.start()
    assert stat.S_ISFIFO(os.lstat(path).st_mode)


@pytest.mark.parametrize("make", list(SPECIAL))
def test_a_path_that_becomes_one_after_start_is_never_replaced(tmp_path, make, caplog):
    path = tmp_path / "stats"
    check_stats_path(str(path))
    writer = StatsWriter(str(path), 3600, lambda: {"n": 1})
    writer.write()
    assert json.loads(path.read_text()) == {"n": 1}
    path.unlink()
    SPECIAL[make](path)
    before = kind_of(path)
    writer.write()
    writer.write()
    writer.close()
    assert kind_of(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats"]  # no stray .tmp file
    warnings = [r for r in caplog.records if "cannot write stats_path" in r.getMessage()]
    assert len(warnings) == 1  # logged once, not per write


def test_a_symlink_is_followed_and_kept(tmp_path):
    target = tmp_path / "real.json"
    link = tmp_path / "stats.json"
    link.symlink_to(target)
    check_stats_path(str(link))
    write_json_atomic(str(link), {"n": 2})
    assert link.is_symlink() and json.loads(target.read_text()) == {"n": 2}


def test_a_symlink_to_a_special_file_is_refused(tmp_path):
    link = tmp_path / "stats.json"
    link.symlink_to(fifo(tmp_path / "pipe"))
    with pytest.raises(SpecExpertConfigError, match="not a regular file"):
        check_stats_path(str(link))


def test_a_removed_directory_is_not_made_again_by_a_write(tmp_path):
    """The metrics snapshots' directory is removed by the frontend at exit; a worker
    that writes after that must not bring it back."""
    directory = tmp_path / "snapshots"
    directory.mkdir()
    writer = StatsWriter(
        str(directory / "worker.json"), 3600, lambda: {}, what="snapshot", write_last=False
    )
    directory.rmdir()
    writer.write()
    writer.close()  # (joins its thread: nothing writes after this)
    assert not directory.exists()


def test_two_threads_writing_one_file_at_once_both_land(tmp_path, monkeypatch):
    """A timer's write and an RPC's flush of the same file interleave: the first is held
    between writing its temp file and renaming it while the second writes whole. Each
    rename must find its own temp file (one per thread, not one per process)."""
    import threading

    from vllm_specexpert import stats

    path = tmp_path / "stats.json"
    held, go = threading.Event(), threading.Event()
    dump = json.dump

    def dump_held(payload, f, **kwargs):
        dump(payload, f, **kwargs)
        if payload["writer"] == "timer":
            held.set()
            go.wait(30)

    monkeypatch.setattr(stats.json, "dump", dump_held)
    errors = []

    def timer():
        try:
            write_json_atomic(str(path), {"writer": "timer"})
        except Exception as error:  # noqa: BLE001 - what the test looks for
            errors.append(error)

    thread = threading.Thread(target=timer)
    thread.start()
    assert held.wait(30)
    write_json_atomic(str(path), {"writer": "rpc"})
    go.set()
    thread.join(30)
    assert errors == []
    assert json.loads(path.read_text()) == {"writer": "timer"}  # the last rename wins
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats.json"]
