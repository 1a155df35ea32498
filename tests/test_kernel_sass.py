"""benchmarks/kernel_sass.py: the decode-attention kernel as the product launches it fits a
Hopper GPU's shared memory (compiled ahead of time for sm_90; needs Triton, not a GPU).

DeepSeek-V4's float32 decode once fell back to torch because the float32 512-feature tiles
with 3 pipelining stages asked for 362,560 bytes of shared memory (an sm_90 block may have
232,448): this fails before a GPU run would. Skipped where Triton is not installed (CI's
CPU torch has none); `pip install triton` in a venv runs it on any x86-64 machine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import kernel_sass  # noqa: E402
from engine.kernels.decode_attention import _stages  # noqa: E402


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("picks", [False, True], ids=["hca-or-window", "csa"])
def test_decode_attention_as_launched_fits_hopper_shared_memory(dtype, picks):
    row = kernel_sass.attention_row(dtype, _stages(getattr(torch, dtype), 512), picks)
    assert row["the_product_uses"] and row["fits_hopper"], row


def test_the_check_can_fail():
    """Three stages of float32 tiles, the configuration that fell back, do not fit."""
    assert not kernel_sass.attention_row("float32", 3, False)["fits_hopper"]
