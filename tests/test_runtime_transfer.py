"""The copier's rule for compute waits (engine/runtime/transfer.py), on stand-ins for the
CUDA stream and events: a compute stream waits for each copy event once; a stream that has
not waited for it still does. The waits themselves, on a GPU: tests/test_runtime_cuda.py."""

from __future__ import annotations

import torch

from engine.runtime.transfer import DeviceCopier


class FakeStream:
    def __init__(self, handle: int, log: list) -> None:
        self.cuda_stream = handle
        self._log = log

    def wait_event(self, event) -> None:
        self._log.append((self.cuda_stream, event))


class FakeEvent:  # takes attributes, like torch.cuda.Event (a Python class)
    pass


def test_a_compute_stream_waits_for_each_copy_once(monkeypatch):
    copier = DeviceCopier(torch.device("cpu"))
    copier.is_cuda = True  # the CUDA branch, with the stream stand-ins below
    log: list = []
    current = {"handle": 1}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(current["handle"], log))
    a, b, c = FakeEvent(), FakeEvent(), FakeEvent()
    copier.compute_waits_for([a, None, b])
    copier.compute_waits_for([a, b, c])  # a resident expert's copy again, and a new one
    assert log == [(1, a), (1, b), (1, c)]
    current["handle"] = 2  # another thread's compute stream has waited for none of them
    copier.compute_waits_for([a])
    assert log[-1] == (2, a)
    copier.compute_waits_for([a, b])
    assert log[-1] == (2, b)
    # The copier keeps no event: a dropped one (a slot's next copy makes a new one) is gone.
    assert not [name for name, value in vars(copier).items() if isinstance(value, (list, dict, set, tuple))]
