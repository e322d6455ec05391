"""A real multi-node Ray cluster on one machine, with a settable network delay between nodes.

What it builds: a Ray head node in the root network namespace (address ``10.77.0.1``) and
``peers`` Ray worker nodes, each in a network namespace of its own (``10.77.<i+1>.2``). Each
namespace is joined to the root one by two TUN devices (``10.77.<i+1>.1`` on the root side) and
a small user-space forwarder process holding both, which releases every packet ``rtt_ms / 2``
after it arrived, in each direction, in order. A driver in the root namespace thus talks to an
actor on peer ``i`` over real TCP with a real round trip of ``rtt_ms`` (+ ~0.2 ms of forwarder
overhead; an actor call returning 64 KB takes ``rtt_ms`` + ~1-3 ms). Peer-to-peer packets are
routed by the root kernel (forwarding is enabled on our TUN devices only) and cross two
forwarders, as in a star network. Only latency is emulated, not bandwidth.

Why: this kernel has no ``netem`` (``tc qdisc ... netem``), so the delay is added in user
space. The forwarder sleeps in ``select`` until a packet arrives or the next queued one is due:
no CPU when idle.

Needs root, ``/dev/net/tun`` and iproute2. Names carry the owner's pid (``sx[nabdr]<pid><k>``),
so a crashed run never collides; :func:`cleanup_stale` removes what dead owners left behind.
Ray 2.60 has token auth on by default: every process of the cluster gets ``RAY_AUTH_MODE=token``
and a fresh ``RAY_AUTH_TOKEN`` (:attr:`MeshCluster.env`); nothing is written to ``~/.ray``.

Anyone's ``ray stop`` on this machine kills this cluster too (it matches processes by name);
while it runs, ``ray.init(address="auto")`` / ``ray status`` without an address see two
clusters (a plain ``ray.init()`` still starts its own). The state API (``ray.util.state``)
needs the dashboard, which is off: use ``ray.nodes()``.

CLI: ``python -m vllm_specexpert.tools.mesh_cluster --peers 2 --rtt-ms 5`` (Ctrl-C stops it).
Test infrastructure: never imported by the plugin's runtime modules.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import itertools
import json
import os
import re
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import deque
from typing import Self

_NAME = re.compile(r"^sx[nabdr](\d+)[a-z]")  # netns, root tun, ns tun, head's tun, temp dir
_TUNSETIFF, _IFF_TUN, _IFF_NO_PI = 0x400454CA, 0x0001, 0x1000
_counter = itertools.count()  # instances made by this process: part of the tag


def _run(cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, **kw)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)[:300]} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return r


def _ip(*args: str, ns: str | None = None, check: bool = True) -> str:
    return _run(["ip", *(["-n", ns] if ns else []), *args], check=check).stdout


def _open_tun(name: str) -> int:
    """A non-persistent TUN device: it disappears when its last fd closes, so a dead
    forwarder leaves no device behind, in whichever namespace the device is."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    return fd


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _pid_dead(name: str) -> bool:
    """Whether ``name`` is one of ours whose owner pid is gone."""
    m = _NAME.match(name)
    return bool(m) and not os.path.exists(f"/proc/{m.group(1)}")


def _kill(sids: set[int], nets: list[str], grace_s: float = 1.0) -> None:
    """Stop every process of the given sessions or network namespaces: SIGTERM (repeated, for
    children spawned meanwhile), SIGKILL after ``grace_s`` (the head's raylet drains for 10 s,
    its GCS ignores SIGTERM; all state is thrown away anyway). Each `ray start` runs in a session
    of its own and all Ray processes of its node stay in it (Ray renames its processes, which
    clobbers /proc/<pid>/environ: an env marker would not do). Never `ray stop`: it kills
    every Ray process of the machine, other people's too."""

    def find() -> set[int]:
        pids = {int(p) for n in nets for p in _ip("netns", "pids", n, check=False).split()}
        for d in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{d}/stat") as f:
                    state, _, _, sid = f.read().rsplit(")", 1)[1].split()[:4]
            except OSError:
                continue
            if int(sid) in sids and state != "Z":
                pids.add(int(d))
        return pids - {os.getpid()}

    end = time.monotonic() + grace_s
    while (pids := find()) and time.monotonic() < end + 3:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM if time.monotonic() < end else signal.SIGKILL)
        time.sleep(0.1)


