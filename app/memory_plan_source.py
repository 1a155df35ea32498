"""The memory plan of a GGUF model not loaded yet, from what preflight measured.

Why here: `expertdesk check --source` and the setup wizard's checks page show the same
plan (engine.memory_plan) for the model the user chose, on the machine preflight just
probed (free VRAM, available RAM); both call `plan_for_gguf` so the numbers agree.
It reads the GGUF's metadata (I/O): call it off the GUI thread.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from engine.memory_plan import MemoryPlan, MemoryPlanError, plan_for_source
from engine.models import ModelConfigError
from packer.preflight import FAIL, Check

if TYPE_CHECKING:
    from engine.options import RuntimeOptions


def plan_for_gguf(source: str | os.PathLike, measured: dict[str, Any],
                  context_tokens: int | None = None, options: RuntimeOptions | None = None) -> MemoryPlan:
    """The plan for the GGUF at `source` with preflight's `measured` machine and model
    sizes (``PreflightReport.measurements``: "model", "gpu", "ram"), in the dtypes
    `options` will run it in (`plan_for_source`). Raises
    MemoryPlanError (nothing fits, with the numbers) or ModelConfigError (the metadata
    is not a model the engine runs)."""
    from packer.gguf_source import GGUFSource

    sizes, gpu, ram = measured["model"], measured.get("gpu"), measured["ram"]
    with GGUFSource.open(source) as src:
        return plan_for_source(
            src.metadata, list(src.tensors), dense_bytes=sizes["dense_bytes"],
            expert_bytes=sizes["expert_block_bytes"], top_k=sizes["top_k"],
            expert_count=sizes["moe_layers"] * sizes["num_experts"],
            gpu_free=gpu["free_bytes"] if gpu else None, gpu_total=gpu["total_bytes"] if gpu else None,
            ram_available=ram["available_bytes"], ram_total=ram["total_bytes"], context_tokens=context_tokens,
            options=options)


def plan_or_check(source: str | os.PathLike, measured: dict[str, Any],
                  options: RuntimeOptions | None = None) -> tuple[MemoryPlan | None, Check | None]:
    """(the plan, None) for the wizard's checks page, or (None, a failed "memory_plan"
    Check carrying the plan's error and its numbers) when nothing fits; (None, None)
    when the model's metadata gives no plan (the pack checks still apply)."""
    if "model" not in measured or "ram" not in measured:
        return None, None
    try:
        return plan_for_gguf(source, measured, options=options), None
    except MemoryPlanError as exc:
        return None, Check("memory_plan", FAIL, str(exc),
                           "use a machine with more free memory, close programs that hold GPU memory or RAM, "
                           "or choose a smaller model")
    except ModelConfigError:
        return None, None
