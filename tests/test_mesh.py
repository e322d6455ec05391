"""``mesh``: experts on Ray peers, on a local Ray cluster (two peer actors).

One engine on the trained model at budget 0.25, its misses computed by the peers; modes
switched with ``reconfigure``. The reference of the teacher-forced checks is the same
engine at budget 1.0: every expert resident, no miss, nothing sent, which is vanilla
vLLM bit for bit (``tests/test_exactness.py``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import signal
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip(
    "ray", reason="the mesh extra is not installed: pip install -e '.[mesh]' (make setup does)"
)

from faulty_peer import FaultyPeer
from manual_clock import ManualClock
from vllm import SamplingParams, TokensPrompt
from vllm_harness import agreement, make_llm, shutdown

import vllm_specexpert
from specexpert_testbed.fixtures import TRAINED_MODEL, model_path
from vllm_specexpert.config import SpecExpertConfigError
from vllm_specexpert.config.sections import MeshConfig
from vllm_specexpert.layer_call import LayerCall
from vllm_specexpert.layers.engines import _ENGINES
from vllm_specexpert.peers import calls, ray_cluster
from vllm_specexpert.peers import tier as peer_module
from vllm_specexpert.peers.health import Prober, timed
from vllm_specexpert.peers.peer_state import PeerState
from vllm_specexpert.peers.shard import ShardSpec, check_checkpoint
from vllm_specexpert.peers.start import placement
from vllm_specexpert.peers.tier import PeerTier
from vllm_specexpert.tools.teacher_forcing import FORCED_TOKENS, TeacherForcing

BUDGET = 0.25
KERNEL_ISA = "amx" if torch.cpu._init_amx() else "vec"
"""The ISA of vLLM's CPU MoE kernel on this machine (what conftest's header reports)."""
CALIBRATION = str(model_path(TRAINED_MODEL)) + "-calibration"
WINDOWS, PROMPT_TOKENS, FORCED = 8, 16, 48


@pytest.fixture(scope="module")
def llm():
    # The engine's peers are FaultyPeers (they answer as ExpertPeer until a test tells
    # them otherwise); the engine starts its PeerTier when the model loads.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(peer_module, "PeerTier", functools.partial(PeerTier, peer_class=FaultyPeer))
        llm = make_llm(
            TRAINED_MODEL,
            specexpert={
                "budget": BUDGET,
                "predictor": "quasi_hidden",
                "calibration": CALIBRATION,
                "mesh": {"peers": 2},
            },
            logits_processors=[TeacherForcing],
        )
    yield llm
    engine().close()
    shutdown(llm)


def engine():
    """The plugin's engine of this process (the engine core runs in-process here)."""
    return next(
        entry[1] for entry in _ENGINES.values() if entry[1].inputs.get("peer_tier") is not None
    )


def held_out_windows() -> list[list[int]]:
    from vllm_specexpert.tools import corpus
    from vllm_specexpert.tools.embedded_model import load_tokenizer

    tokenizer = load_tokenizer()
    ids = [i for f in corpus.corpus_files("validation") for i in tokenizer.encode(f.read()).ids]
    size = PROMPT_TOKENS + FORCED
    return [ids[i * 997 * size :][:size] for i in range(WINDOWS)]


def teacher_forced_top1(llm) -> list[int]:
    """The model's own top-1 at every forced position of the held-out windows."""
    prompts, params = [], []
    for window in held_out_windows():
        prompts.append(TokensPrompt(prompt_token_ids=window[:PROMPT_TOKENS]))
        params.append(
            SamplingParams(
                temperature=0.0,
                max_tokens=FORCED,
                logprobs=1,
                ignore_eos=True,
                extra_args={FORCED_TOKENS: window[PROMPT_TOKENS:]},
            )
        )
    top1 = [
        min(step.items(), key=lambda kv: kv[1].rank)[0]
        for out in llm.generate(prompts, params, use_tqdm=False)
        for step in out.outputs[0].logprobs
    ]
    assert len(top1) == WINDOWS * FORCED
    return top1


