"""`expertdesk serve`: the local engine as an OpenAI-compatible HTTP server (see app.openai_server).

Off by default: it listens only while this command runs, on 127.0.0.1 unless told
otherwise; a non-loopback --host needs --allow-remote. Ctrl+C stops it cleanly.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from app.cli_chat import EXIT_FAILED, EXIT_OK, EXIT_USAGE, _add_model_arguments
from app.cli_options import runtime_options


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    _add_model_arguments(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; a non-loopback address needs --allow-remote)")
    group.add_argument("--port", type=int, default=8080, help="TCP port (default 8080; 0 picks a free one)")
    group.add_argument("--api-key", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on /v1/* requests")
    group.add_argument("--allow-remote", action="store_true",
                       help="allow a --host other machines can reach (the model and GPU become usable by them)")


def _status(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _sigterm_as_interrupt():
    """Make SIGTERM stop the server like Ctrl+C; returns the previous handler (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, serve until Ctrl+C, then shut down the server and the engine."""
    from app.openai_server import ModelLoadError, RemoteHostError, ServerEngine, check_host, create_server

    if not 0 <= args.port <= 65535:
        _status(f"expertdesk serve: error: --port must be in 0..65535, got {args.port}")
        return EXIT_USAGE
    try:
        check_host(args.host, args.allow_remote)  # before loading anything
    except RemoteHostError as exc:
        _status(f"expertdesk serve: error: {exc}")
        return EXIT_USAGE
    try:
        engine = ServerEngine(runtime_options(args))
    except ValueError as exc:
        _status(f"expertdesk serve: error: {exc}")
        return EXIT_USAGE
    server = None
    thread = None
    try:
        try:
            model = engine.load(args.model, progress=lambda detail: _status(f"[loading] {detail}"))
        except ModelLoadError as exc:
            _status(f"expertdesk serve: error: {exc}")
            return EXIT_USAGE
        label = " - a DEMO, not a real model" if model.is_demo else ""
        _status(f"[loaded] {model.model_name} ({model.architecture}, context {model.context_length}, "
                f"{model.device}){label}")
        try:
            server = create_server(engine, args.host, args.port, api_key=args.api_key,
                                   allow_remote=args.allow_remote)
        except OSError as exc:
            _status(f"expertdesk serve: error: cannot listen on {args.host}:{args.port}: {exc}")
            return EXIT_FAILED
        thread = threading.Thread(target=server.serve_forever, name="expertdesk-http", daemon=True)
        thread.start()
        print(f"Serving {model.model_name} at {server.url}/v1 (OpenAI-compatible; "
              f"{'API key required' if args.api_key else 'no API key'}). Ctrl+C stops.", flush=True)
        previous = _sigterm_as_interrupt()
        try:
            while thread.is_alive():
                thread.join(0.5)  # a timeout keeps Ctrl+C deliverable to the main thread
        except KeyboardInterrupt:
            _status("\nstopping")
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        return EXIT_OK
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        engine.close()


COMMANDS = [
    ("serve", "Serve a model as an OpenAI-compatible HTTP API on 127.0.0.1 (/v1/chat/completions, /v1/models)",
     add_serve_arguments, run_serve),
]
