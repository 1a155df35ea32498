"""What the kernel benchmarks write the same way: the machine block and the JSON file."""

from __future__ import annotations

import datetime as dt
import json
import platform
import shlex
import socket
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def kernel_machine(device: torch.device | str, triton_module: object | None) -> dict:
    """Host, Python, torch, CUDA and Triton versions and the device (GPU name, or CPU threads)."""
    device = torch.device(device)
    info = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "triton_version": getattr(triton_module, "__version__", None),
        "device": str(device),
        "gpu_name": None,
    }
    if device.type == "cuda":
        info["gpu_name"] = torch.cuda.get_device_name(device)
        info["sm_count"] = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        info["cpu_threads"] = torch.get_num_threads()
    return info


def result_header(name: str, script: str, argv: list[str] | None, machine: dict, now: dt.datetime) -> dict:
    """What every result file starts with: the benchmark, the date, the command that ran
    (this process's, or `script` with `argv` when main() was called with arguments), the machine."""
    command = [sys.executable, *sys.argv] if argv is None else [sys.executable, script, *argv]
    return {"benchmark": name, "date": now.isoformat(timespec="seconds"), "command": shlex.join(command),
            "machine": machine}


def write_result(result: dict, out: str | Path | None, name: str, now: dt.datetime) -> Path:
    """Write `result` to `out`, or to results/<name>-<host>-<stamp>.json; print and return the path."""
    path = Path(out) if out else RESULTS / f"{name}-{socket.gethostname()}-{now.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path