@pytest.fixture(scope="module")
def reference(llm):
    vllm_specexpert.reconfigure(llm, budget=1.0)
    vllm_specexpert.reset_stats(llm)
    top1 = teacher_forced_top1(llm)
    stats = vllm_specexpert.get_stats(llm)[0]
    assert stats["total"]["decode"]["peer_entries"] == 0  # nothing missed, nothing sent
    vllm_specexpert.reconfigure(llm, budget=BUDGET)
    return top1


ONLY_FAULTS_LEAVE = {"timeout_ms": 120_000, "rtt_cap_ms": 60_000}
"""Mesh timings no call or probe outlasts on a loaded machine (the defaults, 2 s and
80 ms, are for a network): a peer leaves the rotation only by the fault a test makes."""


def run_mode(llm, mode: str) -> tuple[float, dict]:
    vllm_specexpert.reconfigure(llm, mesh={"peers": 2, "mode": mode, **ONLY_FAULTS_LEAVE})
    vllm_specexpert.reset_stats(llm)
    return teacher_forced_top1(llm), vllm_specexpert.get_stats(llm)[0]


@pytest.mark.parametrize("mode", ["sync", "early_fire"])
def test_exact_modes_run_the_routers_experts_on_the_peers(llm, reference, mode):
    top1, stats = run_mode(llm, mode)
    decode = stats["total"]["decode"]
    # The peers computed the misses: none was fetched, dropped or substituted.
    assert decode["peer_entries"] == decode["missed_entries"] > 0
    assert decode["fetched_entries"] == 0 and "substituted_entries" not in decode
    assert decode["dropped_entries"] == decode.get("speculated_calls", 0) == 0
    peers = stats["mesh"]["peers"]
    # Both peers computed pairs, with the kernel this CPU runs; none fell back here.
    assert all(p["up"] and p["pairs"] > 0 and p["failures"] == 0 for p in peers)
    assert [p["isa"] for p in peers] == [KERNEL_ISA] * 2, peers
    assert decode["peer_fallback_entries"] == 0
    assert stats["output"] == "equivalent" and f"mesh {mode}" in stats["summary"]
    if mode == "early_fire":
        # Pairs went ahead by the prediction; some were right (kept), not all.
        assert 0 < decode["fired_used"] < decode["fired_entries"]
    else:
        assert decode["fired_entries"] == 0
    score = agreement([top1], [reference])
    print(
        f"{mode}: teacher-forced top-1 agreement {score:.4f}, "
        f"{decode['peer_entries']} peer entries, peers' kernel {KERNEL_ISA}"
    )
    # Peers return bf16 partial sums, added here: rounding otherwise than vanilla's one
    # kernel. It held 0.99 with vLLM's AVX512-BF16 kernels; with its AVX-512 ones (no
    # BF16) 0.987: 5 near-ties of 384 positions flipped.
    assert score >= 0.98


def test_no_stop_runs_the_predicted_experts_and_says_so(llm, reference):
    top1, stats = run_mode(llm, "no_stop")
    decode = stats["total"]["decode"]
    assert stats["output"] == "approximate" and not stats["exact"]
    # Layers after the first ran the prediction (the first has none), taking the
    # peers' results of what was fired, without a second round.
    assert decode["speculated_calls"] > 0
    assert decode["fired_used"] == decode["fired_entries"] > 0
    print(f"no_stop: teacher-forced top-1 agreement {agreement([top1], [reference]):.4f}")


NO_STOP_BUDGET = {"sample": 1.0, "window": 48, "batch_classes": []}
"""The default limit (2 % of next-token accuracy), judged on every sampled token over
windows of six passes of the 8 held-out windows (no_stop alone keeps 0.79 here), so the
budget runs it exactly after its first window. (At two passes a window, a window of the
mode's samples with no loss at all came every few windows: 16 tokens cannot tell a mode
that flips 17 % of its tokens, mostly near-ties, from one under budget.)"""