def cleanup_stale() -> None:
    """Remove what instances whose owner pid is dead left behind: their Ray processes, network
    namespaces, devices and temp dirs (their forwarders exit alone: their stdin closed)."""
    nets = [n.split()[0] for n in _ip("netns", "list").splitlines() if _pid_dead(n)]
    dirs = [f"/tmp/{d}" for d in os.listdir("/tmp") if d.startswith("sxr") and _pid_dead(d)]
    sids: set[int] = set()
    for d in dirs:
        with contextlib.suppress(OSError), open(os.path.join(d, "sids")) as f:
            sids.update(int(x) for x in f.read().split())
    # A session whose leader lives is not ours any more (pid reused): rather leave ours.
    _kill({s for s in sids if not os.path.exists(f"/proc/{s}")}, nets)
    for n in nets:
        _ip("netns", "delete", n, check=False)
    for line in _ip("-o", "link").splitlines():
        if _pid_dead(name := line.split(":")[1].strip().split("@")[0]):
            _ip("link", "delete", name, check=False)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


class MeshCluster:
    """Context manager. A Ray head node in the root network namespace, and `peers` Ray worker
    nodes, each in its own network namespace, joined to the root namespace through a user-space
    TUN forwarder that delays every packet by rtt_ms/2 in each direction.

    Driver: ``os.environ.update(c.env)`` *before* ``import ray`` (Ray reads ``RAY_AUTH_*``
    once per process; else call ``ray._raylet.Config.initialize("")`` after it),
    ``ray.init(address=c.address)``, and ``ray.shutdown()`` before the ``with`` block ends.

    ``mtu``: of the links (1500, as Ethernet). ``congestion``: the TCP congestion control of
    every connection over the links (``None``: the machine's default). Cubic by default, as on
    most Linux hosts: this machine's default, BBR, paces the short app-limited replies of actor
    calls at its low bandwidth estimate (measured: 64 KB at 20 ms took 31 ms, not 22)."""

    def __init__(
        self,
        peers: int,
        rtt_ms: float = 0.1,
        cpus_per_peer: int = 1,
        head_cpus: int = 1,
        mtu: int = 1500,
        object_store_mb: int = 200,
        congestion: str | None = "cubic",
    ) -> None:
        self.peers, self.rtt_ms, self.mtu, self.store_mb = peers, rtt_ms, mtu, object_store_mb
        self.congestion = congestion
        self.cpus_per_peer, self.head_cpus = cpus_per_peer, head_cpus
        self.tag = f"{os.getpid()}{chr(ord('a') + next(_counter) % 26)}"
        self.temp_dir = f"/tmp/sxr{self.tag}"  # short: Ray's Unix socket paths live under it
        self.env: dict[str, str] = {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
        }
        """Environment variables a driver process must have to join (token auth)."""
        self.peer_resources: list[str] = [f"specexpert_peer_{i}" for i in range(peers)]
        """A custom Ray resource per worker node: ``resources={name: 1}`` pins an actor there."""
        self.address = ""
        """What a driver in the root namespace passes to ``ray.init(address=...)``."""
        self._net, self._anchor, self._sids = "", None, set()
        self._forwarders: list[subprocess.Popen] = []
        self._peer_ips: list[str] = []

    def __enter__(self) -> Self:
        """Create namespaces, devices, forwarders; start the head and one Ray node per peer;
        wait until Ray sees peers+1 alive nodes. Cleans up fully if anything fails."""
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        cleanup_stale()
        os.makedirs(self.temp_dir, exist_ok=True)
        used = _ip("-o", "-4", "addr")  # a free 10.x/16: 10.77 unless another instance runs
        self._net = next(f"10.{b}" for b in range(77, 200) if f" 10.{b}." not in used)
        head_ip, anchor = f"{self._net}.0.1", f"sxd{self.tag}"
        # The head's address is on an idle TUN device of ours (this kernel has no `dummy`):
        # every peer reaches it through its own forwarder, the root namespace locally.
        self._anchor = _open_tun(anchor)
        _ip("addr", "add", f"{head_ip}/32", "dev", anchor)
        _ip("link", "set", anchor, "up")
        for i in range(self.peers):
            self._add_peer(i)
        # The GCS and every head port with a fixed default on free ports: no collision with a
        # local ray.init() of someone else (peers have their own port spaces).
        port, names = (
            _free_port(),
            [
                "node-manager",
                "object-manager",
                "ray-client-server",
                "dashboard-agent-grpc",
                "dashboard-agent-listen",
                "metrics-export",
                "runtime-env-agent",
            ],
        )
        self._ray_start(
            (
                [
                    "--head",
                    f"--node-ip-address={head_ip}",
                    f"--port={port}",
                    f"--num-cpus={self.head_cpus}",
                    "--include-dashboard=false",
                    *[f"--{n}-port={_free_port()}" for n in names],
                ],
                self.temp_dir,
                None,
            )
        )
        self.address = f"{head_ip}:{port}"
        # A --temp-dir per worker: else `ray start` writes /tmp/ray/ray_current_cluster (which
        # a later plain ray.init() on this machine would try to join), and nodes started at
        # once in one session dir pick the same socket names.
        self._ray_start(
            *[
                (
                    [
                        f"--address={self.address}",
                        f"--node-ip-address={ip}",
                        f"--num-cpus={self.cpus_per_peer}",
                        f"--resources={json.dumps({r: 1})}",
                    ],
                    f"{self.temp_dir}/p{i}",
                    f"sxn{self.tag}p{i}",
                )
                for i, (ip, r) in enumerate(zip(self._peer_ips, self.peer_resources, strict=True))
            ]
        )
        self._wait_nodes()

    def _ray_start(self, *nodes: tuple[list[str], str, str | None]) -> None:
        """`ray start` each (args, temp dir, netns) in parallel, each in a session of its own."""
        exe = os.path.join(os.path.dirname(sys.executable), "ray")
        exe = exe if os.path.exists(exe) else shutil.which("ray") or "ray"
        procs = []
        for args, temp_dir, ns in nodes:
            cmd = [
                exe,
                "start",
                "--disable-usage-stats",
                f"--temp-dir={temp_dir}",
                f"--object-store-memory={self.store_mb << 20}",
                *args,
            ]
            procs.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, *cmd] if ns else cmd,
                    env=self._ray_env(),
                    start_new_session=True,
                    text=True,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
            self._sids.add(procs[-1].pid)  # `ip netns exec` execs: same pid, same session
            with open(f"{self.temp_dir}/sids", "w") as f:  # for cleanup_stale after a crash
                f.write(" ".join(map(str, self._sids)))
        for p in procs:
            out = p.communicate(timeout=180)[0]
            if p.returncode:
                raise RuntimeError(f"{' '.join(p.args)[:300]} failed:\n{out[-3000:]}")

    def _ray_env(self) -> dict[str, str]:
        # Not the caller's RAY_ADDRESS or auth settings: this cluster has its own.
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and "RAY_AUTH" not in k}
        return {**env, **self.env}

    def _add_peer(self, i: int) -> None:
        ns, a, b = f"sxn{self.tag}p{i}", f"sxa{self.tag}p{i}", f"sxb{self.tag}p{i}"
        root_ip, ns_ip = f"{self._net}.{i + 1}.1", f"{self._net}.{i + 1}.2"
        _ip("netns", "add", ns)
        fd_a, fd_b = _open_tun(a), _open_tun(b)  # both made here; b then moves (its fd stays)
        try:
            _ip("link", "set", b, "netns", ns)
            _ip("addr", "add", f"{root_ip}/24", "dev", a, "noprefixroute")
            # txqueuelen: the kernel drops packets when a device's queue is full; a TCP
            # window's burst must fit while the forwarder is busy.
            _ip("link", "set", a, "mtu", str(self.mtu), "txqueuelen", "10000", "up")
            with open(f"/proc/sys/net/ipv4/conf/{a}/forwarding", "w") as f:
                f.write("1")  # peer <-> peer via the root: this device only, not ip_forward
            _ip("link", "set", "lo", "up", ns=ns)
            _ip("addr", "add", f"{ns_ip}/24", "dev", b, "noprefixroute", ns=ns)
            _ip("link", "set", b, "mtu", str(self.mtu), "txqueuelen", "10000", "up", ns=ns)
            # Routes with their own TCP congestion control (see the class docstring): to the
            # peer from the root, and from the peer to the head and every other peer.
            cc = ["congctl", self.congestion] if self.congestion else []
            _ip("route", "add", f"{self._net}.{i + 1}.0/24", "dev", a, "src", root_ip, *cc)
            _ip("route", "add", f"{self._net}.{i + 1}.0/24", "dev", b, "src", ns_ip, *cc, ns=ns)
            _ip("route", "add", "default", "dev", b, "src", ns_ip, *cc, ns=ns)
            # By path, not -m: no need to import the package. -P: this file's directory
            # stays off sys.path, so nothing there can shadow the stdlib.
            self._forwarders.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-P",
                        os.path.abspath(__file__),
                        "--forward",
                        str(fd_a),
                        str(fd_b),
                        str(self.rtt_ms),
                    ],
                    pass_fds=(fd_a, fd_b),
                    stdin=subprocess.PIPE,
                    start_new_session=True,
                )
            )
        finally:
            os.close(fd_a)
            os.close(fd_b)
        self._peer_ips.append(ns_ip)

    def _wait_nodes(self, timeout_s: float = 120) -> None:
        # In a child process: Ray reads RAY_AUTH_* once per process, and the caller's process
        # must stay free to ray.init() as it likes.
        code = (
            "import sys,time; from ray._raylet import GcsClient\n"
            "from ray.core.generated.gcs_pb2 import GcsNodeInfo\n"
            "c, end = GcsClient(address=sys.argv[1]), time.time() + float(sys.argv[3])\n"
            "while len(c.get_all_node_info(timeout=10, state_filter="
            "GcsNodeInfo.GcsNodeState.ALIVE)) < int(sys.argv[2]):\n"
            "    assert time.time() < end, 'nodes did not come up'; time.sleep(0.2)\n"
        )
        _run(
            [sys.executable, "-c", code, self.address, str(self.peers + 1), str(timeout_s)],
            env=self._ray_env(),
        )

    def __exit__(self, *exc: object) -> None:
        """Stop every Ray process of this cluster and the forwarders; delete the namespaces,
        devices and temp dir. Ctrl-C is held back until this is done."""
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            nets = [f"sxn{self.tag}p{i}" for i in range(len(self._peer_ips) + 1)]
            _kill(self._sids, [n for n in nets if os.path.exists(f"/run/netns/{n}")])
            for f in self._forwarders:
                f.stdin.close()  # EOF: the forwarder exits; its TUN devices vanish with it
            for f in self._forwarders:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    f.wait(timeout=5)
                f.kill()  # (no-op when it exited)
                f.wait()
            for n in nets:
                _ip("netns", "delete", n, check=False)
            if self._anchor is not None:
                os.close(self._anchor)
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self._forwarders, self._anchor, self._sids = [], None, set()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def set_rtt(self, rtt_ms: float) -> None:
        """Change the round trip of every peer link, live (packets already queued keep theirs)."""
        self.rtt_ms = rtt_ms
        for f in self._forwarders:
            f.stdin.write(f"{rtt_ms}\n".encode())
            f.stdin.flush()

    def measure_rtt(self, samples: int = 5) -> list[float]:
        """Median TCP round trip in ms from the root namespace to each peer: how long a
        ``connect`` to a closed port takes to be refused (SYN out, RST back)."""
        out = []
        for ip in self._peer_ips:
            times = []
            for _ in range(samples):
                with socket.socket() as s, contextlib.suppress(ConnectionRefusedError):
                    s.settimeout(5 + self.rtt_ms / 1000)
                    t0 = time.perf_counter()
                    s.connect((ip, 9))
                times.append((time.perf_counter() - t0) * 1000)
            out.append(sorted(times)[samples // 2])
        return out


def _forward(fd_a: int, fd_b: int, rtt_ms: float) -> None:
    """The forwarder: a packet read from one TUN fd is written to the other at its arrival +
    rtt/2, in order. stdin brings new rtt values (a line each); EOF on stdin: stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner decides when we stop
    one_way, stdin = rtt_ms / 2000, sys.stdin.fileno()
    queues = {fd_a: (deque(), fd_b), fd_b: (deque(), fd_a)}  # in fd: [(release, packet)], out fd
    while True:
        now, due = time.monotonic(), []
        for q, out in queues.values():
            while q and q[0][0] <= now:
                with contextlib.suppress(OSError):  # (the device goes away at teardown)
                    os.write(out, q.popleft()[1])
            if q:
                due.append(q[0][0])
        # Sleep until a packet arrives, a new rtt comes or the next queued packet is due.
        timeout = max(0.0, min(due) - now) if due else None
        ready = select.select([fd_a, fd_b, stdin], [], [], timeout)[0]
        now = time.monotonic()
        for fd in ready:
            if fd == stdin:
                if not (lines := os.read(stdin, 4096).split()):
                    return
                one_way = float(lines[-1]) / 2000
                continue
            q = queues[fd][0]
            for _ in range(512):  # drain a burst, but come back to release on time
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                except OSError:
                    return  # the device is gone
                # max(): when the delay shrinks, later packets must not overtake earlier ones.
                q.append((max(now + one_way, q[-1][0]) if q else now + one_way, pkt))


def main(argv: list[str] | None = None) -> None:
    """CLI: start a cluster, print its address and measured RTTs, wait for Ctrl-C, clean up.
    (``--forward FD_A FD_B RTT_MS`` runs a forwarder: internal.)"""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in [
        ("peers", 2),
        ("rtt-ms", 0.1),
        ("cpus-per-peer", 1),
        ("head-cpus", 1),
        ("mtu", 1500),
    ]:
        p.add_argument(f"--{name}", type=type(default), default=default)
    p.add_argument("--forward", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.forward:
        return _forward(int(args.forward[0]), int(args.forward[1]), float(args.forward[2]))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that __exit__ runs
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    t0 = time.monotonic()
    with MeshCluster(args.peers, args.rtt_ms, args.cpus_per_peer, args.head_cpus, args.mtu) as c:
        print(f"started in {time.monotonic() - t0:.1f} s; address {c.address}")
        print("driver env:", " ".join(f"{k}={v}" for k, v in c.env.items()))
        for name, rtt in zip(c.peer_resources, c.measure_rtt(), strict=True):
            print(f"{name}: measured rtt {rtt:.2f} ms (set {c.rtt_ms} ms)", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            print("stopping")


if __name__ == "__main__":
    main()
