"""Page-aligned (and, on CUDA machines, page-locked) host memory.

O_DIRECT reads need the buffer address aligned (4096 is the safe value), and
asynchronous host-to-device copies need page-locked ("pinned") memory. Both the read
staging buffers and the host-RAM expert tier are carved out of one such allocation
each (`HostSlab`), so there is one pin per tier and every slot is aligned by
construction (slot sizes are multiples of the alignment).

Memory comes from an anonymous mmap (page aligned by the kernel) and is pinned with
cudaHostRegister. Not `torch.empty(pin_memory=True)`: PyTorch's pinned allocator
rounds sizes up to a power of two, which would turn a 20 GiB host tier into 32 GiB.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections.abc import Callable

import torch

from expertpack import ALIGNMENT, align_up

from .errors import RuntimeStartError


def pinning_available() -> bool:
    """True when host memory can be page-locked for asynchronous copies (a CUDA device exists)."""
    return torch.cuda.is_available()


def aligned_host_buffer(nbytes: int, *, pinned: bool = False) -> torch.Tensor:
    """A 1-D uint8 CPU tensor of `nbytes` (rounded up to the alignment) at a page-aligned address.

    With `pinned`, the memory is page-locked for the CUDA driver (required for
    non_blocking host-to-device copies to be truly asynchronous).
    """
    size = align_up(max(int(nbytes), 1))
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    mem = mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)
    tensor = torch.frombuffer(mem, dtype=torch.uint8)  # keeps `mem` alive
    if pinned:
        if not hasattr(torch.cuda.cudart(), "cudaHostRegister"):
            # Older/odd builds without the binding: pinned allocator, over-allocated and
            # sliced to the alignment (costs the power-of-two rounding noted above).
            del tensor, mem
            raw = torch.empty(size + ALIGNMENT, dtype=torch.uint8, pin_memory=True)
            shift = (-raw.data_ptr()) % ALIGNMENT
            return raw[shift : shift + size]
        _pin(tensor)
    return tensor


def _pin(tensor: torch.Tensor) -> None:
    """Page-lock `tensor`'s memory with cudaHostRegister; unregistered when the tensor dies."""
    cudart = torch.cuda.cudart()
    ptr, size = tensor.data_ptr(), tensor.numel()
    err = cudart.cudaHostRegister(ptr, size, 0)
    code = int(getattr(err, "value", err))
    if code != 0:
        raise RuntimeStartError(
            f"could not page-lock {size / (1 << 20):.0f} MiB of host memory for expert staging "
            f"(cudaHostRegister error {code}); the system may limit locked memory "
            "(ulimit -l) or be short of RAM: lower stage_slots / host_cache_mib or raise the limit"
        )
    # Unregister when the tensor object (the owner of the whole region) is collected.
    weakref.finalize(tensor, cudart.cudaHostUnregister, ptr)


def misalignment(tensor: torch.Tensor, alignment: int = ALIGNMENT) -> int:
    """Bytes by which `tensor`'s address is off the alignment (0 = aligned)."""
    return tensor.data_ptr() % alignment


def check_buffer_aligned(tensor: torch.Tensor, what: str, alignment: int = ALIGNMENT) -> None:
    """RuntimeStartError if `tensor` cannot be an O_DIRECT target (address or size off)."""
    off = misalignment(tensor, alignment)
    if off or tensor.numel() % alignment or tensor.dtype != torch.uint8 or not tensor.is_contiguous():
        raise RuntimeStartError(
            f"{what} at address {tensor.data_ptr():#x} ({tensor.numel()} bytes) is not aligned to "
            f"{alignment} bytes (address off by {off}, size off by {tensor.numel() % alignment}); "
            "O_DIRECT reads into it would fail. This is a bug in the buffer allocation: "
            "please report it; run with --buffered-io meanwhile"
        )


class HostSlab:
    """`count` equal, aligned slots of `slot_bytes` in one host allocation."""

    def __init__(self, count: int, slot_bytes: int, *, pinned: bool, what: str = "host buffer") -> None:
        if slot_bytes % ALIGNMENT:
            raise ValueError(f"slot size {slot_bytes} is not a multiple of {ALIGNMENT}")
        self.count = int(count)
        self.slot_bytes = int(slot_bytes)
        self.pinned = pinned
        # Keep the whole allocation referenced: its lifetime is the pin's lifetime.
        self._region = aligned_host_buffer(max(self.count, 1) * self.slot_bytes, pinned=pinned)
        self.memory = self._region[: self.count * self.slot_bytes]
        self._views = [self.memory[i * slot_bytes : (i + 1) * slot_bytes] for i in range(self.count)]
        for i, view in enumerate(self._views):
            check_buffer_aligned(view, f"{what} slot {i}")

    @property
    def nbytes(self) -> int:
        return self.count * self.slot_bytes

    def view(self, index: int) -> torch.Tensor:
        """Slot `index` as a 1-D uint8 tensor of `slot_bytes`."""
        return self._views[index]


class StagingPool:
    """Aligned staging buffers for reads that have no other destination.

    A buffer handed back with a pending copy event (`give(i, after=event)`) is reused
    only once that copy has finished, so an asynchronous H2D copy never reads a buffer
    that a new SSD read is overwriting.
    """

    def __init__(self, count: int, slot_bytes: int, *, pinned: bool) -> None:
        if count < 1:
            raise RuntimeStartError(f"stage_slots is {count}; at least 1 staging buffer is needed")
        self.slab = HostSlab(count, slot_bytes, pinned=pinned, what="staging buffer")
        self._free = list(range(count))  # oldest given back first
        self._pending: dict[int, object] = {}
        self._cond = threading.Condition()

    @property
    def count(self) -> int:
        return self.slab.count

    def view(self, index: int) -> torch.Tensor:
        return self.slab.view(index)

    def try_take(self) -> int | None:
        """A free buffer index, or None if all are in use."""
        with self._cond:
            if not self._free:
                return None
            index, event = self._pick()
        _wait(event)
        return index

    def take(self, timeout: float | None = None) -> int:
        """A free buffer index, waiting for one to be given back."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout):
                raise TimeoutError("no staging buffer was given back in time")
            index, event = self._pick()
        _wait(event)
        return index

    def _pick(self) -> tuple[int, object | None]:  # under the lock, with a free buffer
        """The free buffer whose copy has finished, oldest first; else the oldest (its copy
        was queued first, so it ends first). Never the newest by default: its copy may sit
        behind compute the copy stream must wait for, and the caller would block on it."""
        position = 0
        for i, index in enumerate(self._free):
            if _done(self._pending.get(index)):
                position = i
                break
        index = self._free.pop(position)
        return index, self._pending.pop(index, None)

    def give(self, index: int, after: object | None = None) -> None:
        """Return buffer `index`; `after` is a copy event that must finish before its reuse."""
        with self._cond:
            if after is not None:
                self._pending[index] = after
            self._free.append(index)
            self._cond.notify()

    @property
    def free_count(self) -> int:
        with self._cond:
            return len(self._free)


def _done(event: object | None) -> bool:
    query: Callable[[], bool] | None = getattr(event, "query", None)
    return query is None or bool(query())


def _wait(event: object | None) -> None:
    synchronize: Callable[[], None] | None = getattr(event, "synchronize", None)
    if synchronize is not None:
        synchronize()