# (an approximate mode's budget on peers; the budget itself is test_quality_engine's)
@pytest.mark.slow
def test_no_stop_runs_under_the_quality_budget(llm, reference):
    # Issue 73 (6): it ran unbudgeted ("does not combine with mesh yet").
    vllm_specexpert.reconfigure(llm, quality=None)
    alone = agreement([run_mode(llm, "no_stop")[0]], [reference])
    vllm_specexpert.reconfigure(llm, quality=NO_STOP_BUDGET)
    top1, stats = run_mode(llm, "no_stop")
    budgeted = agreement([top1], [reference])
    quality = stats["quality"]
    print(f"no_stop alone {alone:.4f}, under the budget {budgeted:.4f}; {quality['batches']}")
    assert stats["output"] == "approximate" and quality["sampled_tokens"] > 0
    assert quality["exact"] and quality["switches_to_exact"] >= 1
    # (a decode pass per forced position, all windows in each; a window of the mode's
    # samples that comes under budget switches it back for a window)
    assert quality["exact_passes"] > FORCED / 2
    # It holds far more than the mode alone (0.95 against 0.79 here, 376 of 376 tokens
    # sampled), not the 98 %: the first-order estimate put no_stop's loss at 3.5 %
    # where teacher forcing measured 21 % (its errors compound through the estimated
    # inputs and the KV cache of the approximate passes), so windows under budget by
    # the estimate switch it back (docs/limits.md).
    assert budgeted >= alone + 0.1
    vllm_specexpert.reconfigure(llm, quality=None)  # (the module's other tests: the mode alone)


def generate_all(llm, prompts: int = 6, tokens: int = 40) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate([f"def f{i}(x):" for i in range(prompts)], params, use_tqdm=False)
    return [len(o.outputs[0].token_ids) for o in outs]


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


class KilledAtCall:
    """A peer's actor handle that kills the actor's process (SIGKILL) right after it
    sends the ``n``-th compute call, from the engine's own thread: that call is in
    flight when the peer dies."""

    def __init__(self, actor, pid: int, n: int):
        self.actor, self.pid, self.n, self.sent = actor, pid, n, 0

    def __getattr__(self, name: str):
        return getattr(self.actor, name)

    @property
    def compute(self):
        return self

    def remote(self, *args, **kwargs):
        ref = self.actor.compute.remote(*args, **kwargs)
        self.sent += 1
        if self.sent == self.n:
            os.kill(self.pid, signal.SIGKILL)
        return ref


def probe_until(tier: PeerTier, condition, rounds: int = 12) -> bool:
    """Probe the peers by hand until ``condition()``, at most ``rounds`` times, with the
    engine idle: on a manual clock (started at the tier's time), each round moves it on
    by ``probe_interval_s`` so a probe is due, reads the answers in and sends the next
    probes (what a layer call does), then blocks until every probe and restart check
    in flight is answered. A round trip is then 0 s of the tier's clock: only what the
    peers answered decides, not how fast this machine is."""
    saved = tier.clock
    tier.clock = clock = ManualClock(saved())
    try:
        for _ in range(rounds):
            clock.advance(tier.mesh.probe_interval_s)
            tier.hosted(next(iter(tier.hosts)))
            if condition():
                return True
            pending = [answer for _, answer, _ in tier.prober.pings]
            pending += [a for p in tier.peers if p.checking is not None for a in p.checking[1]]
            concurrent.futures.wait(pending, timeout=120)
        return condition()
    finally:
        tier.clock = saved


