"""Experts on Ray peers across a real network delay: TPOT against RTT per mesh mode.

A Ray cluster on this machine (``vllm_specexpert/tools/mesh_cluster.py``): the head in the root
network namespace, two peer nodes in namespaces of their own, each behind a user-space
forwarder that delays every packet by RTT/2 each way, so the round trips are real on the
wire (this kernel has no netem). The engine runs at ``--budget`` with its misses computed by
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
import json
import math
import os
import statistics
from itertools import pairwise

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
PEERS_SIMULATED = [2, 8, 16, 32, 64]


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
        out[batch] = {
            "decode_s": decode,
            "prefill_s": first,
            "peer_entries_per_token": d["peer_entries"] / max(stats["decode_tokens"], 1),
            "fallback_entries": d["peer_fallback_entries"],
            "fired": d["fired_entries"],
            "fired_used": d["fired_used"],
            "peer_calls_per_layer_call": (
                sum(p["calls"] for p in stats["mesh"]["peers"]) / max(d["calls"], 1)
                if stats.get("mesh")
                else 0.0
            ),
            "peers_up": [p["up"] for p in stats.get("mesh", {"peers": []})["peers"]],
            "fired_by_layer": {
                str(stats["layer_index"][name]): [
                    s["decode"]["fired_used"],
                    s["decode"]["fired_entries"],
                ]
                for name, s in stats["layers"].items()
            },
        }
        print(
            f"  batch {batch}: decode {decode * 1e3:.2f} ms/step, prefill "
            f"{first * 1e3:.1f} ms, {out[batch]['peer_entries_per_token']:.1f} peer "
            f"entries/token",
            flush=True,
        )
    return out


def break_even(rtts: list[float], mesh_s: list[float], local_s: float) -> float | None:
    """The RTT (ms) at which the mode's decode step equals local fetch's (interpolated in
    log RTT); ``None`` when it is slower at every RTT, ``inf`` when faster at every RTT."""
    if mesh_s[0] >= local_s:
        return None
    for (r0, s0), (r1, s1) in pairwise(zip(rtts, mesh_s, strict=True)):
        if s0 < local_s <= s1:
            f = (local_s - s0) / (s1 - s0)
            return float(math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0))))
    return math.inf


def simulate(runs: dict, rtts: list[float], layers: int, peers_range: list[int]) -> dict:
    """A per-layer model of a decode step, fitted to the measured runs, checked against
    the ``no_stop`` runs it was not fitted to, then extended to more peers.

    Per MoE layer the engine's thread is busy ``B = a + c * n`` (``a``: its local work,
    the all-resident step divided by the layers; ``c``: its own time per peer call,
    serialising and receiving; ``n``: peer calls per layer call) and waits for the
    network. ``sync`` and ``early_fire`` wait a whole round trip each layer:
    ``D = B + RTT``. ``no_stop`` sends layer l+1's rows when layer l starts, before it
    waits for layer l's own answers, so two layers' requests are in flight:
    ``D_{l+1} = max(B, RTT + c - D_l)``, in steady state ``D = max(B, (RTT + c) / 2)``;
    its first MoE layer has no prediction and runs as ``sync``. A step is
    ``L * D``; ``c`` is the mean over the ``sync`` runs of each batch size of what a step
    takes beyond ``L * (a + RTT)``, per call. More peers: the missed entries of a layer call
    (``m``, measured) dealt among ``P`` peers need ``n = P * (1 - (1 - 1/P)^m)`` calls.
    A GPU row replaces this machine's constants by a modeled GPU box's (MODELED,
    constants in the result)."""
    runs = json.loads(json.dumps(runs))  # batch keys as strings, as in the result file
    fits, checks = {}, {}
    for batch in runs["sync"][str(rtts[0])]:
        sync = [runs["sync"][str(r)][batch] for r in rtts]
        n = statistics.mean(s["peer_calls_per_layer_call"] for s in sync)
        a = runs["local_overhead_s"][batch] / layers
        # What a sync step takes beyond L * (a + RTT), put on the peer calls.
        y = np.array([s["decode_s"] for s in sync]) - layers * (a + np.array(rtts) / 1e3)
        c, r = max(float(np.mean(y)), 0.0) / (layers * n), 0.0
        m = statistics.mean(s["peer_entries_per_token"] for s in sync) * int(batch) / layers
        fits[batch] = {
            "local_per_layer_s": a,
            "call_s": float(c),
            "rest_s": float(r),
            "calls_per_layer": n,
            "missed_entries_per_layer_call": m,
        }
        measured = [runs["no_stop"][str(rtt)][batch]["decode_s"] for rtt in rtts]
        modeled = [step(fits[batch], layers, rtt / 1e3, n, "no_stop") for rtt in rtts]
        checks[batch] = {
            "no_stop_measured_s": measured,
            "no_stop_model_s": modeled,
            "sync_model_s": [step(fits[batch], layers, rtt / 1e3, n, "sync") for rtt in rtts],
        }
    extended = {}
    for batch, fit in fits.items():
        m = max(fit["missed_entries_per_layer_call"], 1.0)
        rows = []
        for peers in peers_range:
            calls = peers * (1 - (1 - 1 / peers) ** m)
            for rtt in rtts:
                sync = step(fit, layers, rtt / 1e3, calls, "sync")
                no_stop = step(fit, layers, rtt / 1e3, calls, "no_stop")
                rows.append(
                    {
                        "peers": peers,
                        "rtt_ms": rtt,
                        "calls_per_layer": calls,
                        "sync_s": sync,
                        "no_stop_s": no_stop,
                        "hidden_share": 1 - no_stop / sync,
                    }
                )
        extended[batch] = rows
    # MODELED: Qwen3-30B-A3B-like: 48 MoE layers, 0.14 ms of GPU work per layer at
    # batch 1, 0.05 ms of engine time per peer call, 4 peer calls per layer.
    gpu_fit = {"local_per_layer_s": 0.14e-3, "call_s": 0.05e-3, "rest_s": 0.0}
    gpu = [
        {
            "rtt_ms": rtt,
            "sync_s": step(gpu_fit, 48, rtt / 1e3, 4, "sync"),
            "no_stop_s": step(gpu_fit, 48, rtt / 1e3, 4, "no_stop"),
        }
        for rtt in rtts
    ]
    for row in gpu:
        row["hidden_share"] = 1 - row["no_stop_s"] / row["sync_s"]
    return {
        "fits": fits,
        "no_stop_check": checks,
        "extended": extended,
        "gpu_box": {
            "modeled": {
                "moe_layers": 48,
                **gpu_fit,
                "calls_per_layer": 4,
                "note": "per-layer batch-1 decode work of an RTX "
                "4090-class GPU on Qwen3-30B-A3B and the "
                "engine's time per call: estimates",
            },
            "rows": gpu,
        },
    }


def step(fit: dict, layers: int, rtt_s: float, calls: float, mode: str) -> float:
    """Seconds of one decode step under :func:`simulate`'s model."""
    busy = fit["local_per_layer_s"] + fit["call_s"] * calls
    sync = busy + rtt_s
    if mode == "sync":
        return layers * sync + fit["rest_s"]
    pipelined = max(busy, (rtt_s + fit["call_s"] * calls) / 2)
    return sync + (layers - 1) * pipelined + fit["rest_s"]


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
    parser.add_argument(
        "--simulate-only",
        action="store_true",
        help="refit the simulator to the result file's runs and redraw",
    )
    parser.add_argument(
        "--accuracy-only",
        action="store_true",
        help="measure only the teacher-forced accuracy (and `cpu`'s on the "
        "same windows) into the result file",
    )
    args = parser.parse_args()
    if args.simulate_only:
        from common import RESULTS

        path = RESULTS / f"{args.name}.json"
        result = json.loads(path.read_text())
        result["simulation"] = simulate(
            result["runs"], result["rtts_ms"], result["layers"], PEERS_SIMULATED
        )
        path.write_text(json.dumps(result, indent=1))
        plot(result, args)
        print(f"refit {path} and {args.name}.png")
        return

    from vllm_specexpert.tools.mesh_cluster import MeshCluster

    model = model_of(args)
    calibration = args.calibration or default_calibration(model)
    prompts = {b: held_out_prompts(b) for b in args.batches}
    with MeshCluster(peers=args.peers, rtt_ms=args.rtts[0]) as cluster:
        os.environ.update(cluster.env)  # before Ray is imported anywhere
        if args.accuracy_only:
            from common import RESULTS

            result = json.loads((RESULTS / f"{args.name}.json").read_text())
            result["accuracy"] = accuracy_run(args, cluster, model, calibration)
            result["accuracy"]["command"] = command_line()
            result.setdefault("command_of_the_runs", result.pop("command"))
        else:
            result = run(args, cluster, model, calibration, prompts)
    path = write_result(args.name, {k: v for k, v in result.items() if k != "machine"})
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
    llm = start_engine(
        model,
        {
            **base,
            "link": link,
            "predictor": "quasi_hidden",
            "calibration": calibration,
            "mesh": mesh,
        },
        eager=eager,
        logits_processors=[TeacherForcing],
    )
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

    llm = start_engine(
        model,
        {
            **base,
            "link": link,
            "calibration": calibration,
            "mesh": {**mesh, "placement": "replicate_hot", "hot_count": args.hot_count},
        },
        eager=eager,
    )
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
                "break_even_rtt_ms": break_even(args.rtts, times, local[batch]["decode_s"]),
            }
    runs["local_overhead_s"] = {b: overhead[b] for b in args.batches}
    sim = simulate(runs, args.rtts, layers, PEERS_SIMULATED)
    return {
        "modeled": {
            "local_link_us_per_expert": copy_s * 1e6,
            "copy_compute_ratio": args.copy_compute_ratio,
            "note": "local fetch runs over the emulated link; the mesh's round "
            "trips are real (network namespaces + delay forwarder)",
        },
        "budget": args.budget,
        "peers": args.peers,
        "layers": layers,
        "vanilla_step_s": vanilla_step,
        "rtts_ms": args.rtts,
        "measured_rtt_ms": wire,
        "batches": args.batches,
        "local": local,
        "all_resident_step_s": overhead,
        "runs": runs,
        "table": table,
        "accuracy": accuracy,
        "simulation": sim,
    }


