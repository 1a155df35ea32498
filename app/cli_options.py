"""Command-line options shared by every command that runs a model, and the one value they make.

`add_runtime_arguments` adds `--device`, `--dtype`, `--cache-mib`, `--host-cache-mib`,
`--buffered-io` and `--verify-reads`; `runtime_options(args)` turns them into the
`engine.options.RuntimeOptions` that generate, chat, bench, serve and logits hand to the engine unchanged.
"""

from __future__ import annotations

import argparse

from engine.options import RuntimeOptions

DTYPES = ("float32", "bfloat16")


def add_runtime_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                          dtype_default: str | None = None) -> None:
    """The engine's options: where to compute, in which dtype, and how a pack's experts are served."""
    parser.add_argument("--device", default="auto",
                        help="where to compute: auto (CUDA if available, default), cpu, cuda, cuda:N")
    dtype_help = (f"activation dtype (default {dtype_default})" if dtype_default is not None
                  else "activation dtype (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--dtype", choices=DTYPES, default=dtype_default, help=dtype_help)
    parser.add_argument("--cache-mib", type=int, default=None, metavar="N",
                        help="expert cache size on the device in MiB (packs; default: free memory minus the "
                             "runtime's reserve; the demo model uses 1 MiB so its experts stream)")
    parser.add_argument("--host-cache-mib", type=int, default=None, metavar="N",
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
    return RuntimeOptions(device=args.device, dtype=args.dtype, cache_mib=args.cache_mib,
                          host_cache_mib=args.host_cache_mib, direct_io=False if args.buffered_io else None,
                          verify_reads=args.verify_reads)


def runtime_flags(options: RuntimeOptions) -> list[str]:
    """The command-line flags that give `options` back (those not at their defaults)."""
    flags: list[str] = []
    for flag, value in (("--device", None if options.device == "auto" else options.device),
                        ("--dtype", options.dtype), ("--cache-mib", options.cache_mib),
                        ("--host-cache-mib", options.host_cache_mib)):
        if value is not None:
            flags += [flag, str(value)]
    if options.direct_io is False:
        flags.append("--buffered-io")
    if options.verify_reads:
        flags.append("--verify-reads")
    return flags