# Slow: a peer's failure mid-call is checked on toy engines by
# test_peer_entries_are_added_with_their_weights_or_computed_here.
@pytest.mark.slow
def test_killing_a_peer_mid_generation_loses_nothing(llm, reference):
    import ray

    # No probe during the run: the kill is found by the calls in flight. The timeout is
    # far longer than Ray takes to report the death, however loaded the machine: the
    # peer leaves as failed, never as hung (one CI run saw a 2 s timeout win the race).
    vllm_specexpert.reconfigure(
        llm, mesh={"peers": 2, "probe_interval_s": 600, **ONLY_FAULTS_LEAVE}
    )
    vllm_specexpert.reset_stats(llm)
    mesh = engine().inputs["peer_tier"]
    victim = mesh.peers[0]
    pid = ray.get(victim.actor.ping.remote())
    victim.actor = KilledAtCall(victim.actor, pid, 20)  # killed at its 20th call
    try:
        top1 = teacher_forced_top1(llm)  # every request runs to its last token
    finally:
        victim.actor = victim.actor.actor
    stats = vllm_specexpert.get_stats(llm)[0]
    decode = stats["total"]["decode"]
    state = stats["mesh"]["peers"][0]
    assert state["failures"] >= 1 and state["left"] == 1 and not state["up"]
    # What it was computing was computed here, and nothing went missing: the run
    # agrees with the reference about as well as an equivalent mode does. Which pairs
    # run here or on a peer depends on when the kill lands, and near-ties flip with
    # the rounding: `cpu` and `sync` sit at 0.989-0.990 on 1152 positions, and one
    # CI run of this test gave 0.984 on these 384. Dropped or garbage pairs give far
    # less (no_stop, which runs other experts on 1 in 8 layers' misses, gives 0.79).
    assert decode["peer_fallback_entries"] > 0
    assert agreement([top1], [reference]) >= 0.97
    assert stats["mesh"]["peers"][1]["up"]
    # Ray restarts the actor (it reloads its shard); a probe brings it back.
    vllm_specexpert.reconfigure(llm, mesh={"peers": 2, "probe_interval_s": 0.5})
    assert probe_until(mesh, lambda: victim.up), victim.reason
    assert victim.rejoined >= 1 and ray.get(victim.actor.ping.remote()) != pid


def test_a_hung_peer_leaves_and_rejoins(llm, tmp_path):
    import ray

    vllm_specexpert.reconfigure(llm, mesh={"peers": 2, "timeout_ms": 300, "probe_interval_s": 0.2})
    mesh = engine().inputs["peer_tier"]
    slow = mesh.peers[1]
    # Held, it answers nothing until released (its gate file removed): every call to it
    # outlasts the timeout, however slow the engine is to read the answers.
    gate = tmp_path / "hold"
    gate.touch()
    ray.get(slow.actor.hold.remote(str(gate)))
    try:
        assert generate_all(llm, 2, 16) == [16, 16]
        assert not slow.up and slow.reason == "hung" and slow.timeouts >= 1
    finally:
        gate.unlink()
    assert probe_until(mesh, lambda: slow.up), slow.reason


def test_a_peer_over_the_rtt_cap_leaves_the_rotation(llm):
    import ray

    # A timeout no call outlasts on a loaded machine: only the round trip decides.
    vllm_specexpert.reconfigure(
        llm,
        mesh={"peers": 2, **ONLY_FAULTS_LEAVE, "rtt_cap_ms": 50, "probe_interval_s": 0.1},
    )
    mesh = engine().inputs["peer_tier"]
    far = mesh.peers[0]
    # Whatever an earlier test left out of rotation comes back first (probe round trips
    # are 0 s on probe_until's clock), so leaving below is this test's doing.
    assert probe_until(mesh, lambda: all(p.up for p in mesh.peers)), far.reason
    ray.get(far.actor.set_delay.remote(0.1))  # answers 100 ms late, within timeout_ms
    try:
        assert wait_for(lambda: generate_all(llm, 1, 8) and not far.up, 60)
        assert far.reason == "rtt" and far.timeouts == 0
        vllm_specexpert.reset_stats(llm)
        generate_all(llm, 2, 16)
        stats = vllm_specexpert.get_stats(llm)[0]
        # Out of rotation, its experts are not sent to it: none of its calls failed,
        # and the misses it would have computed were fetched.
        assert stats["mesh"]["peers"][0]["calls"] == 0
        assert stats["total"]["decode"]["fetched_entries"] > 0
    finally:
        ray.get(far.actor.set_delay.remote(0.0), timeout=30)
    assert probe_until(mesh, lambda: far.up), far.reason


