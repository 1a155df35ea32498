"""Benchmark the fused MXFP4 routed-expert MLP against the torch (gather + dequantize + bmm) path.

Real DeepSeek-V4 decode geometry by default: d_in 4096, inter 2048, top-6 of 256 experts,
one token, bfloat16 activations, MXFP4 gate/up/down tables of 256 experts (3.4 GB).
Each timed call routes to a different set of experts (drawn from a bank of routings), so
the expert bytes come from device memory, not the 60 MB L2. Reported per call:
microseconds, and the effective bandwidth of the expert bytes a call must read
(k experts x 3 roles x inter x d_in x 17/32 bytes), with a device-to-device copy
measured in the same run as the ceiling (read + write).

Two timings of each path, both with CUDA events over --iters calls: "eager" (Python
launches every call) and "graph" (--per-graph calls captured in one CUDA graph, replayed;
what decode runs under StepGraphs).

    python benchmarks/bench_moe_mxfp4.py                 # on a CUDA machine
    python benchmarks/bench_moe_mxfp4.py --sweep         # also try kernel block sizes

Results go to benchmarks/results/moe-mxfp4-<hostname>-<stamp>.json or --out.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import copy_gbps, events_us  # noqa: E402
from benchmarks.cuda_timing import graph_us as cuda_graph_us  # noqa: E402
from benchmarks.result_file import kernel_machine, result_header, write_result  # noqa: E402
from engine.experts import ExpertActivation  # noqa: E402
from engine.kernels import moe_mxfp4, row_nbytes  # noqa: E402
from engine.kernels.moe import ExpertRows, grouped_expert_mlp_reference  # noqa: E402

MXFP4 = moe_mxfp4.MXFP4
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_SWEEP = [(bn, bk, w) for bn in (8, 16, 32) for bk in (128, 256, 512) for w in (2, 4, 8)
          if 8 <= bn * bk // 2 // (32 * w) <= 32]  # 8 to 32 accumulators a thread


def _config(text: str) -> tuple[int, int, int]:
    """"16,256,4" -> (BLOCK_N, BLOCK_K, num_warps)."""
    block_n, block_k, warps = (int(v) for v in text.split(","))
    return block_n, block_k, warps


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-in", type=int, default=4096)
    parser.add_argument("--inter", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    parser.add_argument("--iters", type=int, default=200, help="timed calls per measurement")
    parser.add_argument("--per-graph", type=int, default=20, help="calls captured in one CUDA graph")
    parser.add_argument("--sweep", action="store_true", help="also time other block sizes (graph mode)")
    parser.add_argument("--sweep-configs", default=None,
                        help="BLOCK_N,BLOCK_K,num_warps;... to sweep (default: a built-in list)")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/...)")
    return parser.parse_args(argv)


def _table(experts: int, out_features: int, in_features: int, gen: torch.Generator) -> ExpertRows:
    """Random MXFP4 bytes, block scales 2**-12..2**-3 (no inf or NaN anywhere)."""
    nbytes = out_features * row_nbytes(MXFP4, in_features)
    table = torch.randint(0, 256, (experts, nbytes), dtype=torch.uint8, device="cuda", generator=gen)
    blocks = table.view(experts, -1, 17)
    blocks[:, :, 0] = torch.randint(115, 125, blocks.shape[:2], dtype=torch.uint8, device="cuda", generator=gen)
    return ExpertRows(table, MXFP4, (out_features, in_features))


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print a table, write the JSON file and return its content."""
    args = _parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe_mxfp4: needs a CUDA device")
    if moe_mxfp4.triton is None:
        raise SystemExit("bench_moe_mxfp4: needs triton")
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = _DTYPES[args.dtype]
    gate = _table(args.experts, args.inter, args.d_in, gen)
    up = _table(args.experts, args.inter, args.d_in, gen)
    down = _table(args.experts, args.d_in, args.inter, gen)
    activation = ExpertActivation("swiglu", limit=10.0)
    bank = 64  # distinct routings, cycled through
    xs = torch.randn(bank, args.tokens, args.d_in, device="cuda", generator=gen).to(dtype)
    rows = torch.stack([torch.randperm(args.experts, device="cuda", generator=gen)[: args.tokens * args.k]
                        for _ in range(bank)]).view(bank, args.tokens, args.k)
    weights = torch.rand(bank, args.tokens, args.k, device="cuda", generator=gen) / args.k
    expert_bytes = args.tokens * args.k * (gate.table.shape[1] + up.table.shape[1] + down.table.shape[1])
    assert moe_mxfp4.fused_applies(xs[0], gate, up, down, activation)

    paths = {"fused": moe_mxfp4.fused_expert_mlp, "torch": grouped_expert_mlp_reference}

    def calls(path: str, n: int, offset: int = 0) -> Callable[[], object]:
        fn = paths[path]

        def run() -> None:
            for i in range(offset, offset + n):
                b = i % bank
                fn(xs[b], rows[b], weights[b], gate, up, down, activation)
        return run

    def eager_us(path: str) -> float:
        counter = iter(range(1 << 30))
        # The warm-up goes once round the bank: every pointer alignment Triton specializes on
        # gets compiled before the clock starts.
        return events_us(lambda: calls(path, 1, next(counter))(), 1, args.iters, warmup=bank)

    def graph_us(path: str) -> float:
        return cuda_graph_us(calls(path, args.per_graph), args.per_graph, args.iters)

    # One correctness look at real size (the tests hold the real bounds).
    got = moe_mxfp4.fused_expert_mlp(xs[0], rows[0], weights[0], gate, up, down, activation).float()
    want = grouped_expert_mlp_reference(xs[0], rows[0], weights[0], gate, up, down, activation).float()
    rel = float((got - want).norm() / want.norm())
    if moe_mxfp4.fused_error() is not None:
        raise SystemExit(f"the fused kernels failed: {moe_mxfp4.fused_error()!r}")

    copy = copy_gbps(1 << 30)
    results = []
    print(f"{torch.cuda.get_device_name()}  copy {copy:.0f} GB/s (read + write)  "
          f"expert bytes/call {expert_bytes / 1e6:.1f} MB  fused vs torch rel. L2 diff {rel:.2e}")
    header = f"{'path':<6} {'mode':<6} {'config':<26} {'us/call':>9} {'GB/s':>8} {'% copy':>7}"
    print(header)
    print("-" * len(header))

    def record(path: str, mode: str, us: float, config: dict | None = None) -> None:
        gbps = expert_bytes / (us * 1e-6) / 1e9
        row = {"path": path, "mode": mode, "us_per_call": us, "expert_gbps": gbps,
               "pct_of_copy": 100 * gbps / copy, "config": config}
        results.append(row)
        cfg = "" if config is None else f"gu={tuple(config['gate_up'])} dn={tuple(config['down'])}"
        print(f"{path:<6} {mode:<6} {cfg:<26} {us:>9.1f} {gbps:>8.0f} {row['pct_of_copy']:>6.1f}%")

    default = {"gate_up": list(moe_mxfp4.GATE_UP_CONFIG), "down": list(moe_mxfp4.DOWN_CONFIG)}
    for path in paths:
        record(path, "eager", eager_us(path), default if path == "fused" else None)
        record(path, "graph", graph_us(path), default if path == "fused" else None)

    if args.sweep:
        saved = moe_mxfp4.GATE_UP_CONFIG, moe_mxfp4.DOWN_CONFIG
        best: dict[str, tuple[float, tuple[int, int, int]]] = {}
        sweep = _SWEEP if args.sweep_configs is None else [
            _config(c) for c in args.sweep_configs.split(";")]
        for which in ("gate_up", "down"):
            for cfg in sweep:
                moe_mxfp4.GATE_UP_CONFIG, moe_mxfp4.DOWN_CONFIG = saved
                setattr(moe_mxfp4, "GATE_UP_CONFIG" if which == "gate_up" else "DOWN_CONFIG", cfg)
                us = graph_us("fused")
                if moe_mxfp4.fused_error() is not None:  # it fell back to torch: not a fused timing
                    print(f"{which} {cfg}: failed ({moe_mxfp4.fused_error()!r})")
                    moe_mxfp4.SWITCH.error = None
                    continue
                record("fused", "graph", us, {"gate_up": list(moe_mxfp4.GATE_UP_CONFIG),
                                               "down": list(moe_mxfp4.DOWN_CONFIG)})
                if which not in best or us < best[which][0]:
                    best[which] = (us, cfg)
        moe_mxfp4.GATE_UP_CONFIG, moe_mxfp4.DOWN_CONFIG = best["gate_up"][1], best["down"][1]
        record("fused", "graph", graph_us("fused"), {"gate_up": list(moe_mxfp4.GATE_UP_CONFIG),
                                                     "down": list(moe_mxfp4.DOWN_CONFIG)})
        print(f"best: GATE_UP_CONFIG = {best['gate_up'][1]}, DOWN_CONFIG = {best['down'][1]}")
        moe_mxfp4.GATE_UP_CONFIG, moe_mxfp4.DOWN_CONFIG = saved

    now = _dt.datetime.now(_dt.timezone.utc)
    result = {
        **result_header("moe-mxfp4", __file__, argv, kernel_machine("cuda", moe_mxfp4.triton), now),
        "settings": {"d_in": args.d_in, "inter": args.inter, "experts": args.experts, "k": args.k,
                     "tokens": args.tokens, "dtype": args.dtype, "iters": args.iters,
                     "per_graph": args.per_graph, "activation": "swiglu limit 10", "routing_bank": bank},
        "expert_bytes_per_call": expert_bytes,
        "copy_bandwidth_gbps": copy,
        "fused_vs_torch_rel_l2": rel,
        "rows": results,
    }
    write_result(result, args.out, "moe-mxfp4", now)
    return result


if __name__ == "__main__":
    main()
