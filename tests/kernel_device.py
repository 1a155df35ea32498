"""Where the small Triton kernel families (norm_rope, hyper_connection) can be tested.

On CUDA with Triton; or, with no GPU, under Triton's interpreter (`TRITON_INTERPRET=1
pytest ...` with triton installed), which runs the same kernels on CPU tensors.
Otherwise their kernel tests are skipped and only the dispatch (the torch path) runs.
"""

from __future__ import annotations

import os

import pytest
import torch

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if HAS_TRITON and torch.cuda.is_available() and not INTERPRET:
    KERNEL_DEVICE: str | None = "cuda"
elif HAS_TRITON and INTERPRET:
    KERNEL_DEVICE = "cpu"
else:
    KERNEL_DEVICE = None

needs_kernels = pytest.mark.skipif(
    KERNEL_DEVICE is None, reason="needs CUDA and Triton, or Triton with TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(KERNEL_DEVICE != "cuda", reason="needs CUDA and Triton")  # a real GPU
# Triton's interpreter casts float32 to bfloat16 by truncation (the GPU rounds to nearest
# even), so rounding-exact bfloat16 checks run on CUDA only.
needs_rounding_bf16 = pytest.mark.skipif(INTERPRET, reason="the Triton interpreter truncates float32 -> bf16")
# It also multiplies bfloat16 tiles in tl.dot as their raw 16-bit integers (a 16 x 16 product
# of randn values comes out ~1e10), so kernels with bf16 dot products run bf16 on CUDA only.
needs_bf16_dot = pytest.mark.skipif(INTERPRET, reason="the Triton interpreter's tl.dot misreads bfloat16")
EPS32 = 2.0 ** -24  # unit roundoff of float32
U_BF16 = 2.0 ** -8  # unit roundoff of bfloat16 (8 significant bits)
U_F16 = 2.0 ** -11  # unit roundoff of float16 (11 significant bits)


def break_launches(monkeypatch, module, error: Exception | None = None) -> None:
    """Make `module`'s kernel launch raise (a GPU its compiler cannot target), with its
    family's switch not yet tripped: the next call must warn once and fall back."""
    def broken(*args, **kwargs):
        raise error if error is not None else RuntimeError("no compiler")

    monkeypatch.setattr(module, "_launch", broken)
    monkeypatch.setattr(module.SWITCH, "error", None)


def falls_back_once(monkeypatch, module, call, warning: str):
    """With `module`'s launch broken (`break_launches`): call() warns `warning` once and returns
    the reference's result, and a second call, the family now off, warns no more. Returns the
    first call's result (each caller checks it against its reference)."""
    import warnings

    break_launches(monkeypatch, module)
    with pytest.warns(RuntimeWarning, match=warning):
        got = call()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the family is off now: no second warning
        call()
    return got


def count_launches(monkeypatch, module) -> list:
    """Record each launch of `module`'s kernel (its `_launch`). A test that compares a kernel
    with its reference checks the kernel ran: a silent fallback would compare the reference
    with itself."""
    calls: list = []
    real = module._launch

    def launch(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "_launch", launch)
    return calls
