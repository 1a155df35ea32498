"""`expertdesk pack`, `verify` and `check`: build, verify and preflight Expert Packs headless.

Each command returns an exit status: 0 success, 1 problems found (verify/check),
2 an error the user must fix (printed as one line on stderr, no traceback),
130 cancelled with Ctrl+C.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from packer.diskio import format_bytes, format_duration

EXIT_OK, EXIT_PROBLEMS, EXIT_ERROR, EXIT_CANCELLED = 0, 1, 2, 130


class ProgressBar:
    """A one-line progress bar on a terminal stream: bar, bytes, rate, ETA, phase.

    Redraws at most a few times a second; on a non-terminal stream it prints a plain
    line every few seconds instead, so logs stay readable.
    """

    def __init__(self, stream: TextIO | None = None, width: int = 28, interval: float = 0.2) -> None:
        self.stream = stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = stream.isatty()
        self.interval = interval if self.tty else 5.0
        self._last = 0.0
        self._drawn = False

    def __call__(self, done: int, total: int, rate: float, eta: float, phase: str) -> None:
        now = time.monotonic()
        if now - self._last < self.interval and done < total:
            return
        self._last = now
        frac = done / total if total else 1.0
        filled = int(frac * self.width)
        line = (
            f"[{'#' * filled}{'.' * (self.width - filled)}] {frac * 100:5.1f}% "
            f"{format_bytes(done)}/{format_bytes(total)} {format_bytes(rate)}/s ETA {format_duration(eta)}  {phase}"
        )
        if self.tty:
            self.stream.write("\r\x1b[K" + line)
            self._drawn = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def run_with_ctrl_c(work: Callable[[], Any], cancel: threading.Event, bar: ProgressBar, cancelling: str,
                    name: str) -> tuple[Any, BaseException | None]:
    """Run `work()` on a thread so Ctrl+C in the main thread sets `cancel` and waits for a clean
    stop; (its result, the exception it raised or None)."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # handed to the main thread
            outcome["error"] = exc

    worker = threading.Thread(target=target, name=name, daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.2)
    except KeyboardInterrupt:
        cancel.set()
        bar.close()
        print(cancelling, file=sys.stderr)
        worker.join()
    bar.close()
    return outcome.get("value"), outcome.get("error")


def _user_errors() -> tuple[type[BaseException], ...]:
    from expertpack import PackError
    from packer.errors import PackBuildError
    from packer.gguf_source import GGUFFormatError

    return (GGUFFormatError, PackError, PackBuildError, FileNotFoundError)


