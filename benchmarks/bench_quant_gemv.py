"""Benchmark the quantized GEMV (engine.kernels.quant_gemv) at the real models' dense shapes.

For every dense matrix shape and GGML type of DeepSeek-V4-Flash's and Kimi-K3's files
(as benchmarks/real_geometry.py plans them), one decode row (bf16):
- `quant_gemv` straight from the GGUF bytes, and
- where x goes as 16-bit integers (`quant_gemv.integer_x`: Q2_K, Q3_K), the
  same call with float32 math on x (EXPERTDESK_X16=0), and
- cuBLAS on the same weight dequantized to bf16 (what the engine ran before: the dense
  weights materialized at load), and
- the time to read the GGUF bytes at the device-to-device copy rate measured in the same
  run (the bound).
Each timed call reads a different copy of the matrix (a bank of at least 256 MiB), so the
bytes come from device memory, not the 60 MB L2; timings are CUDA graphs of --per-graph
calls, replayed (what decode runs).

    python benchmarks/bench_quant_gemv.py              # on a CUDA machine
    python benchmarks/bench_quant_gemv.py --sweep      # also try (BLOCK_N, SB, num_warps, QUADS)

Results go to benchmarks/results/quant-gemv-<hostname>-<stamp>.json or --out.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import copy_gbps, graph_us  # noqa: E402
from benchmarks.real_geometry import plan_tensors  # noqa: E402
from benchmarks.result_file import kernel_machine, result_header, write_result  # noqa: E402
from engine.kernels import dequantize, quant_gemv, row_nbytes  # noqa: E402

# Byte offsets of each type's fp16 scale fields in its block (random bytes there get sane scales).
_F16_FIELDS = {8: (0,), 10: (80, 82), 11: (108,), 12: (0, 2), 13: (0, 2), 14: (208,)}
# (BLOCK_N, SB, num_warps, QUADS) tried by --sweep: a Q8_0 unit has 64 / QUADS lanes of 4 QUADS
# bytes, a Q2_K / Q3_K / Q6_K unit 16 / QUADS (Q4_K / Q5_K: 32 of 1 value; the float types 64);
# each set keeps every thread of a program busy (BLOCK_N * SB * lanes >= 32 * num_warps).
_SWEEP = {8: [(1, 2, 1, 1), (2, 2, 1, 2), (4, 2, 1, 2), (4, 2, 1, 4), (4, 4, 1, 4), (4, 2, 2, 2)],
          10: [(2, 2, 1, 1), (2, 2, 1, 2), (2, 4, 1, 2), (4, 4, 1, 2), (4, 2, 1, 4), (4, 4, 1, 4)],
          0: [(2, 2, 1, 1), (4, 1, 1, 1), (4, 2, 2, 1), (8, 1, 2, 1), (8, 2, 4, 1), (16, 1, 4, 1)]}
_SWEEP[11] = _SWEEP[14] = _SWEEP[10]
# --sweep's choices for the integer-dot path (bf16 x as 16-bit integers, `quant_gemv.integer_x`):
# a K-quant unit has 16 / QUADS lanes.
# A thread holding several rows of one (unit, lane) loads their x once (rows past the lanes of
# the program repeat in the thread: (8, 4, 1, 4) gives each thread 4 rows); programs of 2 or 4
# warps let an SM hold more warps than its 32 programs of one.
_SWEEP_X16 = {10: [(2, 2, 1, 2), (4, 2, 1, 2), (8, 4, 1, 4), (16, 4, 1, 4), (4, 2, 2, 2), (8, 2, 2, 2), (4, 4, 2, 2),
                   (8, 4, 2, 4), (16, 4, 2, 4), (8, 2, 4, 2), (8, 4, 4, 2), (16, 4, 4, 4)]}
_SWEEP_X16[11] = _SWEEP_X16[10]
_BANK_BYTES = 256 << 20


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=200, help="timed calls per measurement")
    parser.add_argument("--per-graph", type=int, default=20, help="calls captured in one CUDA graph")
    parser.add_argument("--sweep", action="store_true", help="also time other kernel configurations")
    parser.add_argument("--model", default=None, help="only this model's matrices (deepseek-v4-flash, kimi-k3)")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/...)")
    return parser.parse_args(argv)


def real_shapes() -> list[tuple[str, int, int, int]]:
    """(example tensor name, GGML type, out, in) of every distinct quantized dense matrix of
    the two models' real-geometry files (token_embd is read by rows, not multiplied)."""
    seen: dict[tuple[int, int, int], str] = {}
    for model, layers in (("deepseek-v4-flash", 3), ("kimi-k3", 2)):
        for plan in plan_tensors(model, layers):
            t = int(plan.ggml_type)
            if (len(plan.shape) == 2 and not plan.is_routed_expert and t in quant_gemv.GEMV_TYPES
                    and plan.name != "token_embd.weight"):
                seen.setdefault((t, *plan.shape), f"{model}:{plan.name}")
    return [(name, t, out, inp) for (t, out, inp), name in seen.items()]


