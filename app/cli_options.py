"""Command-line options shared by every command that runs a model, and the one value they make.

`add_runtime_arguments` adds `--device`, `--dtype`, `--decode-dtype`, `--cache-mib`, `--host-cache-mib`,
`--buffered-io` and `--verify-reads`; `runtime_options(args)` turns them into the
`engine.options.RuntimeOptions` that generate, chat, bench, serve and logits hand to the engine unchanged.
"""

from __future__ import annotations

import argparse
import re

from app.cli_paths import output_file
from engine.options import RuntimeOptions

DTYPES = ("float32", "bfloat16")
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def device_arg(text: str) -> str:
    """`--device`'s value, checked for its form here (whether this machine has it: the engine)."""
    name = text.strip().lower()
    if not _DEVICE.fullmatch(name):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device ExpertDesk can use: give auto, cpu, cuda or "
                                         "cuda:N (N = the GPU's number, from 0)")
    return name


def mib_arg(text: str) -> int:
    """A cache size in MiB: a whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of MiB, e.g. 4096") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: give 0 or more MiB")
    return value


def add_runtime_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                          dtype_default: str | None = None) -> None:
    """The engine's options: where to compute, in which dtype, and how a pack's experts are served."""
    parser.add_argument("--device", default="auto", type=device_arg,
                        help="where to compute: auto (CUDA if available, default), cpu, cuda, cuda:N")
    dtype_help = (f"activation dtype (default {dtype_default})" if dtype_default is not None
                  else "activation dtype (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--dtype", choices=DTYPES, default=dtype_default, help=dtype_help)
    parser.add_argument("--decode-dtype", choices=DTYPES, default=None,
                        help="dtype of decode steps and of the KV state (default: as --dtype); "
                             "--dtype bfloat16 --decode-dtype float32 prefills on bf16 tensor cores and "
                             "decodes in float32, closer to a float32 run")
    parser.add_argument("--cache-mib", type=mib_arg, default=None, metavar="N",
                        help="expert cache size on the device in MiB (packs; default: free memory minus the "
                             "runtime's reserve; the demo model uses 1 MiB so its experts stream)")
    parser.add_argument("--host-cache-mib", type=mib_arg, default=None, metavar="N",
                        help="expert cache size in host RAM in MiB (packs; default 0, off)")
    parser.add_argument("--buffered-io", action="store_true",
                        help="read pack experts through the page cache instead of O_DIRECT "
                             "(for filesystems without O_DIRECT)")
    parser.add_argument("--verify-reads", action="store_true",
                        help="check every expert block read from the drive against the pack's SHA-256 "
                             "(packs; a mismatch is an error and is never cached; costs CPU time per byte read)")


def runtime_options(args: argparse.Namespace) -> RuntimeOptions:
    """The RuntimeOptions of the flags `add_runtime_arguments` added (not yet checked: the
    engine raises ValueError for a device or dtype this machine cannot use)."""
    return RuntimeOptions(device=args.device, dtype=args.dtype, decode_dtype=args.decode_dtype,
                          cache_mib=args.cache_mib,
                          host_cache_mib=args.host_cache_mib, direct_io=False if args.buffered_io else None,
                          trace_file=_trace_file(args),
                          verify_reads=args.verify_reads)


def runtime_flags(options: RuntimeOptions) -> list[str]:
    """The command-line flags that give `options` back (those not at their defaults)."""
    flags: list[str] = []
    for flag, value in (("--device", None if options.device == "auto" else options.device),
                        ("--dtype", options.dtype), ("--decode-dtype", options.decode_dtype),
                        ("--cache-mib", options.cache_mib),
                        ("--host-cache-mib", options.host_cache_mib)):
        if value is not None:
            flags += [flag, str(value)]
    if options.direct_io is False:
        flags.append("--buffered-io")
    if options.verify_reads:
        flags.append("--verify-reads")
    return flags


def _trace_file(args: argparse.Namespace) -> str | None:
    """`--trace FILE` (generate, chat), checked before the model loads (UsageError otherwise)."""
    given = getattr(args, "trace", None)
    return None if given is None else str(output_file(given, option="--trace", default_name="trace.npz"))
