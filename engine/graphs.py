"""CUDA graphs for the static-shape pieces of a one-token decode step.

A decode step on a GPU is hundreds of small kernels (the hyper-connections' Sinkhorn
alone is 80 per mix); launched one by one from Python the GPU idles between them.
`StepGraphs.run(key, fn, *tensors)` captures `fn` once per key and input shapes in a
CUDA graph and afterwards replays it: one launch for the whole piece, the same kernels
and so the same bits as running `fn` eagerly.

What may be captured: a pure function of its tensor arguments (and of weights that
never change) that makes no host sync and keeps no host state: the hyper-connection
mixes, norms, the router, the shared expert and, where the expert provider says so
(`ExpertProvider.graph_safe`), the routed experts themselves, and an attention whose
state lives in fixed-shape buffers (`deepseek4_static`): then one graph is the whole
step. A function that updates such a state names its buffers (`mutates`).

The outputs are the graph's own buffers, overwritten at the next replay of the same
key: callers use them within the step (a layer's output is the next layer's input)
and copy anything they keep. All graphs of one `StepGraphs` share one memory pool and
are captured in the order they replay (the first decode step's order), as torch
requires for that. CPU tensors, and EXPERTDESK_CUDA_GRAPHS=0, run `fn` eagerly.

Arguments are copied into the graph's own input buffers before each replay (CPU ones
too: host-to-device, queued without waiting), except an argument that is itself an
output of a captured graph (of any `StepGraphs`): its address never changes, so the
graph reads it in place. Same stream, same order, so the same values as a copy made
at replay time, without the copy's launch. Such a graph is keyed by that very tensor
and keeps it alive: if its producer is captured again (new output buffers), the
consumer is captured again too, and a stale one never replays. A producer's `reset`
retires its outputs; a consumer drops its graphs that read a retired one at its next
capture, so a consumer that never resets itself (the expert runtime's) keeps only
graphs that can still replay. CPU arguments must be pageable (the driver has copied
them when the call returns), never a pinned buffer the caller reuses. `staged` puts the
inputs that every piece of a step shares (the token, its position) in such buffers
too: copied once a step, not once per piece.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")

# Capturing costs memory (each graph keeps its outputs) and time: cap the number. A
# pack's Kimi-K3 step is (MoE layers + 1) graphs per context bucket, and graphs of a
# state's buffers that have since grown never replay again: a long conversation on the
# whole model reaches the cap. Past it, the step runs eagerly and the next one starts
# afresh (`step_begins`).
MAX_GRAPHS = 1024


# Every output tensor of a captured graph, by id (the module docstring: read in place).
_GRAPH_OUTPUTS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def graphs_enabled() -> bool:
    return os.environ.get("EXPERTDESK_CUDA_GRAPHS", "1") != "0"


def is_graph_output(t: torch.Tensor) -> bool:
    """Whether `t` is one of a captured graph's output buffers (read in place when passed on)."""
    return _GRAPH_OUTPUTS.get(id(t)) is t


def _tensors(outputs: Any) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (tuple, list)):
        return [t for o in outputs for t in _tensors(o)]
    return []