def _guarded(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Print a user error as one line and exit 2 (no traceback for things the user must fix)."""

    def wrapper(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except _user_errors() as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_ERROR

    wrapper.__name__ = run.__name__
    wrapper.__doc__ = run.__doc__
    return wrapper


def _usage(message: str) -> int:
    """An argument the user must change: one line naming it, exit status 2."""
    print(f"expertdesk {message}", file=sys.stderr)
    return EXIT_ERROR


#: preflight's check names (the JSON keys) as the text report words them
CHECK_LABELS = {"direct_io": "O_DIRECT", "free_space": "free space", "vram": "VRAM", "ram": "RAM"}


def recommended_flags(recommended: dict[str, int]) -> str:
    """Preflight's recommended cache sizes as the options that set them (`--cache-mib N ...`)."""
    parts = []
    if "cache_vram_mib" in recommended:
        parts.append(f"--cache-mib {recommended['cache_vram_mib']}")
    if "host_cache_mib" in recommended:
        parts.append(f"--host-cache-mib {recommended['host_cache_mib']}")
    text = " ".join(parts) or "no cache sizes (nothing measured)"
    reserve = recommended.get("cache_vram_reserve_mib")
    if reserve:
        text += f" (keeps {reserve} MiB of VRAM free for the model's working memory)"
    return text


# --- pack --------------------------------------------------------------------------------


def _add_pack(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="SRC", help="the model: a .gguf file or any shard of a split set")
    p.add_argument("--out", required=True, metavar="PACKDIR",
                   help="pack directory (NAME.expertpack) or a folder to create MODEL.expertpack in")
    p.add_argument("--delete-source", action="store_true",
                   help="delete the source GGUF file(s) after the pack passed a full verification")
    p.add_argument("--overwrite", action="store_true", help="replace an existing pack at the target")
    p.add_argument("--buffered", action="store_true",
                   help="write with the page cache instead of O_DIRECT (for filesystems without O_DIRECT)")


@_guarded
def _run_pack(args: argparse.Namespace) -> int:
    """Build the pack in a worker thread so Ctrl+C in the main thread cancels cleanly."""
    from packer.builder import pack_path_for

    if Path(args.source).is_dir():
        return _usage(f"pack: SRC {args.source} is a folder; give the model's .gguf file (any shard of a split set)")
    target = pack_path_for(args.source, args.out)
    blocker = next((p for p in target.parents if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        return _usage(f"pack: --out {args.out}: {blocker} is a file, not a folder; give a folder for the pack")
    folder_missing = not target.parent.exists()  # the builder creates it once the source checks out
    try:
        return _build(args)
    finally:
        if folder_missing and target.parent.is_dir():
            print(f"created folder {target.parent} for the pack", file=sys.stderr)


def _build(args: argparse.Namespace) -> int:
    from packer.builder import BuildCancelled, PackBuilder

    cancel = threading.Event()
    bar = ProgressBar()
    builder = PackBuilder(
        args.source, args.out, progress=bar, cancel=cancel, delete_source=args.delete_source,
        direct_io=False if args.buffered else "auto", overwrite=args.overwrite,
    )
    path, error = run_with_ctrl_c(builder.run, cancel, bar, "cancelling (finishing the blocks in flight)...",
                                  "expertdesk-pack")
    outcome = {"path": path}
    if isinstance(error, BuildCancelled):
        print(f"cancelled: {error}", file=sys.stderr)
        return EXIT_CANCELLED
    if error is not None:
        raise error
    s = builder.stats
    rate = s.bytes_copied / s.phases["experts"] if s.phases.get("experts") else 0.0
    print(
        f"packed {outcome['path']} ({format_bytes(s.pack_bytes)} from {format_bytes(s.source_bytes)}) in "
        f"{format_duration(s.seconds)}; experts at {format_bytes(rate)}/s, "
        f"{'O_DIRECT' if s.direct_io else 'buffered'} writes, {s.verified} verify"
        + (f", resumed {s.layers_resumed} layers" if s.layers_resumed else "")
        + ("; source deleted" if s.source_deleted else ""),
    )
    return EXIT_OK


# --- verify ------------------------------------------------------------------------------


def _add_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("pack", metavar="PACKDIR", help="the pack directory (NAME.expertpack)")
    p.add_argument("--quick", action="store_true",
                   help="check the files, experts.bin's header and layout, the hashes, the dense file's fixed "
                        "samples and config, and a fixed sample of expert slices, instead of every byte")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")


@_guarded
def _run_verify(args: argparse.Namespace) -> int:
    """Verify a pack; exit 0 when it is intact, 1 when problems were found."""
    from packer.verify import verify_pack

    pack = Path(args.pack)
    if pack.is_file():
        hint = (f"build one with `expertdesk pack {pack} --out FOLDER`, then verify FOLDER/NAME.expertpack"
                if pack.name.lower().endswith(".gguf") else "give the pack's folder (NAME.expertpack)")
        return _usage(f"verify: PACKDIR {pack} is a file, not an Expert Pack folder; {hint}")
    if not pack.exists():
        return _usage(f"verify: PACKDIR {pack} does not exist; give an Expert Pack folder (NAME.expertpack), "
                      "e.g. one `expertdesk pack` built")
    bar = None if args.json else ProgressBar()
    try:
        report = verify_pack(args.pack, quick=args.quick, progress=bar)
    finally:
        if bar:
            bar.close()
    if args.json:
        import json

        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(report.summary())
        for p in report.problems:
            print(f"  {p.kind}: {p.message}")
        if report.problems_omitted:
            print(f"  ... and {report.problems_omitted} more")
    return EXIT_OK if report.ok else EXIT_PROBLEMS


# --- check -------------------------------------------------------------------------------


def _add_check(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="the folder the pack will go in (or is in)")
    p.add_argument("--source", metavar="GGUF", help="the model to size the pack from")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    from app.cli_options import DTYPES

    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="the activation dtype the memory plan counts (default: bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--decode-dtype", choices=DTYPES, default=None,
                   help="the decode steps' and KV state's dtype the memory plan counts (default: as --dtype)")


@_guarded
def _run_check(args: argparse.Namespace) -> int:
    """Preflight checks; exit 0 when nothing failed (warnings allowed), 1 otherwise."""
    from packer.preflight import run_preflight

    folder = Path(args.dir)
    if folder.is_file():
        return _usage(f"check: DIR {folder} is a file; give the folder the pack will go in (it may not exist yet)"
                      + (f", and the model as --source {folder}" if folder.name.lower().endswith(".gguf") else ""))
    if args.source is not None and not Path(args.source).is_file():
        what = "a folder" if Path(args.source).is_dir() else "not there"
        return _usage(f"check: --source {args.source} is {what}; give the model's .gguf file (any shard)")
    report = run_preflight(args.dir, args.source)
    plan, plan_problem = (_memory_plan(report.measurements, args.source, args.dtype, args.decode_dtype)
                          if args.source else (None, None))
    if args.json:
        data = json.loads(report.to_json())
        if plan is not None or plan_problem:
            data["memory_plan"] = plan.to_dict() if plan is not None else {"error": plan_problem}
        print(json.dumps(data, indent=1))
    else:
        for c in report.checks:
            print(f"{c.status.upper():4}  {CHECK_LABELS.get(c.name, c.name)}: {c.reason}")
            if c.fix and c.status != "pass":
                print(f"      fix: {c.fix}")
        print(f"recommended: {recommended_flags(report.recommended)}")
        if plan is not None:
            print("memory plan (engine.memory_plan; used when --cache-mib is not given):\n" + plan.bars())
        elif plan_problem:
            print(f"FAIL  memory plan: {plan_problem}")
    return EXIT_OK if report.ok and plan_problem is None else EXIT_PROBLEMS


def _memory_plan(measured: dict[str, Any], source: str, dtype: str | None = None,
                 decode_dtype: str | None = None) -> tuple[Any, str | None]:
    """(the memory plan of the checked model on this machine, in these dtypes, None), (None,
    why none fits), or (None, None) when the file's metadata is not a model the engine can
    run (the pack checks above still apply)."""
    from app.memory_plan_source import plan_for_gguf
    from engine.memory_plan import MemoryPlanError
    from engine.models import ModelConfigError
    from engine.options import RuntimeOptions

    try:
        return plan_for_gguf(source, measured, options=RuntimeOptions(dtype=dtype, decode_dtype=decode_dtype)), None
    except MemoryPlanError as exc:
        return None, str(exc)
    except ModelConfigError as exc:
        print(f"note: no memory plan: {exc}", file=sys.stderr)
        return None, None


COMMANDS = [
    ("pack", "build an Expert Pack from a GGUF model (resumes an interrupted build)", _add_pack, _run_pack),
    ("verify", "verify an Expert Pack (structure, layout, dense file, SHA-256 of every slice)", _add_verify,
     _run_verify),
    ("check", "preflight a folder and this machine: O_DIRECT, free space, VRAM, RAM, cache sizes",
     _add_check, _run_check),
]
