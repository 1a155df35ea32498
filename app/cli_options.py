"""Command-line options shared by every command that runs a model."""

from __future__ import annotations

import argparse


def add_expert_runtime_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--cache-mib`, `--host-cache-mib` and `--buffered-io`: how a pack's experts are served."""
    parser.add_argument("--cache-mib", type=int, default=None, metavar="N",
                        help="expert cache size on the device in MiB (packs; default: free memory minus the "
                             "runtime's reserve; the demo model uses 1 MiB so its experts stream)")
    parser.add_argument("--host-cache-mib", type=int, default=None, metavar="N",
                        help="expert cache size in host RAM in MiB (packs; default 0, off)")
    parser.add_argument("--buffered-io", action="store_true",
                        help="read pack experts through the page cache instead of O_DIRECT "
                             "(for filesystems without O_DIRECT)")
