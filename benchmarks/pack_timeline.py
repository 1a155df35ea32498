"""Where a pack decode step's time goes, layer by layer: a timeline of one run.

`bench_real.py --timeline` wraps the product's expert cache (never a copy of it) for
the timed pack steps and records, on the host clock:

- per step, the decode thread's time in `prefetch` calls (exact hints such as
  DeepSeek-V4's hash layers' experts at the step's start, and next-layer guesses);
- each pass of the prefetch pump (its own thread), to see how much of it falls
  between a layer's last read landing and its experts launched, where the decode
  thread needs the GIL most;
- per MoE layer: when its routed ids reached the runtime (the acquire), when each of
  its expert reads was submitted and landed (on the I/O thread), when each
  host-to-device copy was queued, and when the provider returned;
- on the GPU (timing events, CUDA only): when the layer's dense part before the
  experts was done (an event at the provider's call), when each copy ended (an event
  on the copy stream after it) and when the experts' compute was done (an event at
  the provider's return), mapped onto the host clock through one reference event.

`summary()` then reports, per transition from one MoE layer to the next (and from the
last layer to the next step's first), the medians of: the drive's idle gap (the
layer's last demand read landed -> the next layer's first read submitted) and what
fills it: the last copy's tail, the experts' compute, the dense part between the
routing points on the GPU, the host's issue time, and the wait for the router's ids.
Only the recording is added to the product's path (a clock read per event, one CUDA
event per copy and per provider call); the run's ms/token with it is reported.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch


class PackTimeline:
    """Install on a model whose provider is an `ExpertCache`; `with` scopes the recording."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache = model.experts
        self.cuda = self.cache.device.type == "cuda"
        self.events: list[tuple] = []  # (kind, step, ...) host-side records
        self._gpu: list[tuple[str, int, int, Any]] = []  # (kind, step, block, event)
        self._lock = threading.Lock()
        self.step = -1
        self._block = -1
        self._undo: list[Callable[[], None]] = []
        self._ref: Any = None
        self._t_ref = 0.0

    # -- recording ----------------------------------------------------------------------
    def _now(self) -> float:
        return time.perf_counter()

    def _gpu_mark(self, kind: str, stream: Any = None) -> None:
        if not self.cuda:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream) if stream is not None else event.record()
        self._gpu.append((kind, self.step, self._block, event))

    def _patch(self, owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        """Wrap `owner.name` for the recording; undone on exit (an attribute the instance
        had of its own is put back, else the class's shows through again)."""
        original = getattr(owner, name)
        own = vars(owner).get(name)
        setattr(owner, name, make(original))
        self._undo.append(lambda: setattr(owner, name, own) if own is not None else delattr(owner, name))

    def __enter__(self) -> PackTimeline:
        cache, store, copier = self.cache, self.cache.store, self.cache._copier
        if self.cuda:
            torch.cuda.synchronize()
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record()
            torch.cuda.synchronize()
            self._t_ref = self._now()

        def forward(original):
            def wrapped(token_ids, state):
                self.step += 1
                self.events.append(("step_start", self.step, self._now()))
                out = original(token_ids, state)
                self.events.append(("step_end", self.step, self._now()))
                return out
            return wrapped

        def routed(original):
            def wrapped(block, *args, **kwargs):
                self._block = int(block)
                self.events.append(("routed_start", self.step, self._block, self._now()))
                self._gpu_mark("dense_done")
                out = original(block, *args, **kwargs)
                self._gpu_mark("experts_done")
                self.events.append(("routed_end", self.step, self._block, self._now()))
                return out
            return wrapped

        def prefetch(original):
            def wrapped(block, expert_ids, *args, **kwargs):
                t = self._now()
                out = original(block, expert_ids, *args, **kwargs)
                exact = kwargs.get("exact", True)
                if threading.current_thread() is threading.main_thread():
                    self.events.append(("prefetch", self.step, bool(exact), t, self._now()))
                return out
            return wrapped

        def acquire(original):
            def wrapped(block, expert_ids, *args, **kwargs):
                self.events.append(("ids", self.step, int(block), self._now()))
                return original(block, expert_ids, *args, **kwargs)
            return wrapped

        def plan(original):
            def wrapped(block, expert_ids):
                out = original(block, expert_ids)
                layer_index, _layer, _ordered, loads, *_rest = out
                reads = [key for key, slot in loads if slot.host_source is None]
                self.events.append(("plan", self.step, int(block), layer_index, len(loads), reads))
                return out
            return wrapped

        def submit(original):
            def wrapped(layer_index, expert, buffer, **kwargs):
                t = self._now()
                handle = original(layer_index, expert, buffer, **kwargs)
                key = (int(layer_index), int(expert))
                step = self.step

                def landed(_future) -> None:
                    with self._lock:
                        self.events.append(("landed", step, key, self._now()))
                handle.future.add_done_callback(landed)
                self.events.append(("submit", step, key, t))
                return handle
            return wrapped

        def copy(original):
            def wrapped(dst, src, after=()):
                t = self._now()
                event = original(dst, src, after)
                up = not src.is_cuda
                self.events.append(("h2d" if up else "d2h", self.step, self._block, t))
                if up:
                    self._gpu_mark("h2d_done", copier.stream)
                return event
            return wrapped

        def pump_pass(original):
            def wrapped():
                t = self._now()
                original()
                with self._lock:
                    self.events.append(("pump", self.step, t, self._now()))
            return wrapped

        self._patch(self.model, "forward", forward)
        self._patch(cache._prefetch, "_pass", pump_pass)
        self._patch(cache, "routed", routed)
        self._patch(cache, "acquire", acquire)
        self._patch(cache, "acquire_streaming", acquire)
        self._patch(cache, "_plan", plan)
        self._patch(cache, "prefetch", prefetch)
        self._patch(store, "submit", submit)
        self._patch(copier, "copy", copy)
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        if self.cuda:
            torch.cuda.synchronize()

    # -- analysis -----------------------------------------------------------------------
    def _gpu_times(self) -> list[tuple[str, int, int, float]]:
        if not self.cuda:
            return []
        return [(kind, step, block, self._t_ref + self._ref.elapsed_time(event) / 1e3)
                for kind, step, block, event in self._gpu]

    def summary(self, skip_steps: int = 1) -> dict:
        """Medians (ms) per kind of transition between routing points; see the module docstring."""
        by_step: dict[int, dict[str, Any]] = {}

        def of(step: int) -> dict[str, Any]:
            return by_step.setdefault(step, {"blocks": {}, "submits": [], "landed": {}, "plans": {}, "pump": []})

        for e in self.events:
            kind, step = e[0], e[1]
            s = of(step)
            if kind in ("step_start", "step_end"):
                s[kind] = e[2]
            elif kind in ("routed_start", "routed_end", "ids"):
                s["blocks"].setdefault(e[2], {})[kind] = e[3]
            elif kind == "plan":
                s["plans"][e[2]] = (e[3], e[4], set(e[5]))
            elif kind == "submit":
                s["submits"].append((e[2], e[3]))
            elif kind == "landed":
                s["landed"][e[2]] = e[3]
            elif kind == "prefetch":  # the decode thread's time starting prefetches (exact hints, guesses)
                name = "prefetch_exact_host" if e[2] else "prefetch_guess_host"
                s[name] = s.get(name, 0.0) + e[4] - e[3]
            elif kind == "h2d":
                s["blocks"].setdefault(e[2], {}).setdefault("h2d_queued", []).append(e[3])
            elif kind == "pump":
                s["pump"].append((e[2], e[3]))
        for kind, step, block, t in self._gpu_times():
            b = of(step)["blocks"].setdefault(block, {})
            if kind == "h2d_done":
                b.setdefault("h2d_done", []).append(t)
            else:
                b[kind] = t

        rows: dict[str, list[float]] = {}

        def add(name: str, value: float | None, scale: float = 1e3) -> None:
            if value is not None:
                rows.setdefault(name, []).append(value * scale)

        steps = sorted(k for k in by_step if k >= skip_steps and "step_end" in by_step[k])
        for step in steps:
            s = by_step[step]
            add("step_ms", s["step_end"] - s["step_start"])
            add("prefetch_exact_host_per_step", s.get("prefetch_exact_host", 0.0))
            add("prefetch_guess_host_per_step", s.get("prefetch_guess_host", 0.0))
            blocks = sorted((b for b, v in s["blocks"].items() if "routed_start" in v),
                            key=lambda b: s["blocks"][b]["routed_start"])
            reads_by_block: dict[int, list[tuple[float, float]]] = {}
            for block in blocks:
                plan = s["plans"].get(block)
                wanted = plan[2] if plan else set()
                times = [(t, s["landed"].get(key)) for key, t in s["submits"] if key in wanted]
                reads_by_block[block] = [(a, b) for a, b in times if b is not None]
            # drive busy: the union of [submit, landed] of every read of the step (demand and guesses)
            spans = sorted((t, s["landed"][key]) for key, t in s["submits"] if key in s["landed"])
            busy, end = 0.0, float("-inf")
            for a, b in spans:
                if b > end:
                    busy += b - max(a, end)
                    end = b
            add("reads_pending_ms", busy)
            for i, block in enumerate(blocks):
                b = s["blocks"][block]
                reads = reads_by_block[block]
                nxt = s["blocks"][blocks[i + 1]] if i + 1 < len(blocks) else None
                nxt_reads = reads_by_block[blocks[i + 1]] if nxt is not None else []
                where = "last" if nxt is None else "mid"
                add(f"{where}.demand_reads_count", len(reads), scale=1.0)
                if reads:
                    first_submit = min(a for a, _ in reads)
                    last_landed = max(z for _, z in reads)
                    add(f"{where}.ids_to_first_submit", first_submit - b["ids"] if "ids" in b else None)
                    add(f"{where}.reads_span", last_landed - first_submit)
                    add(f"{where}.landed_to_routed_end_host", b["routed_end"] - last_landed)
                    # the pump thread's passes, and reads submitted (guesses), in that window
                    window = (last_landed, b["routed_end"])
                    add(f"{where}.pump_busy_landed_to_routed_end",
                        sum(max(0.0, min(z, window[1]) - max(a, window[0])) for a, z in s["pump"]))
                    add(f"{where}.submits_landed_to_routed_end",
                        sum(1 for _key, t in s["submits"] if window[0] <= t <= window[1]), scale=1.0)
                    queued = [t for t in b.get("h2d_queued", ()) if t >= last_landed]
                    # The host side of the copy that follows the last landing. Copies are
                    # counted for the block running when they were queued: with guesses queued
                    # behind the reads ("tail"), the next layer's guesses' copies count here too.
                    if queued:
                        add(f"{where}.landed_to_last_h2d_queued_host", max(queued) - last_landed)
                    if b.get("h2d_done"):
                        add(f"{where}.landed_to_last_h2d_done_gpu", max(b["h2d_done"]) - last_landed)
                    if "experts_done" in b:
                        add(f"{where}.landed_to_experts_done_gpu", b["experts_done"] - last_landed)
                    if nxt is not None and nxt_reads:
                        add("mid.drive_idle_gap", min(a for a, _ in nxt_reads) - last_landed)
                if "experts_done" in b and "dense_done" in b:
                    add(f"{where}.experts_gpu_from_dense_done", b["experts_done"] - b["dense_done"])
                add(f"{where}.routed_host", b["routed_end"] - b["routed_start"])
                if nxt is not None:
                    add("mid.host_issue_between", nxt["routed_start"] - b["routed_end"])
                    add("mid.ids_wait", nxt["ids"] - nxt["routed_start"] if "ids" in nxt else None)
                    if "experts_done" in b and "dense_done" in nxt:
                        add("mid.dense_gpu_between", nxt["dense_done"] - b["experts_done"])
                        add("mid.gpu_dense_done_lag_host", nxt["dense_done"] - nxt["routed_start"])
                else:
                    add("last.to_step_end_host", s["step_end"] - b["routed_end"])
            if blocks:
                first = s["blocks"][blocks[0]]
                add("first.step_start_to_routed_start", first["routed_start"] - s["step_start"])
                add("first.ids_wait", first["ids"] - first["routed_start"] if "ids" in first else None)
        out = {name: {"median": statistics.median(v), "mean": statistics.fmean(v), "n": len(v)}
               for name, v in sorted(rows.items())}
        return {"steps": len(steps), "ms": out}


def print_summary(summary: dict) -> None:
    print(f"pack timeline over {summary['steps']} steps (ms; medians, means):")
    for name, v in summary["ms"].items():
        print(f"  {name:42} {v['median']:9.3f} {v['mean']:9.3f}  (n={v['n']})")
