"""What an expert costs to compute on this CPU, in bf16 with vLLM's fused-MoE kernel and in
INT4 with vLLM's W4A16 GEMM (``cpu_gemm_wna16``, read packed: no bf16 copy), at the
expert shapes of the disk benchmark's models: whether a draft of INT4 experts can be
cheaper than the target it drafts for (issue 56's draft beside a model bigger than RAM).

    python benchmarks/int4_kernel.py [--hidden 256] [--intermediate 40192 6784]
        [--tokens 1 4 32] [--repeats 20] [--name int4_kernel]

Per shape and token count: the median seconds of one expert's whole computation (gate
and up projection, SiLU and multiply, down projection) each way, and their ratio. Per
shape: what the ``lookahead`` draft pays to decode an INT4 expert (its format, ``lowbit``'s)
into a bf16 slot, the dequantize and the CPU kernel's prepack apart. Weights
are random (a kernel's time does not depend on the values); INT4 in groups of 128 with a
bias of 8 (``uint4b8``: no zero points), bf16 scales. Nothing here is modeled: real
kernels, timed with ``perf_counter``. Writes ``benchmarks/results/<name>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, write_result

GROUP = 128
PACK = 8  # int4 values per int32


def int4_weight(k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``[k -> n]`` INT4 weights in ``cpu_gemm_wna16``'s layout (blocks of 16
    output channels, each block's rows contiguous) and their bf16 group scales."""
    packed = torch.randint(-(2**31), 2**31 - 1, (n // 16, k * 16 // PACK), dtype=torch.int32)
    scales = (torch.rand(k // GROUP, n) * 0.01).to(torch.bfloat16)
    return packed, scales


def time_median(fn, repeats: int) -> float:
    fn()  # (first call: allocation, caches)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(hidden: int, inter: int, tokens: int, repeats: int, isa: str) -> dict:
    from vllm import _custom_ops as ops

    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    w13 = (torch.randn(1, 2 * inter, hidden) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(1, hidden, inter) * 0.02).to(torch.bfloat16)
    w13p = ops.cpu_prepack_moe_weight(w13, isa)
    w2p = ops.cpu_prepack_moe_weight(w2, isa)
    weights = torch.ones(tokens, 1, dtype=torch.float32)
    ids = torch.zeros(tokens, 1, dtype=torch.int32)
    out = torch.empty_like(x)

    def bf16() -> None:
        ops.cpu_fused_moe(out, x, w13p, w2p, None, None, weights, ids, "silu", isa)

    q13, s13 = int4_weight(hidden, 2 * inter)
    q2, s2 = int4_weight(inter, hidden)
    hint = "amx" if isa == "amx" else "vec"

    def int4() -> None:
        gate_up = ops.cpu_gemm_wna16(x, q13, s13, None, None, PACK, hint)
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        ops.cpu_gemm_wna16(act, q2, s2, None, None, PACK, hint)

    bf16_s, int4_s = time_median(bf16, repeats), time_median(int4, repeats)
    return {
        "hidden": hidden,
        "intermediate": inter,
        "tokens": tokens,
        "bf16_bytes": 3 * hidden * inter * 2,
        "int4_bytes": 3 * hidden * inter // 2 + 3 * hidden * inter // GROUP * 2,
        "bf16_s": bf16_s,
        "int4_s": int4_s,
        "int4_over_bf16": int4_s / bf16_s,
    }


def measure_decode(hidden: int, inter: int, repeats: int, isa: str) -> dict:
    """The draft's decode of one expert: ``lowbit``'s INT4 dequantized to bf16, then
    prepacked for the CPU kernel (its runtime form, vLLM's unquantized method's)."""
    from vllm import _custom_ops as ops

    from vllm_specexpert.layers.packed_experts import low_bit_parameters

    parameters = low_bit_parameters("expert", 1, hidden, inter)
    weights = {
        "w13_weight": (torch.randn(1, 2 * inter, hidden) * 0.02).to(torch.bfloat16),
        "w2_weight": (torch.randn(1, hidden, inter) * 0.02).to(torch.bfloat16),
    }
    packed = parameters.quantize(weights)
    decoded = parameters.dequantize(packed)

    def prepack() -> None:
        for tensor in decoded.values():
            ops.cpu_prepack_moe_weight(tensor.to(torch.bfloat16), isa)

    return {
        "hidden": hidden,
        "intermediate": inter,
        "dequantize_s": time_median(lambda: parameters.dequantize(packed), repeats),
        "prepack_s": time_median(prepack, repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, nargs="+", default=[40192, 6784])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--name", default="int4_kernel")
    args = parser.parse_args()
    isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
    rows = []
    for inter in args.intermediate:
        for tokens in args.tokens:
            row = measure(args.hidden, inter, tokens, args.repeats, isa)
            rows.append(row)
            print(
                f"H {args.hidden} I {inter} T {tokens:3d}: bf16 {1e3 * row['bf16_s']:8.3f} ms, "
                f"int4 {1e3 * row['int4_s']:8.3f} ms, int4/bf16 {row['int4_over_bf16']:.2f}",
                flush=True,
            )
    decodes = []
    for inter in args.intermediate:
        row = measure_decode(args.hidden, inter, args.repeats, isa)
        decodes.append(row)
        print(
            f"H {args.hidden} I {inter}: the draft's decode of an expert: dequantize "
            f"{1e3 * row['dequantize_s']:8.3f} ms, prepack {1e3 * row['prepack_s']:8.3f} ms",
            flush=True,
        )
    payload = {
        "real": True,
        "modeled": None,
        "isa": isa,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "rows": rows,
        "decodes": decodes,
    }
    out = write_result(args.name, payload)
    print(f"wrote {out}\ncommand: {command_line()}")


if __name__ == "__main__":
    main()
