"""Benchmark the fused MXFP4 prefill MoE (engine.kernels.moe_mxfp4_prefill) against its torch reference.

Real DeepSeek-V4 routed-expert dimensions by default: d_in 4096, inter 2048, d_out 4096,
256 experts, top-6, bf16 x, T tokens per chunk with uniformly random routing (k distinct
experts per token). The expert tables are random MXFP4 bytes made on the GPU (block
scales kept in a sane range so that every value is finite); the kernels' speed does not
depend on the values. Each row times the fused path (CUDA events, after warm-up, mean of
--iters) and the torch reference `moe_prefill_reference` (expert by expert, dequantize
then matmul; --ref-iters, default 3), and reports ms, TFLOP/s (2 * T * k * 3 * d_in *
inter) and GB/s of expert bytes (the bytes of the experts that the routing used, three
roles), with the largest difference between the two relative to the reference's largest
magnitude. Beside it, in the same run: the fused path with the weights decoded in float32
math (EXPERTDESK_MXFP4_ASM=0; its outputs must equal the packed decode's), the split copies alone
(`split_experts` of the used experts, three roles: part of the fused time, and what a
weight layout stored split would save), and this GPU's dense bf16 rate (cuBLAS, 8192^3),
which every row's TFLOP/s is also given against (`of_dense_bf16`).

    python benchmarks/bench_moe_prefill.py                     # T = 512 and 4096
    python benchmarks/bench_moe_prefill.py --tokens 512 --sweep  # also try tile configs

Results go to ``benchmarks/results/moe-prefill-<hostname>-<stamp>.json`` or ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import itertools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import events_us  # noqa: E402
from benchmarks.result_file import kernel_machine, result_header, write_result  # noqa: E402
from engine.experts import ExpertActivation  # noqa: E402
from engine.kernels import moe_mxfp4_prefill as prefill  # noqa: E402
from engine.kernels.moe import ExpertRows  # noqa: E402

MXFP4 = 39


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="512,4096", help="comma-separated T values")
    parser.add_argument("--d-in", type=int, default=4096)
    parser.add_argument("--inter", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=10, help="timed iterations of the fused path")
    parser.add_argument("--ref-iters", type=int, default=3, help="timed iterations of the reference (0: skip)")
    parser.add_argument("--sweep", action="store_true", help="also time a few tile configs per T")
    parser.add_argument("--split-sweep", action="store_true",
                        help="also time the split copies with a few program shapes (SPLIT_SWEEP)")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/...)")
    return parser.parse_args(argv)


def _random_table(n_experts: int, shape: tuple[int, int], gen: torch.Generator) -> ExpertRows:
    """Random MXFP4 bytes [E, nbytes] on the GPU; every block's scale byte in 118..125."""
    out_features, in_features = shape
    nbytes = out_features * in_features // 32 * 17
    table = torch.randint(0, 256, (n_experts, nbytes), dtype=torch.uint8, device="cuda", generator=gen)
    scales = table.view(n_experts, -1, 17)[:, :, 0]
    scales.copy_(torch.randint(118, 126, scales.shape, dtype=torch.uint8, device="cuda", generator=gen))
    return ExpertRows(table, MXFP4, shape)


def _time_ms(fn, iters: int, warmup: int) -> float:
    return events_us(fn, 1, iters, warmup) / 1e3


def _row(name: str, ms: float, flops: float, expert_bytes: float) -> dict:
    return {"path": name, "ms": ms, "tflops": flops / ms / 1e9, "expert_gbps": expert_bytes / ms / 1e6}


# --sweep: each tile config (BLOCK_N, BLOCK_K, num_warps, num_stages) of both kernels at each BLOCK_M.
SWEEP_TILES = [(128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 4, 3), (128, 128, 4, 2), (64, 128, 4, 3),
               (128, 64, 8, 3)]
SWEEP_BLOCK_M = {"short": [16, 32, 64], "long": [64, 128]}  # T <= 1024, T > 1024
# --split-sweep: (SPLIT_ROWS, SPLIT_BLOCKS, SPLIT_WARPS)
SPLIT_SWEEP = [(16, 16, 4), (8, 16, 4), (4, 16, 4), (4, 16, 2), (8, 8, 4), (8, 8, 2), (4, 32, 4), (8, 32, 4),
               (2, 32, 2), (2, 64, 4), (1, 64, 2), (16, 8, 8)]


