"""CUDA-event timings shared by the kernel benchmarks (bench_moe_mxfp4, bench_quant_gemv)."""

from __future__ import annotations

import time
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


def pcie_gbps(nbytes: int = 256 << 20, reps: int = 8) -> dict[str, float]:
    """The machine's pinned host<->device copy rates, GB/s: up ("h2d"), down ("d2h"), and
    up + down at once on two streams ("duplex", the sum of both directions), the PCIe
    ceilings of the pack's copies. Machines lent for a session differ here, so each pack
    row is read against the rate measured in its own run."""
    host_up = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    host_down = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_up = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_down = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(2)
    up, down = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(directions: tuple[str, ...]) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            if "up" in directions:
                with torch.cuda.stream(up):
                    dev_up.copy_(host_up, non_blocking=True)
            if "down" in directions:
                with torch.cuda.stream(down):
                    host_down.copy_(dev_down, non_blocking=True)
        torch.cuda.synchronize()
        return len(directions) * reps * nbytes / (time.perf_counter() - t) / 1e9

    timed(("up", "down"))  # warm-up
    return {"h2d": timed(("up",)), "d2h": timed(("down",)), "duplex": timed(("up", "down"))}
