"""The `expertdesk` command line.

With no subcommand it opens the desktop window. Every subcommand runs headless:
Qt is imported only when the window is opened, so a machine without a display
(or without PySide6) can still pack, verify and run models.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from app import __version__

# Subcommands register themselves here as (name, help, add_arguments, run).
# Names reserved for the product: pack, verify, check, logits, generate, chat, bench, serve.
Command = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def _commands() -> list[Command]:
    """All subcommands, imported lazily so `expertdesk --help` stays fast."""
    from app import cli_chat, cli_logits, cli_pack, cli_serve

    return [*cli_pack.COMMANDS, *cli_logits.COMMANDS, *cli_chat.COMMANDS, *cli_serve.COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (also used by the tests to check every --help)."""
    parser = argparse.ArgumentParser(
        prog="expertdesk",
        description=(
            "Run the largest open MoE models on one PC: routed experts stream from an "
            "SSD-backed Expert Pack into a GPU cache, exactly. With no subcommand, "
            "opens the desktop app."
        ),
    )
    parser.add_argument("--version", action="version", version=f"expertdesk {__version__}")
    parser.add_argument(
        "--install-desktop-entry",
        action="store_true",
        help="add ExpertDesk to the desktop's application menu (Linux, current user) and exit",
    )
    parser.add_argument(
        "--quit-after",
        type=float,
        metavar="SECONDS",
        help="open the window and close it after SECONDS (a smoke test of the installation)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text, add_arguments, run in _commands():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(command_parser)
        command_parser.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `expertdesk` console script and of `python -m app`."""
    args = build_parser().parse_args(argv)
    if args.install_desktop_entry:
        from app.desktop_entry import install_desktop_entry

        for path in install_desktop_entry():
            print(f"wrote {path}")
        return 0
    if args.command is None:
        from app.gui.launch import run_gui

        return run_gui(quit_after_s=args.quit_after)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
