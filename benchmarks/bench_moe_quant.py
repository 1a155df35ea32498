"""Benchmark a decode step's fused K-quant routed experts (engine.kernels.moe_quant).

Real Kimi-K3 decode geometry by default: one token in the expert latent (d_in 3584), inter
3072, top-16, gate/up Q2_K and down Q3_K as its Q2_K release ships them, SiTU activation,
bf16 x. The tables hold --experts experts (64 by default: 766 MB, far more than the 60 MB
L2) and each timed call routes to a different set of them (a bank of routings), so the bytes
come from device memory. Reported per call: microseconds for the whole MLP (gate/up kernel
+ down kernel, as decode runs them: CUDA graphs of --per-graph calls, replayed), and the
effective bandwidth of the expert bytes a call must read, with a device-to-device copy
measured in the same run as the ceiling (read + write).

--sweep times other (BLOCK_N, SB, num_warps, QUADS) for each kernel through
`moe_quant.KERNEL_CONFIGS` (the product's per-kernel override; by default the kernels take
the dense GEMV's configs, tuned on whole matrices): a decode step's experts are thousands
of short programs (k experts x rows / BLOCK_N), each starting with a dependent load of its
expert id.

    python benchmarks/bench_moe_quant.py                 # on a CUDA machine
    python benchmarks/bench_moe_quant.py --sweep
    python benchmarks/bench_moe_quant.py --device cpu --experts 4 --k 2 --d-in 512 --inter 256   # smoke

Results go to benchmarks/results/moe-quant-<hostname>-<stamp>.json or --out.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_quant_gemv import float_math, random_blocks  # noqa: E402
from benchmarks.result_file import kernel_machine, result_header, write_result  # noqa: E402
from engine.experts import ExpertActivation  # noqa: E402
from engine.kernels import moe_quant, quant_gemv, row_nbytes  # noqa: E402
from engine.kernels.moe import ExpertRows, grouped_expert_mlp_reference  # noqa: E402

_Q = GGMLQuantizationType
# (BLOCK_N, SB, num_warps, QUADS) tried per kernel by --sweep: more rows a program than the
# dense GEMV's (2 rows), which amortize each program's expert-id load and final reduction.
_SWEEP = [(2, 4, 1, 2), (4, 4, 1, 2), (4, 2, 1, 2), (8, 2, 1, 2), (8, 4, 2, 2), (16, 2, 2, 2), (4, 2, 1, 4),
          (8, 2, 2, 4), (2, 2, 1, 1), (4, 4, 2, 1)]
# those of the integer-dot path (bf16 x as 16-bit integers, `quant_gemv.integer_x`): a K-quant
# unit has 16 / QUADS lanes, and a program keeps its 32 * num_warps threads busy
_SWEEP_X16 = [(2, 2, 1, 2), (4, 2, 1, 2), (8, 4, 1, 4), (8, 8, 2, 4), (4, 2, 2, 2), (8, 2, 2, 2), (4, 4, 2, 2),
              (8, 4, 2, 4), (16, 4, 2, 4), (8, 2, 4, 2), (16, 4, 4, 4)]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-in", type=int, default=3584)
    parser.add_argument("--inter", type=int, default=3072)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--gate-type", default="Q2_K")
    parser.add_argument("--down-type", default="Q3_K")
    parser.add_argument("--iters", type=int, default=200, help="timed calls per measurement")
    parser.add_argument("--per-graph", type=int, default=20, help="calls captured in one CUDA graph")
    parser.add_argument("--sweep", action="store_true", help="also time other kernel configurations")
    parser.add_argument("--device", default="cuda", help="cuda; cpu is a smoke mode (the torch path)")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/...)")
    return parser.parse_args(argv)


def _table(ggml_type: int, experts: int, out_features: int, in_features: int, gen: torch.Generator) -> ExpertRows:
    """An expert table of random bytes of a type (`random_blocks`)."""
    table = random_blocks(ggml_type, (experts, out_features * row_nbytes(ggml_type, in_features)), gen)
    return ExpertRows(table, ggml_type, (out_features, in_features))


def _graph_us(run: Callable[[], object], per_call: int, iters: int, device: torch.device) -> float:
    """Microseconds per call: CUDA graphs of `per_call` calls replayed (CUDA), or wall time (CPU)."""
    if device.type != "cuda":
        run()
        start = time.perf_counter()
        for _ in range(max(1, iters // per_call)):
            run()
        return (time.perf_counter() - start) / (max(1, iters // per_call) * per_call) * 1e6
    from benchmarks.cuda_timing import graph_us

    return graph_us(run, per_call, iters)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print a table, write the JSON file and return its content."""
    args = _parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and (not torch.cuda.is_available() or moe_quant.triton is None):
        raise SystemExit("bench_moe_quant: needs a CUDA device and triton (or --device cpu)")
    gen = torch.Generator(device=device).manual_seed(0)
    gate_type, down_type = int(_Q[args.gate_type]), int(_Q[args.down_type])
    gate = _table(gate_type, args.experts, args.inter, args.d_in, gen)
    up = _table(gate_type, args.experts, args.inter, args.d_in, gen)
    down = _table(down_type, args.experts, args.d_in, args.inter, gen)
    activation = ExpertActivation("situ", beta=3.0, linear_beta=5.0)
    bank = 64  # distinct routings, cycled through
    xs = torch.randn(bank, 1, args.d_in, device=device, generator=gen).to(torch.bfloat16)
    rows = torch.stack([torch.randperm(args.experts, device=device, generator=gen)[: args.k]
                        for _ in range(bank)]).view(bank, 1, args.k)
    weights = torch.rand(bank, 1, args.k, device=device, generator=gen) / args.k
    expert_bytes = args.k * (gate.table.shape[1] + up.table.shape[1] + down.table.shape[1])
    fused = moe_quant.fused_applies(xs[0], gate, up, down, activation)
    path = moe_quant.fused_quant_expert_mlp if fused else grouped_expert_mlp_reference

    def calls(n: int) -> Callable[[], None]:
        def run() -> None:
            for i in range(n):
                path(xs[i % bank], rows[i % bank], weights[i % bank], gate, up, down, activation)
        return run

    want = grouped_expert_mlp_reference(xs[0], rows[0], weights[0], gate, up, down, activation).float()

    def rel_l2() -> float:
        """One correctness look at real size, at the configs in force (tests/test_quant_gemv.py
        holds the real bounds; both paths round to bf16, so about 2**-8 apart)."""
        got = path(xs[0], rows[0], weights[0], gate, up, down, activation).float()
        return float((got - want).norm() / want.norm())

    rel = rel_l2()
    if moe_quant.SWITCH.error is not None:
        raise SystemExit(f"the fused kernels failed: {moe_quant.SWITCH.error!r}")

    copy = 0.0
    if device.type == "cuda":
        from benchmarks.cuda_timing import copy_gbps

        copy = copy_gbps(1 << 30)
    print(f"{device}  fused: {fused}  copy {copy:.0f} GB/s (read + write)  expert bytes/call "
          f"{expert_bytes / 1e6:.1f} MB  vs dequantize-then-matmul rel. L2 {rel:.2e}")
    header = f"{'gate_up config':<16} {'down config':<16} {'us/call':>9} {'GB/s':>8} {'% copy':>7} {'rel L2':>8}"
    print(header)
    print("-" * len(header))
    results: list[dict] = []
    best: dict[str, list[int]] = {}
    now = _dt.datetime.now(_dt.timezone.utc)
    result = {
        **result_header("moe-quant", __file__, argv, kernel_machine(device.type, moe_quant.triton), now),
        "settings": {"d_in": args.d_in, "inter": args.inter, "experts": args.experts, "k": args.k,
                     "gate_type": args.gate_type, "down_type": args.down_type, "iters": args.iters,
                     "per_graph": args.per_graph, "activation": "situ beta 3 linear_beta 5", "routing_bank": bank},
        "fused": fused, "expert_bytes_per_call": expert_bytes, "copy_bandwidth_gbps": copy,
        "rel_l2_vs_reference": rel, "rows": results, "best_by_kernel": best,
    }

    def record(us: float, rel: float) -> dict:
        gbps = expert_bytes / (us * 1e-6) / 1e9
        cfg = {k: (list(v[t]) if t in v else None)
               for (k, v), t in zip(moe_quant.KERNEL_CONFIGS.items(), (gate_type, down_type), strict=True)}
        row = {"us_per_call": us, "expert_gbps": gbps, "pct_of_copy": 100 * gbps / copy if copy else None,
               "gate_up_config": cfg["gate_up"], "down_config": cfg["down"], "rel_l2_vs_reference": rel}
        results.append(row)
        pct = f"{row['pct_of_copy']:>6.1f}%" if copy else f"{'':>7}"
        print(f"{str(cfg['gate_up'] or 'gemv'):<16} {str(cfg['down'] or 'gemv'):<16} {us:>9.1f} {gbps:>8.0f} {pct} "
              f"{rel:>8.1e}")
        write_result(result, args.out, "moe-quant", now)  # after every row: a cut-short run keeps them
        return row

    x16 = {t: quant_gemv.integer_x(xs[0], t) for t in (gate_type, down_type)}
    result["x16"] = {_Q(t).name: v for t, v in x16.items()}
    if fused and any(x16.values()):  # first the same MLP with float32 math on x (EXPERTDESK_X16=0)
        with float_math():
            row = record(_graph_us(calls(args.per_graph), args.per_graph, args.iters, device), rel_l2())
        row["float_math"] = True
        write_result(result, args.out, "moe-quant", now)
    record(_graph_us(calls(args.per_graph), args.per_graph, args.iters, device), rel)
    if args.sweep and fused:
        for kernel, qtype in (("gate_up", gate_type), ("down", down_type)):
            timings: list[tuple[float, tuple[int, int, int, int]]] = []
            for cfg in _SWEEP_X16 if x16[qtype] else _SWEEP:
                moe_quant.KERNEL_CONFIGS[kernel][qtype] = cfg
                cfg_rel = rel_l2()
                us = _graph_us(calls(args.per_graph), args.per_graph, args.iters, device)
                if moe_quant.SWITCH.error is not None:  # it fell back to torch: not a fused timing
                    print(f"{kernel} {cfg}: failed ({moe_quant.SWITCH.error!r})")
                    moe_quant.SWITCH.error = None
                    continue
                record(us, cfg_rel)
                timings.append((us, cfg))
            moe_quant.KERNEL_CONFIGS[kernel].pop(qtype, None)
            if timings:
                best[kernel] = list(min(timings)[1])
        print(f"best: {best}")

    write_result(result, args.out, "moe-quant", now)
    return result


if __name__ == "__main__":
    main()
