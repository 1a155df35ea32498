"""CUDA-event timings shared by the kernel benchmarks (bench_moe_mxfp4, bench_quant_gemv)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def events_us(fn: Callable[[], object], calls_per_fn: int, iters: int, warmup: int = 1) -> float:
    """Mean microseconds per call over `iters` calls (fn makes `calls_per_fn` of them), after a warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = max(1, iters // calls_per_fn)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls_per_fn)


def graph_us(run: Callable[[], object], calls: int, iters: int) -> float:
    """Microseconds per call of `run` (which makes `calls` calls), captured in one CUDA graph
    and replayed: what decode runs. It is compiled and warmed up on a side stream first."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    us = events_us(graph.replay, calls, iters)
    del graph
    return us


def copy_gbps(nbytes: int) -> float:
    """Device-to-device copy rate (read + write bytes per second, in GB/s) of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    return 2 * nbytes / (events_us(lambda: dst.copy_(src), 1, 20) * 1e-6) / 1e9