def _dense_bf16_tflops(iters: int) -> float:
    """This GPU's measured dense bf16 rate: torch's 8192^3 matmul (cuBLAS), TFLOP/s."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = _time_ms(lambda: a @ b, iters, 2)
    return 2.0 * 8192 ** 3 / ms / 1e9


def _split_all(gate: ExpertRows, up: ExpertRows, down: ExpertRows, used: torch.Tensor) -> None:
    """What a fused prefill spends on the split copies (`split_experts`) of the `used` experts, one pass."""
    for rows in (gate, up, down):
        prefill.split_experts(rows, used, 0, prefill.SplitExperts.empty(rows.shape, used.numel(), used.device))


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe_prefill: CUDA is not available on this machine")
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    d_in, inter, n_experts, k = args.d_in, args.inter, args.experts, args.k
    gate = _random_table(n_experts, (inter, d_in), gen)
    up = _random_table(n_experts, (inter, d_in), gen)
    down = _random_table(n_experts, (d_in, inter), gen)
    per_expert = gate.table.shape[1] + up.table.shape[1] + down.table.shape[1]
    activation = ExpertActivation("swiglu", limit=7.0)
    rows: list[dict] = []
    print(f"{'T':>6} {'path':<34} {'ms':>9} {'TFLOP/s':>9} {'GB/s':>8}  max|diff|/max|ref|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, d_in, device=device, generator=gen).to(dtype)
        chosen = torch.rand(tokens, n_experts, device=device, generator=gen).topk(k, dim=1).indices
        weights = torch.rand(tokens, k, device=device, generator=gen).softmax(dim=1)
        used = int(torch.unique(chosen).numel())
        flops = 2.0 * tokens * k * 3 * d_in * inter
        expert_bytes = float(used * per_expert)
        call = (x, chosen, weights, gate, up, down, activation)
        assert prefill.prefill_applies(x, k, gate, up, down, activation), "the fused path does not apply"
        fused = prefill.fused_moe_prefill(*call)
        assert prefill.prefill_error() is None, prefill.prefill_error()
        base = {"tokens": tokens, "k": k, "experts_used": used, "d_in": d_in, "inter": inter,
                "n_experts": n_experts, "dtype": args.dtype,
                "block_m": prefill.block_m_for(tokens * k, n_experts),
                "gate_up_config": list(prefill.GATE_UP_CONFIG), "down_config": list(prefill.DOWN_CONFIG),
                "group": prefill.group_size(gate.shape, down.shape, n_experts, device),
                "packed_decode": prefill.packed_decode_applies(x)}
        row = {**base, **_row("fused", _time_ms(functools.partial(prefill.fused_moe_prefill, *call), args.iters, 2),
                              flops, expert_bytes)}
        results = [row]
        saved_asm = os.environ.get(prefill.ASM_SWITCH.env)
        os.environ[prefill.ASM_SWITCH.env] = "0"
        try:
            plain = prefill.fused_moe_prefill(*call)
            plain_ms = _time_ms(functools.partial(prefill.fused_moe_prefill, *call), args.iters, 1)
        finally:
            if saved_asm is None:
                del os.environ[prefill.ASM_SWITCH.env]
            else:
                os.environ[prefill.ASM_SWITCH.env] = saved_asm
        row["rel_diff_vs_float32_decode"] = float((fused.float() - plain.float()).abs().max()
                                                  / plain.float().abs().max())
        results.append({**base, **_row("fused, float32 decode (no asm)", plain_ms, flops, expert_bytes)})
        used_ids = prefill.experts_used(prefill.prefill_layout(chosen, n_experts, 16)[1], n_experts)
        split_ms = _time_ms(functools.partial(_split_all, gate, up, down, used_ids), args.iters, 1)
        results.append({**base, **_row("split copies (in fused)", split_ms, 0.0, expert_bytes)})
        for shape in SPLIT_SWEEP if args.split_sweep else ():  # the split copy's programs
            saved = prefill.SPLIT_ROWS, prefill.SPLIT_BLOCKS, prefill.SPLIT_WARPS
            prefill.SPLIT_ROWS, prefill.SPLIT_BLOCKS, prefill.SPLIT_WARPS = shape
            try:
                ms = _time_ms(functools.partial(_split_all, gate, up, down, used_ids), args.iters, 1)
            finally:
                prefill.SPLIT_ROWS, prefill.SPLIT_BLOCKS, prefill.SPLIT_WARPS = saved
            results.append({**base, "split_rows": shape[0], "split_blocks": shape[1], "split_warps": shape[2],
                            **_row("split copies, {} rows x {} blocks, {} warps".format(*shape), ms, 0.0,
                                   expert_bytes)})
        if args.ref_iters > 0:
            ref = prefill.moe_prefill_reference(*call)
            diff = float((fused.float() - ref.float()).abs().max() / ref.float().abs().max())
            row["rel_diff_vs_reference"] = diff
            ref_ms = _time_ms(functools.partial(prefill.moe_prefill_reference, *call), args.ref_iters, 1)
            results.append({**base, **_row("reference", ref_ms, flops, expert_bytes)})
        if args.sweep:
            saved = (prefill.GATE_UP_CONFIG, prefill.DOWN_CONFIG, prefill.BLOCK_M_STEPS)
            try:
                for tiles, bm in itertools.product(SWEEP_TILES, SWEEP_BLOCK_M["short" if tokens <= 1024 else "long"]):
                    prefill.GATE_UP_CONFIG = prefill.DOWN_CONFIG = tiles
                    prefill.BLOCK_M_STEPS = ((float("inf"), bm),)
                    ms = _time_ms(functools.partial(prefill.fused_moe_prefill, *call), args.iters, 1)
                    results.append({**base, "block_m": bm, "gate_up_config": list(tiles), "down_config": list(tiles),
                                    **_row(f"sweep {tiles} M={bm}", ms, flops, expert_bytes)})
            finally:
                prefill.GATE_UP_CONFIG, prefill.DOWN_CONFIG, prefill.BLOCK_M_STEPS = saved
            assert prefill.prefill_error() is None, prefill.prefill_error()
        for r in results:
            extra = f"  {r['rel_diff_vs_reference']:.2e}" if "rel_diff_vs_reference" in r else ""
            print(f"{tokens:>6} {r['path']:<34} {r['ms']:>9.3f} {r['tflops']:>9.1f} {r['expert_gbps']:>8.0f}{extra}")
        rows.extend(results)
    dense = _dense_bf16_tflops(args.iters)
    print(f"dense bf16 matmul (8192^3, cuBLAS): {dense:.1f} TFLOP/s")
    for r in rows:
        r["of_dense_bf16"] = r["tflops"] / dense
    now = _dt.datetime.now(_dt.timezone.utc)
    result = {
        **result_header("moe-prefill", __file__, argv, kernel_machine(device, prefill.triton), now),
        "dense_bf16_tflops": dense,
        "rows": rows,
    }
    write_result(result, args.out, "moe-prefill", now)
    return result


if __name__ == "__main__":
    main()
