"""How much memory is free: device memory for the VRAM tier (and the batched prefill's
batches), RAM for the host tier.

Kept in one small module so tests can substitute the numbers (monkeypatch) and the
sizing rules can be checked without a GPU.
"""

from __future__ import annotations

import psutil
import torch

GIB = 1 << 30
MIB = 1 << 20


def free_device_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on `device`.

    CUDA: the driver's free memory (cudaMemGetInfo) plus what PyTorch's caching
    allocator holds but does not use. CPU: available RAM (psutil), because a "device"
    tier on the CPU is ordinary memory.
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        allocated = torch.cuda.memory_allocated(device)
        return int(free + max(0, reserved - allocated))
    return available_ram()


def available_ram() -> int:
    """RAM that can be used without swapping (psutil's `available`)."""
    return int(psutil.virtual_memory().available)


def total_ram() -> int:
    """Installed RAM in bytes."""
    return int(psutil.virtual_memory().total)


def host_safety_margin() -> int:
    """RAM left untouched by the host tier: 10% of the machine, at least 2 GiB.

    The rest of the process (dense weights, KV cache, the UI) and the OS need room;
    a host tier that pushes the machine into swap is slower than no host tier.
    """
    return max(2 * GIB, total_ram() // 10)