class StepGraphs:
    """Captured pieces of one model's decode step, by key (see the module docstring)."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = graphs_enabled() if enabled is None else enabled
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], Any]] = {}
        self._pool: Any = None  # torch's graph memory-pool handle, made at the first capture
        self.captures = 0
        self.replays = 0
        self.resets = 0  # times the cap dropped every graph (`step_begins`)
        self._full = False  # a capture was refused at the cap
        self._pieces = 0  # graph pieces the current step ran (replayed, captured or refused)
        self.stage_inputs = True  # `staged` copies into buffers read in place (False: as given, for A/B runs)
        self._staged: dict[tuple, torch.Tensor] = {}

    def staged(self, device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`tensors` on `device`, in buffers of this object that every graph reads in place
        (one copy each now, none per piece that reads them). Overwritten by the next call:
        for the inputs of one step. Eager runs (CPU, graphs off) get `tensors` moved to
        `device` (themselves where they are there already)."""
        if not (self.enabled and self.stage_inputs and device.type == "cuda"):
            return tuple(t.to(device, non_blocking=True) for t in tensors)
        out = []
        for i, t in enumerate(tensors):
            key = (i, t.shape, t.dtype, device)
            buffer = self._staged.get(key)
            if buffer is None:
                buffer = self._staged[key] = torch.empty(t.shape, dtype=t.dtype, device=device)
                _GRAPH_OUTPUTS[id(buffer)] = buffer
            out.append(buffer.copy_(t, non_blocking=True))
        return tuple(out)

    def run(self, key: Hashable, fn: Callable[..., T], *args: torch.Tensor,
            mutates: Sequence[torch.Tensor] = ()) -> T:
        """fn(*args), from a graph when the first argument is one token's rows on a GPU.

        `mutates`: the tensors fn updates in place (a fixed-shape attention state). The
        capture's warm-up run leaves them as they were, so that the step runs once."""
        if (not (self.enabled and args and args[0].is_cuda and args[0].shape[0] == 1)
                or torch.cuda.is_current_stream_capturing()):
            return fn(*args)
        # The buffers fn updates are baked into the graph by address: a reallocated buffer
        # (a grown state) must never replay a graph captured on the old one. Likewise the
        # other graphs' outputs it reads in place.
        full_key = (key, tuple((a.shape, a.dtype, a.device) for a in args), tuple(t.data_ptr() for t in mutates),
                    tuple(id(a) if is_graph_output(a) else None for a in args))
        self._pieces += 1
        entry = self._graphs.get(full_key)
        if entry is None:
            self._drop_retired()
            if len(self._graphs) >= MAX_GRAPHS:
                self._full = True  # eager for the rest of this step; the next one starts afresh
                return fn(*args)
            entry = self._capture(fn, args, mutates)
            self._graphs[full_key] = entry
        graph, inputs, outputs = entry
        for static, value in zip(inputs, args):
            if static is not value:
                static.copy_(value, non_blocking=True)
        graph.replay()
        self.replays += 1
        return outputs

    def _capture(self, fn: Callable[..., T], args: tuple[torch.Tensor, ...], mutates: Sequence[torch.Tensor]):
        device = args[0].device
        inputs = [a if is_graph_output(a) else torch.empty_like(a, device=device).copy_(a) for a in args]
        saved = [t.clone() for t in mutates]
        # Warm up on a side stream (library handles, Triton compiles), as torch advises.
        side = torch.cuda.Stream(device=args[0].device)
        side.wait_stream(torch.cuda.current_stream(args[0].device))
        with torch.cuda.stream(side):
            fn(*inputs)
        torch.cuda.current_stream(args[0].device).wait_stream(side)
        for tensor, before in zip(mutates, saved):
            tensor.copy_(before)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the expert runtime's I/O and copy threads keep using CUDA meanwhile.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = fn(*inputs)
        for tensor in _tensors(outputs):
            _GRAPH_OUTPUTS[id(tensor)] = tensor
        self.captures += 1
        return graph, inputs, outputs

    def step_begins(self) -> None:
        """A decode step begins. If the last one met the cap with fewer pieces than the cap
        (so most graphs were of buffers or context buckets it no longer uses), drop every
        graph: this step recaptures the ones it replays, in the order it replays them
        (which a shared pool needs). A step of more pieces than the cap keeps its graphs
        and runs the rest eagerly: recapturing every step would cost more than that."""
        if self._full and self._pieces < MAX_GRAPHS:
            self.reset()
            self.resets += 1
        self._pieces = 0

    def _drop_retired(self) -> None:
        """Drop the graphs that read in place an output its producer's `reset` retired: they
        can never replay (their key names that tensor), and they keep it alive."""
        # A key's last part names (by id) the inputs read in place; the entry holds them, so
        # no other live tensor has their ids.
        stale = [key for key, (_graph, inputs, _outputs) in self._graphs.items()
                 if any(id(t) in key[-1] and not is_graph_output(t) for t in inputs)]
        for key in stale:
            del self._graphs[key]

    def reset(self) -> None:
        """Drop every graph (their memory goes back to the allocator) and retire their
        outputs: graphs elsewhere that read them in place are dropped at their next capture."""
        for _graph, _inputs, outputs in self._graphs.values():
            for tensor in _tensors(outputs):
                if is_graph_output(tensor):
                    del _GRAPH_OUTPUTS[id(tensor)]
        self._graphs.clear()
        self._pool = None
        self._full = False
