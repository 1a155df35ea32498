"""`expertdesk serve`: the local engine as an OpenAI-compatible HTTP server (see app.openai_server).

Off by default: it listens only while this command runs, on 127.0.0.1 unless told
otherwise; a non-loopback --host needs --allow-remote. It binds the port first, then
loads the model (GET /health shows the progress; chat requests get 503 until it is
ready). Ctrl+C stops it cleanly: replies in progress are cut and their clients told so.
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
                       help="require 'Authorization: Bearer KEY' on /v1/* requests (an empty KEY is an error)")
    group.add_argument("--allow-remote", action="store_true",
                       help="allow a --host other machines can reach (the model and GPU become usable by them)")
    group.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                       help="let web pages from ORIGIN (e.g. http://localhost:3000) use the server; repeatable. "
                            "Requests from any other page are refused")
    group.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                       help="also accept requests addressed to host NAME (e.g. a name in /etc/hosts); repeatable. "
                            "By default only the bound address, loopback addresses and localhost are")


def _status(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _sigterm_as_interrupt():
    """Make SIGTERM stop the server like Ctrl+C; returns the previous handler (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


def _usage_error(message: str) -> int:
    _status(f"expertdesk serve: error: {message}")
    return EXIT_USAGE


def run_serve(args: argparse.Namespace) -> int:
    """Bind, load the model, serve until Ctrl+C, then shut down the server and the engine."""
    from app.openai_server import (
        ModelLoadError,
        RemoteHostError,
        ServerEngine,
        check_api_key,
        check_host,
        check_host_name,
        create_server,
        normalize_origin,
    )
    from app.server_params import model_id

    if not 0 <= args.port <= 65535:
        return _usage_error(f"--port must be in 0..65535, got {args.port}")
    try:
        check_api_key(args.api_key)
    except ValueError as exc:
        return _usage_error(f"--api-key {str(exc).removeprefix('api_key ')}")
    for origin in args.cors_origin:
        try:
            normalize_origin(origin)
        except ValueError as exc:
            return _usage_error(f"--cors-origin: {exc}")
    for name in args.allow_host:
        try:
            check_host_name(name)
        except ValueError as exc:
            return _usage_error(f"--allow-host: {exc}")
    try:
        check_host(args.host, args.allow_remote)  # before loading anything
    except RemoteHostError as exc:
        return _usage_error(str(exc))
    try:
        engine = ServerEngine(runtime_options(args))
    except ValueError as exc:
        return _usage_error(str(exc))
    server = None
    thread = None
    try:
        try:
            server = create_server(engine, args.host, args.port, api_key=args.api_key, allow_remote=args.allow_remote,
                                   cors_origins=args.cors_origin, allowed_hosts=args.allow_host)
        except OSError as exc:
            _status(f"expertdesk serve: error: cannot listen on {args.host}:{args.port}: {exc}")
            return EXIT_FAILED
        thread = threading.Thread(target=server.serve_forever, name="expertdesk-http", daemon=True)
        thread.start()
        _status(f"[listening] {server.url} (loading the model; GET {server.url}/health shows the progress)")
        if args.allow_remote and not args.api_key:
            _status("[warning] listening beyond this machine with no --api-key: anyone who can reach "
                    f"{server.url} can use the model")
        previous = _sigterm_as_interrupt()
        try:
            engine.start_loading(args.model, progress=lambda detail: _status(f"[loading] {detail}"))
            model = None
            while model is None:  # a timeout keeps Ctrl+C deliverable to the main thread
                try:
                    model = engine.wait_loaded(0.5)
                except ModelLoadError as exc:
                    _status(f"expertdesk serve: error: {exc}")
                    return EXIT_USAGE
            label = " - a DEMO, not a real model" if model.is_demo else ""
            _status(f"[loaded] {model.model_name} ({model.architecture}, context {model.context_length}, "
                    f"{model.runs_on}){label}")
            print(f"Serving {model.model_name} as model {model_id(model)!r} at {server.url}/v1 (OpenAI-compatible; "
                  f"{'API key required' if args.api_key else 'no API key'}). Ctrl+C stops.", flush=True)
            while thread.is_alive():
                thread.join(0.5)
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
