"""When a family of Triton kernels runs, and what happens when one cannot.

Each family (`norm_rope`, `hyper_connection`, `routing`, `kda`, `attn_res`, `activation`,
the MXFP4 expert kernels of `moe_mxfp4` and `moe_mxfp4_prefill`, ...) has a torch reference that is also the CPU path.
Its kernels run on CUDA tensors when Triton is installed and the family's environment
switch is not "0"; with TRITON_INTERPRET=1 they also run on CPU tensors
(Triton's interpreter: how the tests check their arithmetic without a GPU). If a kernel
cannot compile or launch (no usable compiler for this GPU, say), the family warns once,
returns the reference's result and stays off for the rest of the process.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

try:
    import triton
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None

T = TypeVar("T")

__all__ = ["TritonSwitch"]


class TritonSwitch:
    """On/off state of one kernel family (module docstring)."""

    def __init__(self, env: str, what: str, instead: str = "the slower torch path") -> None:
        self.env = env
        self.what = what
        self.instead = instead  # what the warning says runs when the family is off
        self.error: Exception | None = None

    def available(self, x: torch.Tensor) -> bool:
        """Whether the family's kernels can run on `x`'s device (its switch aside)."""
        if triton is None or self.error is not None:
            return False
        return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")

    def applies(self, x: torch.Tensor) -> bool:
        """Whether the family's kernels may run on `x`'s device now: available and not
        switched off."""
        return os.environ.get(self.env, "1") != "0" and self.available(x)

    def run(self, device: torch.device, launch: Callable[[], T], fallback: Callable[[], T]) -> T:
        """launch() on `device` (Triton launches on the current CUDA device); on failure, warn
        once, switch the family off and return fallback()."""
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                return launch()
        except Exception as exc:
            self.error = exc
            warnings.warn(f"{self.what} kernels unavailable ({exc!r}); using {self.instead} "
                          f"(set {self.env}=0 to silence this)", RuntimeWarning, stacklevel=3)
            return fallback()
