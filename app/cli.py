"""The `expertdesk` command line.

With no subcommand it opens the desktop window. Every subcommand runs headless:
Qt is imported only when the window is opened, so a machine without a display
(or without PySide6) can still pack, verify and run models. Logging is configured
here, once, for every subcommand and the window (`--log-level`, `app.logging_setup`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from app import __version__
from app.logging_setup import DEFAULT_LEVEL, LEVEL_ENV, LEVELS, configure_logging

log = logging.getLogger(__name__)

# Subcommands register themselves here as (name, help, add_arguments, run).
# Names reserved for the product: pack, verify, check, logits, generate, chat, bench, serve.
Command = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def _commands() -> list[Command]:
    """All subcommands, imported lazily so `expertdesk --help` stays fast."""
    from app import cli_chat, cli_download, cli_logits, cli_pack, cli_serve

    return [*cli_pack.COMMANDS, *cli_download.COMMANDS, *cli_logits.COMMANDS, *cli_chat.COMMANDS,
            *cli_serve.COMMANDS]


def _add_log_level(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--log-level", choices=LEVELS, type=str.lower, default=default,
        help=f"how much goes to the log file and stderr (default: ${LEVEL_ENV}, else {DEFAULT_LEVEL}); "
             "the log file is expertdesk.log in the user log folder ($EXPERTDESK_LOG_DIR overrides it)",
    )


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
    _add_log_level(parser, None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text, add_arguments, run in _commands():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(command_parser)
        # Also accepted after the command (`expertdesk serve demo --log-level info`).
        _add_log_level(command_parser, argparse.SUPPRESS)
        command_parser.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `expertdesk` console script and of `python -m app`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configure_logging(args.log_level)  # the window reconfigures the same way (app.gui.launch)
    except ValueError as exc:  # a bad $EXPERTDESK_LOG_LEVEL
        parser.error(str(exc))
    log.debug("expertdesk %s: %s", __version__, " ".join(sys.argv[1:] if argv is None else argv))
    if args.install_desktop_entry:
        from app.desktop_entry import install_desktop_entry

        for path in install_desktop_entry():
            print(f"wrote {path}")
        return 0
    if args.command is None:
        from app.gui.launch import run_gui

        return run_gui(quit_after_s=args.quit_after, log_level=args.log_level)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