def accuracy_run(args, cluster, model: str, calibration: str) -> dict:
    """:func:`teacher_forced_accuracy` on an engine of its own, and ``miss_policy: cpu``
    (equivalent, no mesh) on the same windows, for comparison."""
    import vllm_specexpert
    from vllm_specexpert.tools.harness import start_engine, stop_engine
    from vllm_specexpert.tools.teacher_forcing import TeacherForcing

    mesh = {"ray_address": cluster.address, "peers": args.peers, "rtt_cap_ms": 10_000}
    base = {"budget": args.budget, "calibration": calibration}
    llm = start_engine(
        model,
        {**base, "predictor": "quasi_hidden", "mesh": mesh},
        eager=args.eager,
        logits_processors=[TeacherForcing],
    )
    out = teacher_forced_accuracy(llm, mesh, args.windows)
    stop_engine(llm)
    llm = start_engine(
        model, {**base, "miss_policy": "cpu"}, eager=args.eager, logits_processors=[TeacherForcing]
    )
    reference = teacher_forced_reference(llm, args.windows)
    vllm_specexpert.reconfigure(llm, budget=args.budget)
    got = teacher_forced(llm, held_out_windows(args.windows, 64), 16)
    out["cpu"] = {
        "top1_agreement": float(np.mean(np.equal(got["top1"], reference))),
        "mean_logprob": float(np.mean(got["logprobs"])),
    }
    print(f"  cpu: top-1 agreement {out['cpu']['top1_agreement']:.4f}", flush=True)
    stop_engine(llm)
    return out


