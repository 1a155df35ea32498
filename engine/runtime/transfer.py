"""Host-to-device copies of expert bytes, with the ordering rules of the runtime.

CUDA: copies up (host to device) run on one dedicated stream, copies down (device
to host: the host tier's demotions) on another, so the two directions of the PCIe
link work at once (on one stream, a layer's victims going down held up its misses
coming up). Each copy is non_blocking (pinned memory) and returns an event. A slot is
handed to compute only after the compute stream waits on its copy event; before a
slot is overwritten, the copy stream waits on the events recorded when the batches
that read it were released, and on the copy down of the expert it held. A copy down
waits for the copy that filled its slot. Host buffers are reused only after their
copy event (the staging pool and host tier hold the event).

CPU: the same calls, with synchronous copies and no events (None).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch


class DeviceCopier:
    """Copies into device-tier slots of one device (see module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.is_cuda else None  # copies up
        self.down_stream = torch.cuda.Stream(device) if self.is_cuda else None  # copies down

    def copy(self, dst: torch.Tensor, src: torch.Tensor,
             after: Iterable[torch.cuda.Event | None] = ()) -> torch.cuda.Event | None:
        """Copy `src` (host) into `dst` (a slot) once every event in `after` has completed.

        Returns the copy's completion event (None on CPU, where the copy is done on return).
        """
        return self._copy(self.stream, dst, src, after)

    def copy_down(self, dst: torch.Tensor, src: torch.Tensor,
                  after: Iterable[torch.cuda.Event | None] = ()) -> torch.cuda.Event | None:
        """Copy `src` (a slot) into `dst` (host) on the copy-down stream, once every event in
        `after` has completed; its completion event (None on CPU)."""
        return self._copy(self.down_stream, dst, src, after)

    def _copy(self, stream: torch.cuda.Stream | None, dst: torch.Tensor, src: torch.Tensor,
              after: Iterable[torch.cuda.Event | None]) -> torch.cuda.Event | None:
        if not self.is_cuda:
            # A plain memcpy: torch's intra-op thread pool costs milliseconds per call on
            # small machines, more than copying an expert.
            np.copyto(dst.numpy(), src.numpy())
            return None
        assert stream is not None  # made on CUDA devices
        with torch.cuda.stream(stream):
            for event in after:
                if event is not None:
                    stream.wait_event(event)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def compute_waits_for(self, events: Iterable[torch.cuda.Event | None]) -> None:
        """Make the caller's current (compute) stream wait for these copies (GPU-side, no host
        sync). A copy the stream already waits for is skipped: a resident expert's copy was
        waited for by the first layer that used it, and every host call of the model's thread
        gives the GIL to the reader threads (each event wait did, six times a layer)."""
        if not self.is_cuda:
            return
        stream = torch.cuda.current_stream(self.device)
        handle = stream.cuda_stream
        for event in events:
            if event is None:
                continue
            # The compute streams already waiting for it: everything queued on them later is
            # ordered after it. Kept on the event itself, not in a WeakSet of events: torch's
            # Event leaves weak references dangling when it is freed (pytorch PR #183403), and
            # the garbage collector then crashed the process (segfault) on torch 2.11.
            waited_by = getattr(event, "waited_by", ())
            if handle not in waited_by:
                stream.wait_event(event)
                event.waited_by = (*waited_by, handle)  # type: ignore[attr-defined]  # once queued: others skip it

    def record_use(self) -> torch.cuda.Event | None:
        """An event on the current (compute) stream: work queued so far that reads a slot."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event


def prune_done(events: list) -> list:
    """Drop completed events (keeps per-slot event lists short)."""
    return [e for e in events if e is not None and not e.query()]