def test_only_the_mode_and_timings_change_at_run_time(llm):
    with pytest.raises(SpecExpertConfigError) as error:
        vllm_specexpert.reconfigure(llm, mesh={"peers": 3})
    assert error.value.field_name == "mesh"
    with pytest.raises(SpecExpertConfigError) as error:
        vllm_specexpert.reconfigure(llm, mesh=None)
    assert error.value.field_name == "mesh"


# ------------------------------------------------------------------ without an engine


def test_placement_partitions_the_cold_experts_and_keeps_the_hot_ones_local():
    spec = ShardSpec("unused", {4: ("l4", tuple(range(10)))}, (2, 2), None)
    hosts = placement(spec, 3, 10, {4: np.array([2, 7])})[4]
    assert hosts.sum(axis=1).tolist() == [1, 1, 0, 1, 1, 1, 1, 0, 1, 1]
    assert hosts.sum(axis=0).tolist() == [3, 3, 2]  # spread over the three peers


class AnsweredPings:
    """A peer actor whose pings the test answers, as Ray's thread would: ``ping.remote()``
    gives a ref whose ``future()`` completes when the test sets its result."""

    def __init__(self):
        self.answers: list[concurrent.futures.Future] = []

    @property
    def ping(self):
        return self

    def remote(self):
        answer = concurrent.futures.Future()
        self.answers.append(answer)
        return SimpleNamespace(future=lambda: answer)


def test_a_round_trip_is_timed_when_the_answer_arrives_not_when_it_is_read():
    # Probes are read at layer calls; here each answer arrives 10 ms after its probe
    # was sent and is read 200 ms later (an idle engine). Counted to the read, the
    # peer would be over the 80 ms cap.
    clock, mesh = ManualClock(), MeshConfig(peers=1, probe_interval_s=0.05)
    actor = AnsweredPings()
    peer = PeerState(rank=0, actor=actor, node="node", pid=42)
    prober = Prober([peer], {0: []})
    for _ in range(3):
        prober.probe(mesh, clock)  # reads the answers in, sends the next probe
        clock.advance(0.01)
        actor.answers[-1].set_result(42)  # (the peer's process id: not restarted)
        clock.advance(0.2)
    prober.probe(mesh, clock)
    assert len(actor.answers) == 4  # one probe a read, each answered before the next
    assert list(peer.rtts) == pytest.approx([0.01] * 3)
    assert peer.up, peer.reason


def test_a_probe_answer_is_done_only_once_its_arrival_time_is_set():
    # Ray completes its future, then runs the callbacks: a reader that saw it done
    # before the callback set the time read no arrived_at. The clock, called by that
    # callback, looks at the answer the reader would see.
    ray_future: concurrent.futures.Future = concurrent.futures.Future()
    seen: list[bool] = []
    answer = None

    def clock() -> float:
        seen.append(answer.done())
        return 1.5

    answer = timed(SimpleNamespace(future=lambda: ray_future), clock)
    ray_future.set_result(42)
    assert seen == [False]
    assert answer.done() and answer.arrived_at == 1.5 and answer.result() == 42
    failing: concurrent.futures.Future = concurrent.futures.Future()
    failed = timed(SimpleNamespace(future=lambda: failing), lambda: 2.0)
    failing.set_exception(RuntimeError("peer died"))
    assert isinstance(failed.exception(), RuntimeError) and failed.arrived_at == 2.0