def teacher_forced_reference(llm, windows: int) -> list[int]:
    """Top-1 of the engine at budget 1.0 (every expert resident: vanilla bit for bit)."""
    import vllm_specexpert

    vllm_specexpert.reconfigure(llm, budget=1.0)
    return teacher_forced(llm, held_out_windows(windows, 64), 16)["top1"]


def teacher_forced_accuracy(llm, mesh: dict, windows: int) -> dict:
    """Top-1 agreement and mean log-likelihood per mode, teacher-forced at batch 1 on
    held-out windows, against the all-resident reference (vanilla bit for bit)."""
    import vllm_specexpert

    texts = held_out_windows(windows, 64)
    budget = vllm_specexpert.get_stats(llm)[0]["config"]["budget"]
    vllm_specexpert.reconfigure(llm, budget=1.0)
    reference = teacher_forced(llm, texts, 16)
    vllm_specexpert.reconfigure(llm, budget=budget)
    out = {
        "positions": len(reference["top1"]),
        "reference_logprob": float(np.mean(reference["logprobs"])),
    }
    for mode in MODES:
        vllm_specexpert.reconfigure(llm, mesh={**mesh, "mode": mode})
        got = teacher_forced(llm, texts, 16)
        out[mode] = {
            "top1_agreement": float(np.mean(np.equal(got["top1"], reference["top1"]))),
            "mean_logprob": float(np.mean(got["logprobs"])),
        }
        print(f"  {mode}: top-1 agreement {out[mode]['top1_agreement']:.4f}", flush=True)
    return out


def plot(result: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rtts = result["rtts_ms"]
    panels = len(result["batches"]) + 1  # a batch each, then the extended simulation
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    for ax, batch in zip(axes[:-1], result["batches"], strict=True):
        local = (
            result["local"][str(batch)]["decode_s"]
            if str(batch) in result["local"]
            else result["local"][batch]["decode_s"]
        )
        for mode, runs in result["runs"].items():
            if mode == "local_overhead_s":
                continue
            ys = [
                (runs[str(r)].get(batch) or runs[str(r)][str(batch)])["decode_s"] * 1e3
                for r in rtts
            ]
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
            ax.plot(
                [r["rtt_ms"] for r in pts],
                [100 * r["hidden_share"] for r in pts],
                marker=".",
                label=f"batch {batch}, {peers} peers",
            )
    gpu = result["simulation"]["gpu_box"]["rows"]
    ax.plot(
        [r["rtt_ms"] for r in gpu],
        [100 * r["hidden_share"] for r in gpu],
        "k--",
        label="GPU box (MODELED)",
    )
    ax.set_xscale("log")
    ax.set_xlabel("round trip (ms)")
    ax.set_ylabel("decode step saved by no_stop vs sync (%)")
    ax.set_title("model fitted to these runs, extended to more peers")
    ax.legend(fontsize=6)
    fig.suptitle("mesh: peers behind a real delay; local fetch over a MODELED link", fontsize=9)
    fig.tight_layout()
    fig.savefig(f"{os.path.dirname(__file__)}/results/{args.name}.png", dpi=110)


if __name__ == "__main__":
    main()
