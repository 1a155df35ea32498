"""Benchmark the batched prefill of K-quant experts (engine.kernels.moe_prefill) at Kimi-K3's size.

Kimi-K3's routed experts by default: gate and up Q2_K [3072, 3584], down Q3_K [3584, 3072]
(the latent MoE), 896 experts, top-16, bf16 x, T tokens per chunk with uniformly random
routing. The expert tables are random bytes made on the GPU, every super block's fp16
scales set to sane values (the speed does not depend on the values); the three roles lie
side by side in one buffer per expert, as a GGUF's stacked tensors do, so each role's table
is a strided view. Each row times the product's `batched_prefill_mlp` (CUDA events, after a
warm-up) with one batch budget (`--budgets`, MiB or "auto": the product's default,
`moe_prefill.batch_budget`) and one way of reading the experts' bytes: "in place" (the
product: `ExpertRows.gather` -> `dequantize_rows`, one launch that reads the picked rows
where they lie) or "gathered" (the previous way, `dequantize_gathered`: an index_select
copy of the rows, then `dequantize`). It reports ms, tokens/s, batches, and
the used experts' quantized bytes per second.

    python benchmarks/bench_batched_prefill.py                        # T = 512 and 4096
    python benchmarks/bench_batched_prefill.py --tokens 512 --budgets 1024,4096,auto

Results go to ``benchmarks/results/batched-prefill-<hostname>-<stamp>.json`` or ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import events_us  # noqa: E402
from benchmarks.result_file import kernel_machine, result_header, write_result  # noqa: E402
from engine.experts import ExpertActivation  # noqa: E402
from engine.kernels import dequant, moe_prefill  # noqa: E402
from engine.kernels.dequant import dequantize_gathered, tensor_nbytes  # noqa: E402
from engine.kernels.moe import ExpertRows  # noqa: E402

Q2_K, Q3_K = 10, 11
# Byte offsets of each type's fp16 scales in its 256-value super block (Q2_K: d, dmin; Q3_K: d).
SCALE_FIELDS = {Q2_K: (84, (80, 82)), Q3_K: (110, (108,))}


class GatheredRows(ExpertRows):
    """The baseline: the picked rows copied out (index_select), then dequantized."""

    def gather(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_gathered(self.table, rows, self.ggml_type, self.shape, dtype)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="512,4096", help="comma-separated T values")
    parser.add_argument("--d-in", type=int, default=3584)
    parser.add_argument("--inter", type=int, default=3072)
    parser.add_argument("--experts", type=int, default=896)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--budgets", default="1024,auto", help="batch budgets: MiB, or auto (the product's)")
    parser.add_argument("--reads", default="in place,gathered", help="how the rows are read: in place, gathered")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cuda; cpu is a smoke mode for tests (small sizes)")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/...)")
    return parser.parse_args(argv)


def _tables(n_experts: int, d_in: int, inter: int, device: torch.device, gen: torch.Generator) -> list[ExpertRows]:
    """gate, up (Q2_K [inter, d_in]) and down (Q3_K [d_in, inter]) of every expert, side by
    side in one random buffer [E, all three], with each super block's scales made sane."""
    shapes = [(Q2_K, (inter, d_in)), (Q2_K, (inter, d_in)), (Q3_K, (d_in, inter))]
    sizes = [tensor_nbytes(t, shape) for t, shape in shapes]
    buffer = torch.randint(0, 256, (n_experts, sum(sizes)), dtype=torch.uint8, device=device, generator=gen)
    roles, start = [], 0
    for (ggml_type, shape), size in zip(shapes, sizes):
        table = buffer[:, start:start + size]
        block, fields = SCALE_FIELDS[ggml_type]
        blocks = table.view(n_experts, -1, block)  # a view: each row of the buffer is contiguous
        for offset in fields:  # fp16 0x2C00 = 2**-4 (little-endian: 00 2C)
            blocks[:, :, offset] = 0x00
            blocks[:, :, offset + 1] = 0x2C
        roles.append(ExpertRows(table, ggml_type, shape))
        start += size
    return roles


