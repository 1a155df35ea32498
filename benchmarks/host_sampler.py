"""Where the host's wall time goes: a sampling profiler of one thread's Python stack.

A decode step through the Expert Pack is bound by the host (the GPU and the emulated
drive both idle part of the time), and a deterministic profiler (cProfile) changes
what it measures: every one of the thousands of small calls a step makes pays its
hook. `StackSampler` instead wakes every `interval_s` on its own thread, reads the
target thread's current frame (`sys._current_frames`) and counts, per sample, the
innermost frame in the product's code (`engine/`, `expertpack/`, `packer/`) and the
innermost frame of any code (a wait in `threading`, a call into torch). Shares of
samples are shares of wall time, up to the sampler's own bias: it needs the GIL to
take a sample, so a thread that holds the GIL for long stretches is sampled late.
Benchmarks (`bench_real.py --sample`) put the top rows into their JSON.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = tuple(str(ROOT / part) for part in ("engine", "expertpack", "packer"))


def _where(frame) -> str:
    code = frame.f_code
    name = code.co_filename
    if name.startswith(str(ROOT)):
        name = name[len(str(ROOT)) + 1:]
    else:
        name = Path(name).name
    return f"{name}:{frame.f_lineno} {code.co_name}"


class StackSampler:
    """Samples `thread_id`'s stack (default: the thread that makes the sampler) while
    running, between `start()` and `stop()`; `table(n)` gives the top rows."""

    def __init__(self, interval_s: float = 0.0005, thread_id: int | None = None) -> None:
        self.interval_s = interval_s
        self.thread_id = threading.get_ident() if thread_id is None else thread_id
        self.samples = 0
        self.product: collections.Counter[str] = collections.Counter()
        self.leaf: collections.Counter[str] = collections.Counter()
        self.stacks: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> StackSampler:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> StackSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self.thread_id)
            if frame is None:
                continue
            self.samples += 1
            self.leaf[_where(frame)] += 1
            chain = []
            product_seen = False
            while frame is not None:
                if frame.f_code.co_filename.startswith(PRODUCT):
                    if not product_seen:
                        self.product[_where(frame)] += 1
                        product_seen = True
                    if len(chain) < 4:
                        chain.append(_where(frame))
                frame = frame.f_back
            self.stacks[" < ".join(chain)] += 1

    def table(self, n: int = 20) -> dict:
        """The top `n` of each counter as {where: share of samples}."""
        total = max(1, self.samples)

        def top(counter: collections.Counter[str]) -> dict[str, float]:
            return {k: round(v / total, 4) for k, v in counter.most_common(n)}

        return {"samples": self.samples, "interval_s": self.interval_s, "leaf": top(self.leaf),
                "product": top(self.product), "product_stacks": top(self.stacks)}


def print_table(table: dict, n: int = 12) -> None:
    print(f"host samples: {table['samples']} every {table['interval_s'] * 1e3:.1f} ms")
    for part in ("product", "leaf", "product_stacks"):
        print(f"  -- {part}")
        for where, share in list(table[part].items())[:n]:
            print(f"  {share * 100:5.1f}%  {where}")


if __name__ == "__main__":  # a self-check: a busy loop and a sleep show up as such
    def busy() -> None:
        end = time.perf_counter() + 0.2
        while time.perf_counter() < end:
            pass

    with StackSampler() as sampler:
        busy()
        time.sleep(0.2)
    print_table(sampler.table())