def test_a_checkpoint_a_peer_cannot_read_is_refused_at_start(tmp_path):
    from safetensors.torch import save_file

    save_file(
        {"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 8, 16)},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(SpecExpertConfigError) as error:
        check_checkpoint(str(tmp_path), {0: ("model.layers.0.mlp.experts", (0, 1))})
    assert error.value.field_name == "mesh" and "per expert" in str(error.value)
    with pytest.raises(SpecExpertConfigError) as error:
        check_checkpoint(str(tmp_path / "missing"), {0: ("x", (0,))})
    assert error.value.field_name == "mesh"


def test_without_ray_the_error_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(SpecExpertConfigError) as error:
        ray_cluster.require_ray()
    assert error.value.field_name == "mesh" and "[mesh]" in str(error.value)


class FakePeers:
    """A peer tier in this process: holds experts 8-15 of the toy layer and computes
    them with the reference, or fails every call (a dead peer)."""

    mesh, peers = MeshConfig(peers=1), []

    def __init__(self, tensors, fail: bool):
        self.tensors, self.fail = tensors, fail

    def hosted(self, layer):
        return np.arange(16) >= 8

    def send(self, layer, x, tokens, experts):
        sent = calls.Sent(tokens, experts, [])
        sent.x = x
        return sent

    def receive(self, sent):
        from vllm_specexpert.tiers.host import torch_experts

        ones = torch.ones(len(sent.tokens), 1)
        ids = torch.from_numpy(sent.experts)[:, None]
        y = torch_experts(sent.x[torch.from_numpy(sent.tokens)], ones, ids, self.tensors)
        return y.float(), np.full(len(sent.tokens), not self.fail)

    def stats(self):
        return {}

    def reset_stats(self):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("fail", [False, True], ids=["peers answer", "peers dead"])
def test_peer_entries_are_added_with_their_weights_or_computed_here(toy_engines, fail):
    from moe_reference import reference_moe, slot_kernel
    from test_miss_policies import (
        IDS,
        NAME,
        TENSORS,
        W2,
        W13,
        assert_equivalent,
        routing,
    )

    engine = toy_engines({"budget": 0.5, "mesh": {"peers": 1}}, {NAME: TENSORS}, 4, start=False)
    engine.provide(peer_tier=FakePeers(TENSORS, fail))
    engine.start()
    x, w, ids = routing(IDS)
    out = engine.run_call(LayerCall(NAME, slot_kernel, x, w, ids))
    assert_equivalent(out, reference_moe(x, w, ids, W13, W2))
    stats = engine.stats()["layers"][NAME]["decode"]
    assert stats["peer_entries"] == stats["missed_entries"] == 7  # experts 9-15
    assert stats["peer_fallback_entries"] == (7 if fail else 0)
    assert stats["loads"] == (7 if fail else 0)  # computed here: loaded on demand


def test_an_unreachable_ray_address_is_one_error_naming_it():
    import socket

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(SpecExpertConfigError) as error:  # at once, not after Ray's retries
        ray_cluster.check_reachable(f"127.0.0.1:{port}")
    assert error.value.field_name == "mesh.ray_address"


def test_more_pinned_experts_than_the_budget_leaves_is_refused(toy_engines):
    from test_miss_policies import NAME, TENSORS

    engine = toy_engines(
        {"budget": 0.5, "mesh": {"peers": 1}}, {NAME: TENSORS}, 4, start=False
    )  # 8 of 16 slots
    with pytest.raises(SpecExpertConfigError) as error:
        engine.provide(
            peer_tier=FakePeers(TENSORS, False), hot_experts={0: np.arange(5)}
        )  # 5 > 8 - 4
    assert error.value.field_name == "mesh.hot_count"
    engine.provide(peer_tier=FakePeers(TENSORS, False), hot_experts={0: np.array([9, 12, 15, 3])})
    cache = engine.layers[NAME].cache
    assert cache.resident_mask()[[9, 12, 15, 3]].all()
    assert cache.policy.pinned[[9, 12, 15, 3]].all() and cache.policy.pinned.sum() == 4


# ------------------------------------------------------- peers started without an engine


def shard_spec(isa: str | None, activation: str = "silu") -> ShardSpec:
    """Every MoE layer of the trained model, in its slots' layout (I = 64 needs no
    padding for vLLM's CPU kernels)."""
    config = json.loads((model_path(TRAINED_MODEL) / "config.json").read_text())
    experts, inter = config["num_local_experts"], config["moe_intermediate_size"]
    layers = {
        i: (f"model.layers.{i}.mlp.experts", tuple(range(experts)))
        for i in range(config["num_hidden_layers"])
    }
    return ShardSpec(
        str(model_path(TRAINED_MODEL)), layers, (2 * inter, config["hidden_size"]), isa, activation
    )


def checkpoint_reference(spec: ShardSpec, layer_offset: int = 0):
    """The pairs in fp32 from the checkpoint's tensors (of the layer ``layer_offset``
    further on: another model's experts of the same shape)."""
    from safetensors import safe_open

    from vllm_specexpert.peers.shard import checkpoint_key_index, expert_keys

    index = checkpoint_key_index(spec.checkpoint)
    layers = sorted(spec.layers)

    def reference(layer, x, experts):
        name = spec.layers[layers[(layers.index(layer) + layer_offset) % len(layers)]][0]
        out = []
        for row, expert in zip(x.float(), experts.tolist(), strict=True):
            keys = expert_keys(index, name, expert)
            gate, up, down = (safe_open(index[k], "pt").get_tensor(k).float() for k in keys)
            out.append(down @ (torch.nn.functional.silu(gate @ row) * (up @ row)))
        return torch.stack(out)

    return reference


# Slow: the peers' start check runs in the default run's engine
# (test_exact_modes_run_the_routers_experts_on_the_peers).
@pytest.mark.slow
def test_a_peer_computes_with_the_kernel_its_process_can_run():
    # The engine on a CPU with AMX asks its peers for the AMX kernel. A peer's process
    # must request AMX state first (else its first AMX instruction is a SIGILL), and
    # where there is no AMX (this may be such a machine) runs the portable kernel.
    spec = shard_spec("amx")
    tier = PeerTier(MeshConfig(peers=2), spec, 64, checkpoint_reference(spec))
    try:
        assert [p.isa for p in tier.peers] == [KERNEL_ISA] * 2
        # The start check ran every layer's pairs on each peer, against fp32.
        assert all(len(tier.checks[p.rank]) == 8 for p in tier.peers)
        x = torch.randn(3, 256).to(torch.bfloat16)
        sent = tier.send(2, x, np.array([0, 1, 2, 2]), np.array([0, 1, 2, 3]))
        y, done = tier.receive(sent)
        assert done.all() and all(p.up for p in tier.peers)
        expected = checkpoint_reference(spec)(2, x[[0, 1, 2, 2]], np.array([0, 1, 2, 3]))
        assert torch.allclose(y, expected, rtol=0.03, atol=0.03 * expected.abs().max())
        print(f"mesh peers computed with vLLM's CPU kernel '{KERNEL_ISA}'")
    finally:
        tier.close()


@pytest.mark.slow  # (Ray peers of their own: 11 s)
def test_a_peer_that_answers_otherwise_than_this_host_is_refused_at_start():
    spec = shard_spec(KERNEL_ISA)
    with pytest.raises(SpecExpertConfigError) as error:  # another model's experts here
        PeerTier(MeshConfig(peers=1), spec, 64, checkpoint_reference(spec, layer_offset=1))
    assert error.value.field_name == "mesh"
    assert "peer 0" in str(error.value) and "differ from this host's" in str(error.value)


@pytest.mark.slow  # (Ray peers of their own: 16 s)
def test_a_peer_that_cannot_compute_is_refused_at_start_with_its_reason():
    spec = shard_spec(KERNEL_ISA, activation="relu2")  # vLLM's CPU kernel has no relu2
    with pytest.raises(SpecExpertConfigError) as error:
        PeerTier(MeshConfig(peers=1), spec, 64, checkpoint_reference(spec))
    assert error.value.field_name == "mesh" and "failed its check" in str(error.value)
    assert "relu2" in str(error.value)