def _batches(counts: torch.Tensor, weight_bytes: int, row_bytes: int, budget: int) -> int:
    """How many batches `batched_prefill_mlp` makes of these per-expert token counts."""
    c = sorted(counts.tolist(), reverse=True)
    b = n = 0
    while b < len(c):
        m, e = c[b], b + 1
        while e < len(c) and 2 * c[e] >= m and (e + 1 - b) * weight_bytes <= budget \
                and (e + 1 - b) * m * row_bytes <= budget:
            e += 1
        b, n = e, n + 1
    return n


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_batched_prefill: CUDA is not available on this machine (--device cpu: a smoke run)")
    gen = torch.Generator(device=device).manual_seed(0)
    d_in, inter, n_experts, k = args.d_in, args.inter, args.experts, args.k
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gate, up, down = _tables(n_experts, d_in, inter, device, gen)
    gathered = [GatheredRows(r.table, r.ggml_type, r.shape) for r in (gate, up, down)]
    per_expert = sum(r.table.shape[1] for r in (gate, up, down))
    activation = ExpertActivation("situ", beta=4.0)
    weight_bytes = (2 * inter * d_in + d_in * inter) * torch.empty((), dtype=dtype).element_size()
    row_bytes = (d_in + 3 * inter + d_in) * torch.empty((), dtype=dtype).element_size()

    def timed(fn) -> float:
        if device.type == "cuda":
            return events_us(fn, 1, args.iters, 1) / 1e3
        import time
        fn()
        start = time.perf_counter()
        for _ in range(args.iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / args.iters

    rows: list[dict] = []
    print(f"{'T':>6} {'budget':>10} {'reads':<10} {'batches':>7} {'ms':>9} {'tok/s':>9} {'GB/s':>8}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, d_in, device=device, generator=gen).to(dtype)
        chosen = torch.rand(tokens, n_experts, device=device, generator=gen).topk(k, dim=1).indices
        weights = torch.rand(tokens, k, device=device, generator=gen).softmax(dim=1)
        counts = torch.bincount(chosen.reshape(-1), minlength=n_experts)
        used = int((counts > 0).sum())
        reference = None
        for budget_name in args.budgets.split(","):
            budget = moe_prefill.batch_budget(device) if budget_name == "auto" else int(budget_name) << 20
            for reads in args.reads.split(","):
                roles = (gate, up, down) if reads == "in place" else gathered
                call = functools.partial(moe_prefill.batched_prefill_mlp, x, chosen, weights, *roles, activation,
                                         batch_bytes=budget)
                out = call()
                reference = out if reference is None else reference
                ms = timed(call)
                row = {"tokens": tokens, "k": k, "experts": n_experts, "experts_used": used, "d_in": d_in,
                       "inter": inter, "dtype": str(dtype).removeprefix("torch."), "budget": budget_name,
                       "budget_bytes": budget, "reads": reads,
                       "batches": _batches(counts[counts > 0], weight_bytes, row_bytes, budget), "ms": ms,
                       "tok_s": tokens / ms * 1e3, "expert_gbps": used * per_expert / ms / 1e6,
                       "max_rel_diff_vs_first_row": float((out.float() - reference.float()).abs().max()
                                                          / reference.float().abs().max())}
                rows.append(row)
                print(f"{tokens:>6} {budget_name:>10} {reads:<10} {row['batches']:>7} {ms:>9.2f} "
                      f"{row['tok_s']:>9.0f} {row['expert_gbps']:>8.0f}")
    if device.type == "cuda":
        assert dequant._TRITON_ERROR is None, dequant._TRITON_ERROR
    now = _dt.datetime.now(_dt.timezone.utc)
    result = {**result_header("batched-prefill", __file__, argv, kernel_machine(device, dequant.triton), now),
              "rows": rows}
    write_result(result, args.out, "batched-prefill", now)
    return result


if __name__ == "__main__":
    main()
