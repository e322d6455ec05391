"""Writes to a file from another process, as an operator's program would: with ``pwrite``
or through a writable shared mapping, truncating it, holding it open between writes.
Where an engine holds a read lease on the file (the mapped residency), the writer's open
waits until the engine lets go of it, which it does the next time it asks
(:func:`wait_for_break` waits until the writer is waiting)."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = r"""
import itertools, json, mmap, os, sys
path, mapped, first = sys.argv[1], sys.argv[2] == "mapped", sys.argv[3]
fd = os.open(path, os.O_RDWR)
region = mmap.mmap(fd, os.fstat(fd).st_size) if mapped else None
if mapped:
    os.close(fd)  # (the writable mapping alone keeps the file open for writing)
print("open", flush=True)
with open(first) as f:
    queued = f.readlines()
for line in itertools.chain(queued, sys.stdin):
    command = json.loads(line)
    if command[0] == "write":
        offset, data = command[1], bytes.fromhex(command[2])
        if mapped:
            region[offset : offset + len(data)] = data
        else:
            os.pwrite(fd, data, offset)
    elif command[0] == "truncate":
        os.ftruncate(fd, command[1])
    print("done", flush=True)
if mapped:
    region.close()
else:
    os.close(fd)
"""


class OtherWriter:
    """A process that opens ``path`` for writing (``mapped``: maps it writable and
    closes the descriptor), then writes what it is told until :meth:`close`. ``writes``
    and ``truncate``: done as soon as its open returns, without waiting here."""

    def __init__(
        self,
        path: str | Path,
        mapped: bool = False,
        writes: list[tuple[int, bytes]] = (),  # type: ignore[assignment]
        truncate: int | None = None,
    ) -> None:
        commands = [["write", offset, data.hex()] for offset, data in writes]
        if truncate is not None:
            commands.append(["truncate", truncate])
        # (In a file, not the pipe: the process reads nothing before its open returns.)
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as first:
            first.writelines(json.dumps(command) + "\n" for command in commands)
        self.process = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(path), "mapped" if mapped else "pwrite", first.name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.answers = ["open"] + ["done"] * len(commands)
        """What the process has yet to print."""
        self.first = Path(first.name)

    def write(self, offset: int, data: bytes) -> None:
        self._send(["write", offset, data.hex()])
        self._wait()

    def truncate(self, size: int) -> None:
        self._send(["truncate", size])
        self._wait()

    def close(self) -> None:
        """Let go of the file once every command is done (the process ends)."""
        self._wait()
        assert self.process.stdin is not None
        self.process.stdin.close()
        assert self.process.wait(timeout=60) == 0
        self.first.unlink()

    def _send(self, command: list) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        self.answers.append("done")

    def _wait(self) -> None:
        assert self.process.stdout is not None
        while self.answers:
            assert self.process.stdout.readline().strip() == self.answers.pop(0)


def write_from_another_process(
    path: str | Path, writes: list[tuple[int, bytes]], lease_fd: int | None = None, then=None
) -> None:
    """``writes`` (offset, bytes) to ``path`` by another process, which ends after. Where a
    lease is held on ``lease_fd``: once the writer waits in its open, ``then()`` (a call
    of the engine, which lets go of the lease) runs first."""
    writer = OtherWriter(path, writes=writes)
    if lease_fd is not None:
        wait_for_break(lease_fd)
        if then is not None:
            then()
    writer.close()


def wait_for_break(lease_fd: int, timeout_s: float = 30.0) -> None:
    """Wait until the read lease on ``lease_fd`` (this process's) is breaking: a writer
    waits in its open."""
    deadline = time.monotonic() + timeout_s
    while fcntl.fcntl(lease_fd, fcntl.F_GETLEASE) == fcntl.F_RDLCK:
        assert time.monotonic() < deadline, "no writer came"
        time.sleep(0.01)
