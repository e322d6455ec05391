"""Experts on Ray peers across a real network delay: TPOT against RTT per mesh mode.

A Ray cluster on this machine (``tools/mesh_cluster``): the head in the root network
namespace, two peer nodes in namespaces of their own, each behind a user-space forwarder
that delays every packet by RTT/2 each way, so the round trips are real on the wire
(this kernel has no netem). The engine runs at ``--budget`` with its misses computed by
the peers; the local baseline fetches them over the emulated link (MODELED: one expert
copy = ``--copy-compute-ratio`` x one layer's batch-1 decode compute, measured on vanilla
first). Per RTT, per mode (``sync``, ``early_fire``, ``no_stop``, ``replicate_hot`` with
sync), per batch: decode seconds per step and prefill seconds, side by side with local
``fetch`` as ratios; the break-even RTT of each mode; Early Fire's hit rate per layer;
teacher-forced top-1 agreement with the all-resident reference (vanilla bit for bit) on
held-out text. Then :func:`simulate` fits a per-layer model to these runs and extends
it to 8-64 peers (see its doc).

    python benchmarks/mesh.py   (root: network namespaces; about 20 minutes)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics

import numpy as np
from common import (
    add_engine_arguments,
    command_line,
    default_calibration,
    held_out_prompts,
    held_out_windows,
    model_of,
    step_seconds,
    teacher_forced,
    timed_generate,
    write_result,
)

MODES = ("sync", "early_fire", "no_stop")


def measure(llm, prompts_by_batch: dict[int, list[str]], tokens: int, repeats: int) -> dict:
    """Decode seconds per step and prefill seconds per batch size, with the mesh counters
    of the decode-only run."""
    import vllm_specexpert

    out = {}
    for batch, prompts in prompts_by_batch.items():
        timed_generate(llm, prompts, 4)  # warm: connections, caches
        vllm_specexpert.reset_stats(llm)
        decode, first = step_seconds(llm, prompts, tokens, repeats)
        stats = vllm_specexpert.get_stats(llm)[0]
        d = stats["total"]["decode"]
        out[batch] = {"decode_s": decode, "prefill_s": first,
                      "peer_entries_per_token": d["peer_entries"] / max(stats["decode_tokens"], 1),
                      "fallback_entries": d["peer_fallback_entries"],
                      "fired": d["fired_entries"], "fired_used": d["fired_used"],
                      "peer_calls_per_layer_call": (
                          sum(p["calls"] for p in stats["mesh"]["peers"]) / max(d["calls"], 1)
                          if stats["mesh"] else 0.0),
                      "peers_up": [p["up"] for p in (stats["mesh"] or {"peers": []})["peers"]],
                      "fired_by_layer": {
                          str(stats["layer_index"][name]): [s["decode"]["fired_used"],
                                                            s["decode"]["fired_entries"]]
                          for name, s in stats["layers"].items()}}
        print(f"  batch {batch}: decode {decode * 1e3:.2f} ms/step, prefill "
              f"{first * 1e3:.1f} ms, {out[batch]['peer_entries_per_token']:.1f} peer "
              f"entries/token", flush=True)
    return out


def break_even(rtts: list[float], mesh_s: list[float], local_s: float) -> float | None:
    """The RTT (ms) at which the mode's decode step equals local fetch's (interpolated in
    log RTT); ``None`` when it is slower at every RTT, ``inf`` when faster at every RTT."""
    if mesh_s[0] >= local_s:
        return None
    for (r0, s0), (r1, s1) in zip(zip(rtts, mesh_s), zip(rtts[1:], mesh_s[1:])):
        if s0 < local_s <= s1:
            f = (local_s - s0) / (s1 - s0)
            return float(math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0))))
    return math.inf


def simulate(runs: dict, rtts: list[float], layers: int, peers_range: list[int]) -> dict:
    """A per-layer model fitted to the measured runs, then extended to more peers.

    One decode step = ``T0_b + L * (RTT + c * n_b(P))`` for the exact modes, where ``L``
    is the MoE layers, ``n_b(P)`` the peer calls per layer call at batch ``b`` (``P``
    peers, the missed experts dealt among them: ``P * (1 - (1 - 1/P)^m)`` for ``m``
    distinct missed experts per layer call, ``m`` measured), ``c`` the engine's own
    time per peer call (serialising, sending, receiving: on the engine's critical path)
    and ``T0_b`` the rest of the step. ``no_stop`` fires at layer l for layer l+1, so
    the round trip overlaps up to ``w`` of local work per layer:
    ``T0_b + L * max(RTT + c * n_b - w, c * n_b)``. ``T0_b``, ``c`` are fitted by least
    squares on ``sync``, ``w`` on ``no_stop``. The Early Fire saving is then
    ``L * min(RTT, w)`` per step, whatever ``P``: the overlap is bounded by the local
    work between the fire and the use, not by the network. A GPU row replaces ``w`` and
    ``T0`` by a modeled GPU box's (MODELED, constants in the result)."""
    fits = {}
    for batch in runs["sync"][str(rtts[0])]:
        sync = [runs["sync"][str(r)][batch] for r in rtts]
        n = statistics.mean(s["peer_calls_per_layer_call"] for s in sync)
        y = np.array([s["decode_s"] for s in sync])
        x = np.stack([np.ones(len(rtts)), np.array(rtts) / 1e3 * layers], axis=1)
        (t0, slope), *_ = np.linalg.lstsq(x, y, rcond=None)
        # slope ~ 1 (the RTT is paid once per layer); the intercept holds L * c * n.
        c = max(0.0, (t0 - runs["local_overhead_s"][batch]) / (layers * max(n, 1e-9)))
        no_stop = np.array([runs["no_stop"][str(r)][batch]["decode_s"] for r in rtts])
        hidden = (y - no_stop) / layers  # seconds hidden per layer at each RTT
        w = float(max(0.0, np.median(np.minimum(hidden, np.array(rtts) / 1e3))))
        missed = statistics.mean(s["peer_entries_per_token"] for s in sync) / layers
        fits[batch] = {"t0_s": float(t0), "rtt_slope": float(slope), "call_s": c,
                       "calls_per_layer": n, "overlap_w_s": w,
                       "missed_entries_per_layer": missed}
    extended = {}
    for batch, fit in fits.items():
        m = max(fit["missed_entries_per_layer"], 1.0)
        rows = []
        for peers in peers_range:
            calls = peers * (1 - (1 - 1 / peers) ** m)
            for rtt in rtts:
                base = fit["t0_s"] - layers * fit["call_s"] * fit["calls_per_layer"]
                sync = base + layers * (rtt / 1e3 + fit["call_s"] * calls)
                saved = layers * min(rtt / 1e3, fit["overlap_w_s"])
                rows.append({"peers": peers, "rtt_ms": rtt, "calls_per_layer": calls,
                             "sync_s": sync, "no_stop_s": sync - saved,
                             "hidden_share": saved / sync})
        extended[batch] = rows
    gpu = []  # MODELED: Qwen3-30B-A3B-like, 48 MoE layers, 0.14 ms of GPU work per layer
    gpu_layers, gpu_layer_s = 48, 0.14e-3
    for rtt in rtts:
        sync = gpu_layers * (gpu_layer_s + rtt / 1e3)
        gpu.append({"rtt_ms": rtt, "sync_s": sync,
                    "hidden_share": gpu_layers * min(rtt / 1e3, gpu_layer_s) / sync})
    return {"fits": fits, "extended": extended,
            "gpu_box": {"modeled": {"moe_layers": gpu_layers, "layer_compute_s": gpu_layer_s,
                                    "note": "per-layer batch-1 decode compute of an RTX "
                                            "4090-class GPU on Qwen3-30B-A3B: an estimate"},
                        "rows": gpu}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_arguments(parser, "mesh")
    parser.add_argument("--rtts", type=float, nargs="+", default=[0.1, 1, 5, 20, 80])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--hot-count", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--windows", type=int, default=8)
    args = parser.parse_args()

    from vllm_specexpert.tools.mesh_cluster import MeshCluster

    model = model_of(args)
    calibration = args.calibration or default_calibration(model)
    prompts = {b: held_out_prompts(b) for b in args.batches}
    with MeshCluster(peers=args.peers, rtt_ms=args.rtts[0]) as cluster:
        os.environ.update(cluster.env)  # before Ray is imported anywhere
        result = run(args, cluster, model, calibration, prompts)
    path = write_result(args.name, result)
    plot(result, args)
    print(f"wrote {path} and {args.name}.png\ncommand: {command_line()}")


def run(args, cluster, model: str, calibration: str, prompts: dict) -> dict:
    import vllm_specexpert
    from vllm_specexpert.tools.harness import start_engine, stop_engine
    from vllm_specexpert.tools.teacher_forcing import TeacherForcing

    eager = args.eager
    vanilla = start_engine(model, None, eager=eager)
    timed_generate(vanilla, prompts[1], 8)
    vanilla_step, _ = step_seconds(vanilla, prompts[1], 48, 2)
    stop_engine(vanilla)

    base = {"budget": args.budget}
    probe = start_engine(model, base, eager=eager)
    info = vllm_specexpert.get_stats(probe)[0]
    layers = len(info["layers"])
    expert_bytes = next(iter(info["expert_bytes"].values()))
    copy_s = args.copy_compute_ratio * vanilla_step / layers
    link = {"bandwidth_gbps": expert_bytes / copy_s / 1e9, "latency_us": args.latency_us}
    vllm_specexpert.reconfigure(probe, link=link)
    print(f"local fetch (MODELED link {copy_s * 1e6:.0f} us per expert):", flush=True)
    local = measure(probe, prompts, args.tokens, args.repeats)
    overhead = {}
    vllm_specexpert.reconfigure(probe, budget=1.0, link={})
    for batch, batch_prompts in prompts.items():  # the step without any miss
        overhead[batch], _ = step_seconds(probe, batch_prompts, args.tokens, args.repeats)
    stop_engine(probe)

    mesh = {"ray_address": cluster.address, "peers": args.peers, "rtt_cap_ms": 10_000}
    runs: dict = {mode: {} for mode in (*MODES, "replicate_hot")}
    wire = {}
    llm = start_engine(model, {**base, "link": link, "predictor": "quasi_hidden",
                               "calibration": calibration, "mesh": mesh},
                       eager=eager, logits_processors=[TeacherForcing])
    for rtt in args.rtts:
        cluster.set_rtt(rtt)
        wire[str(rtt)] = cluster.measure_rtt()
        for mode in MODES:
            print(f"RTT {rtt} ms (measured {wire[str(rtt)]}), {mode}:", flush=True)
            vllm_specexpert.reconfigure(llm, mesh={**mesh, "mode": mode})
            runs[mode][str(rtt)] = measure(llm, prompts, args.tokens, args.repeats)
    cluster.set_rtt(args.rtts[0])
    accuracy = teacher_forced_accuracy(llm, mesh, args.windows)
    stop_engine(llm)

    llm = start_engine(model, {**base, "link": link, "calibration": calibration,
                               "mesh": {**mesh, "placement": "replicate_hot",
                                        "hot_count": args.hot_count}}, eager=eager)
    for rtt in args.rtts:
        cluster.set_rtt(rtt)
        print(f"RTT {rtt} ms, replicate_hot:", flush=True)
        runs["replicate_hot"][str(rtt)] = measure(llm, prompts, args.tokens, args.repeats)
    stop_engine(llm)

    table = {}
    for batch in args.batches:
        for mode in runs:
            times = [runs[mode][str(r)][batch]["decode_s"] for r in args.rtts]
            table[f"{mode}@{batch}"] = {
                "decode_ratio_to_local": [t / local[batch]["decode_s"] for t in times],
                "break_even_rtt_ms": break_even(args.rtts, times, local[batch]["decode_s"])}
    runs["local_overhead_s"] = {b: overhead[b] for b in args.batches}
    sim = simulate({**runs}, args.rtts, layers, [2, 8, 16, 32, 64])
    return {"modeled": {"local_link_us_per_expert": copy_s * 1e6,
                        "copy_compute_ratio": args.copy_compute_ratio,
                        "note": "local fetch runs over the emulated link; the mesh's round "
                                "trips are real (network namespaces + delay forwarder)"},
            "budget": args.budget, "peers": args.peers, "layers": layers,
            "vanilla_step_s": vanilla_step, "rtts_ms": args.rtts, "measured_rtt_ms": wire,
            "batches": args.batches, "local": local, "all_resident_step_s": overhead,
            "runs": runs, "table": table, "accuracy": accuracy, "simulation": sim}


def teacher_forced_accuracy(llm, mesh: dict, windows: int) -> dict:
    """Top-1 agreement and mean log-likelihood per mode, teacher-forced at batch 1 on
    held-out windows, against the all-resident reference (vanilla bit for bit)."""
    import vllm_specexpert

    texts = held_out_windows(windows, 64)
    budget = vllm_specexpert.get_stats(llm)[0]["config"]["budget"]
    vllm_specexpert.reconfigure(llm, budget=1.0)
    reference = teacher_forced(llm, texts, 16)
    vllm_specexpert.reconfigure(llm, budget=budget)
    out = {"positions": len(reference["top1"]),
           "reference_logprob": float(np.mean(reference["logprobs"]))}
    for mode in MODES:
        vllm_specexpert.reconfigure(llm, mesh={**mesh, "mode": mode})
        got = teacher_forced(llm, texts, 16)
        out[mode] = {"top1_agreement": float(np.mean(np.equal(got["top1"], reference["top1"]))),
                     "mean_logprob": float(np.mean(got["logprobs"]))}
        print(f"  {mode}: top-1 agreement {out[mode]['top1_agreement']:.4f}", flush=True)
    return out


def plot(result: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rtts = result["rtts_ms"]
    fig, axes = plt.subplots(1, len(result["batches"]) + 1, figsize=(5 * (len(result["batches"]) + 1), 4))
    for ax, batch in zip(axes, result["batches"]):
        local = result["local"][str(batch)]["decode_s"] if str(batch) in result["local"] \
            else result["local"][batch]["decode_s"]
        for mode, runs in result["runs"].items():
            if mode == "local_overhead_s":
                continue
            ys = [(runs[str(r)].get(batch) or runs[str(r)][str(batch)])["decode_s"] * 1e3
                  for r in rtts]
            ax.plot(rtts, ys, marker="o", label=mode)
        ax.axhline(local * 1e3, color="k", ls="--", label="local fetch (MODELED link)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("round trip (ms, real on the wire)")
        ax.set_ylabel("decode ms per step")
        ax.set_title(f"batch {batch}, budget {result['budget']}, {result['peers']} peers")
        ax.legend(fontsize=7)
    ax = axes[-1]
    for batch, rows in result["simulation"]["extended"].items():
        for peers in sorted({r["peers"] for r in rows}):
            pts = [r for r in rows if r["peers"] == peers]
            ax.plot([r["rtt_ms"] for r in pts], [100 * r["hidden_share"] for r in pts],
                    marker=".", label=f"batch {batch}, {peers} peers")
    gpu = result["simulation"]["gpu_box"]["rows"]
    ax.plot([r["rtt_ms"] for r in gpu], [100 * r["hidden_share"] for r in gpu], "k--",
            label="GPU box (MODELED)")
    ax.set_xscale("log")
    ax.set_xlabel("round trip (ms)")
    ax.set_ylabel("TPOT hidden by Early Fire (%)")
    ax.set_title("simulated from the fit (no_stop overlap)")
    ax.legend(fontsize=6)
    fig.suptitle("mesh: peers behind a real delay; local fetch over a MODELED link", fontsize=9)
    fig.tight_layout()
    fig.savefig(f"{os.path.dirname(__file__)}/results/{args.name}.png", dpi=110)


if __name__ == "__main__":
    main()
