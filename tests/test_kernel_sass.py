"""benchmarks/kernel_sass.py: the decode-attention kernel as the product launches it fits a
Hopper GPU's shared memory, and the MXFP4 prefill kernels' weight loads are copied ahead
asynchronously (compiled ahead of time for sm_90; needs Triton, not a GPU).

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


@pytest.mark.parametrize("role", ["gate_up", "down"])
@pytest.mark.parametrize("block_m", [16, 64])
def test_mxfp4_prefill_loads_are_pipelined_and_nothing_spills(role, block_m):
    """At the default tiles, DeepSeek-V4's widths: the main loop copies its weight (and x) tiles
    to shared memory asynchronously (LDGSTS), which the split layout exists for: the GGUF
    blocks' byte loads were not pipelined at all; no register spills; and the packed bf16
    decode takes fewer instructions per weight value than the float32 one."""
    from engine.kernels import moe_mxfp4_prefill as pf

    tiles = pf.GATE_UP_CONFIG if role == "gate_up" else pf.DOWN_CONFIG
    row = kernel_sass.prefill_row(role, tiles, block_m, asm=True)
    assert row["async_copies"] > 0 and row["spill_loads"] == row["spill_stores"] == 0, row
    plain = kernel_sass.prefill_row(role, tiles, block_m, asm=False)
    assert row["instructions_per_value"] < plain["instructions_per_value"], (row, plain)


def test_the_split_copy_loads_each_code_byte_once_and_converts_no_layout():
    """The copy into the split layout (`_split_kernel`) once took 22.4 ms a layer on an H100,
    three times the kernels it feeds: its loop shuffled bytes through a shared-memory layout
    conversion and loaded each code byte twice (189 instructions and 33 loads a block). Now:
    no shared memory, each GGUF code byte loaded once (16 a block, plus its scale), under 170
    instructions a block."""
    row = kernel_sass.split_row()
    assert row["shared_bytes"] == 0 and row["lds_sts"] == 0 and row["bar"] == 0, row
    blocks = row["loop_instructions"] / row["instructions_per_value"]
    assert row["ldg"] <= 17 * blocks, row
    assert row["instructions_per_value"] < 170, row
