"""Benchmark GGML dequantization against the device's copy bandwidth.

For every supported type a tensor of about ``--mib`` MiB of quantized bytes
(whole rows) is dequantized repeatedly; effective bandwidth counts the bytes
read plus the bytes written.  A device-to-device copy measured in the same
run gives the ceiling, and each row reports its share of it.

    python benchmarks/bench_dequant.py                      # CUDA, 256 MiB per type
    python benchmarks/bench_dequant.py --device cpu --mib 1  # CPU smoke test

Results go to ``benchmarks/results/dequant-<hostname>-<date>.json`` or ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf.constants import GGMLQuantizationType  # noqa: E402

from benchmarks.result_file import kernel_machine, result_header  # noqa: E402
from engine.kernels import dequant  # noqa: E402

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ROW_VALUES = 4096  # a multiple of every block size; typical hidden size


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--mib", type=float, default=256.0, help="quantized MiB per tensor")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    parser.add_argument("--types", default="all",
                        help="comma-separated GGML type names (default: all supported but I32)")
    parser.add_argument("--dtypes", default="bfloat16,float32",
                        help="comma-separated output dtypes (float32, float16, bfloat16)")
    parser.add_argument("--backends", default="auto",
                        help="comma-separated: triton, torch (default: both where available)")
    parser.add_argument("--copy-mib", type=float, default=None,
                        help="size of the copy used for the ceiling (default: 4x --mib)")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/...)")
    return parser.parse_args(argv)


class _Timer:
    """Mean milliseconds per call: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, fn: Callable[[], object], warmup: int, iters: int) -> float:
        for _ in range(warmup):
            fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / iters
        begin = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - begin) * 1e3 / iters


def _copy_bandwidth(device: torch.device, nbytes: int, timer: _Timer, warmup: int, iters: int) -> float:
    """Device-to-device copy, GB/s counting bytes read plus written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), max(1, warmup), max(1, iters))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _backends(requested: str, device: torch.device) -> list[str]:
    triton_ok = dequant.triton is not None and device.type == "cuda"
    if requested == "auto":
        return (["triton"] if triton_ok else []) + ["torch"]
    names = [b.strip() for b in requested.split(",") if b.strip()]
    for name in names:
        if name not in ("triton", "torch"):
            raise SystemExit(f"unknown backend {name!r} (use triton or torch)")
        if name == "triton" and not triton_ok:
            raise SystemExit("the triton backend needs CUDA and an importable triton")
    return names


def _types(requested: str) -> list[int]:
    if requested == "all":
        return sorted(t for t in dequant.SUPPORTED_TYPES if t != GGMLQuantizationType.I32)
    return [int(GGMLQuantizationType[name.strip().upper()]) for name in requested.split(",")]


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print a table, write the JSON file and return its content."""
    args = _parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_dequant: CUDA is not available on this machine; "
                         "use --device cpu (with a small --mib) for a smoke test")
    timer = _Timer(device)
    dtypes = [_DTYPES[name.strip()] for name in args.dtypes.split(",")]
    backends = _backends(args.backends, device)

    copy_bytes = int((args.copy_mib if args.copy_mib is not None else 4 * args.mib) * 2**20)
    copy_gbps = _copy_bandwidth(device, max(copy_bytes, 1 << 16), timer, args.warmup, args.iters)

    rows = []
    header = (f"{'type':<6} {'backend':<7} {'out':<8} {'in MiB':>8} {'out MiB':>8} "
              f"{'ms':>9} {'GB/s':>8} {'% copy':>7}")
    print(f"device: {device}  copy bandwidth: {copy_gbps:.1f} GB/s (read + write)")
    print(header)
    print("-" * len(header))
    for ggml_type in _types(args.types):
        row_bytes = dequant.row_nbytes(ggml_type, _ROW_VALUES)
        n_rows = max(1, int(args.mib * 2**20) // row_bytes)
        shape = (n_rows, _ROW_VALUES)
        raw = torch.randint(0, 256, (n_rows * row_bytes,), dtype=torch.uint8, device=device)
        for backend in backends:
            os.environ["EXPERTDESK_DEQUANT_TRITON"] = "1" if backend == "triton" else "0"
            for dtype in dtypes:
                # A temporary, so that `del raw` below frees the tensor (a kept callable would hold it).
                ms = timer(functools.partial(dequant.dequantize, raw, ggml_type, shape, dtype), args.warmup, args.iters)
                in_bytes = raw.numel()
                out_bytes = n_rows * _ROW_VALUES * dtype.itemsize
                gbps = (in_bytes + out_bytes) / (ms * 1e-3) / 1e9
                row = {
                    "type": GGMLQuantizationType(ggml_type).name,
                    "type_id": ggml_type,
                    "backend": backend,
                    "out_dtype": str(dtype).removeprefix("torch."),
                    "shape": list(shape),
                    "in_mib": in_bytes / 2**20,
                    "out_mib": out_bytes / 2**20,
                    "ms": ms,
                    "gbps": gbps,
                    "pct_of_copy": 100.0 * gbps / copy_gbps,
                }
                rows.append(row)
                print(f"{row['type']:<6} {backend:<7} {row['out_dtype']:<8} {row['in_mib']:>8.1f} "
                      f"{row['out_mib']:>8.1f} {ms:>9.3f} {gbps:>8.1f} {row['pct_of_copy']:>6.1f}%")
        del raw
        if device.type == "cuda":
            torch.cuda.empty_cache()
    os.environ.pop("EXPERTDESK_DEQUANT_TRITON", None)

    now = _dt.datetime.now(_dt.timezone.utc)
    result = {
        **result_header("dequant", __file__, argv, kernel_machine(device, dequant.triton), now),
        "settings": {"mib": args.mib, "iters": args.iters, "warmup": args.warmup,
                     "row_values": _ROW_VALUES, "backends": backends,
                     "dtypes": [str(d).removeprefix("torch.") for d in dtypes]},
        "copy_bandwidth_gbps": copy_gbps,
        "copy_bytes": copy_bytes,
        "rows": rows,
    }
    out = Path(args.out) if args.out else (
        Path(__file__).resolve().parent / "results"
        / f"dequant-{socket.gethostname()}-{now.date().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