def random_blocks(ggml_type: int, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random GGUF bytes of a type (uint8, `shape`, whole blocks along the last axis) on the
    generator's device, with fp16 scales 2**-10..2**-6 (finite sums)."""
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, device=gen.device, generator=gen)
    _, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    blocks = raw.view(-1, size)
    for offset in _F16_FIELDS[ggml_type]:
        d = torch.rand(blocks.shape[0], device=gen.device, generator=gen) * 2.0 ** -6 + 2.0 ** -10
        blocks[:, offset:offset + 2] = d.to(torch.float16).view(torch.uint8).view(-1, 2)
    return raw


def _bank(ggml_type: int, out_features: int, in_features: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Copies of one random matrix's bytes (`random_blocks`), >= 256 MiB in all."""
    nbytes = out_features * row_nbytes(ggml_type, in_features)
    raw = random_blocks(ggml_type, (nbytes,), gen)
    return [raw] + [raw.clone() for _ in range(max(1, -(-_BANK_BYTES // nbytes)) - 1)]


def _graph_us(run: Callable[[int], object], n_bank: int, per_graph: int, iters: int) -> float:
    """Microseconds per call of run(i) (i cycling through the bank), captured per_graph at a time."""
    def calls() -> None:
        for i in range(per_graph):
            run(i % n_bank)

    return graph_us(calls, per_graph, iters)


@contextlib.contextmanager
def float_math() -> Iterator[None]:
    """The GEMV with float32 math on x (EXPERTDESK_X16=0) inside the block."""
    saved = os.environ.get("EXPERTDESK_X16")
    os.environ["EXPERTDESK_X16"] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["EXPERTDESK_X16"]
        else:
            os.environ["EXPERTDESK_X16"] = saved


def x16_best(sweeps: list[dict], rows_of: dict[str, int]) -> dict[str, dict[str, list[int]]]:
    """The integer-dot path's configuration with the least total time per type, over the
    type's matrices of fewer than `quant_gemv.X16_MANY_ROWS` rows ("configs") and of as many or
    more ("many_rows_configs"): what `quant_gemv.X16_CONFIGS` / `X16_MANY_ROWS_CONFIGS` hold."""
    totals: dict[tuple[str, str], dict[tuple[int, ...], float]] = {}
    for s in sweeps:
        if not s.get("x16"):
            continue
        cls = "many_rows_configs" if rows_of[s["matrix"]] >= quant_gemv.X16_MANY_ROWS else "configs"
        per = totals.setdefault((cls, s["ggml_type"]), {})
        per[tuple(s["config"])] = per.get(tuple(s["config"]), 0.0) + s["us"]
    best: dict[str, dict[str, list[int]]] = {"configs": {}, "many_rows_configs": {}}
    for (cls, t), per in totals.items():
        best[cls][t] = list(min(per, key=lambda c, per=per: per[c]))
    return best


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print a table, write the JSON file and return its content."""
    args = _parse_args(argv)
    if not torch.cuda.is_available() or quant_gemv.triton is None:
        raise SystemExit("bench_quant_gemv: needs a CUDA device and triton")
    now = _dt.datetime.now()
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy = copy_gbps(1 << 30)
    print(f"{torch.cuda.get_device_name()}  copy {copy:.0f} GB/s (read + write)  configs {quant_gemv.CONFIGS}")
    header = (f"{'matrix':<44} {'type':<5} {'out x in':>14} {'MB':>7} {'gemv us':>8} {'GB/s':>6} {'%copy':>6} "
              f"{'bf16 us':>8} {'speedup':>7} {'float us':>8}")
    print(header)
    print("-" * len(header))
    rows: list[dict] = []
    sweeps: list[dict] = []
    result = {**result_header("quant_gemv", __file__, argv, kernel_machine("cuda", quant_gemv.triton), now),
              "copy_gbps": copy, "rows": rows, "sweep": sweeps,
              "configs": {GGMLQuantizationType(t).name: list(c) for t, c in quant_gemv.CONFIGS.items()},
              "short_row_configs": {GGMLQuantizationType(t).name: list(c)
                                    for t, c in quant_gemv.SHORT_ROW_CONFIGS.items()}}
    for name, t, out_features, in_features in real_shapes():
        if args.model is not None and not name.startswith(args.model + ":"):
            continue
        bank = _bank(t, out_features, in_features, gen)
        shape = (out_features, in_features)
        x = torch.randn(1, in_features, device="cuda", generator=gen).to(torch.bfloat16)
        nbytes = bank[0].numel()

        def gemv(i: int, bank=bank, t=t, shape=shape, x=x) -> object:
            return quant_gemv.quant_gemv(x, bank[i], t, shape)

        check = gemv(0).float()
        dense = dequantize(bank[0], t, shape, torch.bfloat16)
        want = torch.nn.functional.linear(x, dense).float()
        rel = float((check - want).norm() / want.norm())
        if quant_gemv.SWITCH.error is not None:
            raise SystemExit(f"the kernel failed: {quant_gemv.SWITCH.error!r}")
        us = _graph_us(gemv, len(bank), args.per_graph, args.iters)
        x16 = quant_gemv.integer_x(x, t)
        float_us = rel_float = None
        if x16:  # the same call with float32 math on x (EXPERTDESK_X16=0), for the ratio
            with float_math():
                rel_float = float((gemv(0).float() - want).norm() / want.norm())
                float_us = _graph_us(gemv, len(bank), args.per_graph, args.iters)
        dense_bank = [dense] + [dense.clone() for _ in range(max(1, -(-_BANK_BYTES // (2 * dense.numel()))) - 1)]
        del dense
        bf16_us = _graph_us(lambda i, d=dense_bank, x=x: torch.nn.functional.linear(x, d[i]), len(dense_bank),
                            args.per_graph, args.iters)
        del dense_bank
        gbps = nbytes / (us * 1e-6) / 1e9
        row = {"matrix": name, "ggml_type": GGMLQuantizationType(t).name, "shape": list(shape), "bytes": nbytes,
               "gemv_us": us, "gemv_gbps": gbps, "pct_of_copy": 100 * gbps / (copy / 2), "bf16_cublas_us": bf16_us,
               "bound_us": nbytes / (copy / 2 * 1e9) * 1e6, "speedup_vs_bf16": bf16_us / us,
               "rel_l2_vs_bf16_weights": rel, "x16": x16, "float_math_us": float_us,
               "float_math_rel_l2_vs_bf16_weights": rel_float}
        rows.append(row)
        print(f"{name[-44:]:<44} {row['ggml_type']:<5} {f'{out_features}x{in_features}':>14} {nbytes / 1e6:>7.1f} "
              f"{us:>8.1f} {gbps:>6.0f} {row['pct_of_copy']:>5.0f}% {bf16_us:>8.1f} {bf16_us / us:>6.2f}x "
              f"{'' if float_us is None else f'{float_us:>8.1f}'}")
        if args.sweep:
            table = quant_gemv.X16_CONFIGS if x16 else quant_gemv.CONFIGS
            saved, short = table[t], quant_gemv.SHORT_ROW_CONFIGS.pop(t, None)
            many = quant_gemv.X16_MANY_ROWS_CONFIGS.pop(t, None)
            for cfg in (_SWEEP_X16[t] if x16 else _SWEEP.get(t, _SWEEP[0])):
                table[t] = cfg
                sweep_us = _graph_us(gemv, len(bank), args.per_graph, args.iters)
                if quant_gemv.SWITCH.error is not None:
                    print(f"  {cfg}: failed ({quant_gemv.SWITCH.error!r})")
                    quant_gemv.SWITCH.error = None
                    continue
                sweeps.append({"matrix": name, "ggml_type": row["ggml_type"], "config": list(cfg), "us": sweep_us,
                               "x16": x16, "rel_l2_vs_bf16_weights": float((gemv(0).float() - want).norm()
                                                                            / want.norm())})
            table[t] = saved
            if many is not None:
                quant_gemv.X16_MANY_ROWS_CONFIGS[t] = many
            if short is not None:
                quant_gemv.SHORT_ROW_CONFIGS[t] = short
            best = min((s for s in sweeps if s["matrix"] == name), key=lambda s: s["us"])
            print(f"  best {tuple(best['config'])}: {best['us']:.1f} us")
        del bank
        torch.cuda.empty_cache()
        write_result(result, args.out, "quant-gemv", now)  # after every matrix: a cut-short run keeps them
    if sweeps:  # by type, the configuration with the least total time over that type's matrices
        by_type: dict[str, dict[tuple[int, ...], float]] = {}
        for s in sweeps:
            per = by_type.setdefault(s["ggml_type"], {})
            per[tuple(s["config"])] = per.get(tuple(s["config"]), 0.0) + s["us"]
        result["best_config_by_type"] = {t: list(min(per, key=lambda c, per=per: per[c])) for t, per in by_type.items()}
        print(f"best by type: {result['best_config_by_type']}")
        result["x16_best"] = x16_best(sweeps, {r["matrix"]: r["shape"][0] for r in rows})
        print(f"integer-dot path, best by type and rows: {result['x16_best']}")
    write_result(result, args.out, "quant-gemv", now)
    return result


if __name__ == "__main__":
    main()
