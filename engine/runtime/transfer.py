"""Host-to-device copies of expert bytes, with the ordering rules of the runtime.

CUDA: copies run on one dedicated stream (non_blocking, from pinned memory) and each
returns an event. A slot is handed to compute only after the compute stream waits on
its copy event; before a slot is overwritten, the copy stream waits on the events
recorded when the batches that read it were released. Host buffers are reused only
after their copy event (the staging pool and host tier hold the event).

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
        self.stream = torch.cuda.Stream(device) if self.is_cuda else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor,
             after: Iterable[torch.cuda.Event] = ()) -> torch.cuda.Event | None:
        """Copy `src` (host) into `dst` (a slot) once every event in `after` has completed.

        Returns the copy's completion event (None on CPU, where the copy is done on return).
        """
        if not self.is_cuda:
            # A plain memcpy: torch's intra-op thread pool costs milliseconds per call on
            # small machines, more than copying an expert.
            np.copyto(dst.numpy(), src.numpy())
            return None
        stream = self.stream
        assert stream is not None  # made on CUDA devices
        with torch.cuda.stream(stream):
            for event in after:
                stream.wait_event(event)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def compute_waits_for(self, events: Iterable[torch.cuda.Event | None]) -> None:
        """Make the caller's current (compute) stream wait for these copies (GPU-side, no host sync)."""
        if not self.is_cuda:
            return
        stream = torch.cuda.current_stream(self.device)
        for event in events:
            if event is not None:
                stream.wait_event(event)

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
