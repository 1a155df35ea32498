"""`--endpoint URL [--api-key-env VAR] [--model ID]`: generate, chat and bench against a server.

Any OpenAI-compatible server (SGLang, vLLM, llama-server, another `expertdesk serve`)
takes the place of a pack: the same commands, the same output, through
`engine.remote.RemoteService`. The key is read from an environment variable, never from
the command line (where `ps` and shell history would show it).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any


def add_endpoint_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("remote server (in place of a model)")
    group.add_argument("--endpoint", default=None, metavar="URL",
                       help="an OpenAI-compatible server's base URL, e.g. http://gpu-box:8000/v1 (SGLang, vLLM, "
                            "llama-server, expertdesk serve); replaces PACKDIR")
    group.add_argument("--api-key-env", default=None, metavar="VAR",
                       help="read the server's API key from environment variable VAR")
    group.add_argument("--model", dest="remote_model", default=None, metavar="ID",
                       help="which of the server's models (GET /v1/models) to use; default: its first")


def model_ref(args: argparse.Namespace) -> str:
    """What to load: the pack/GGUF/demo given, or the endpoint's model ref; ValueError naming the fix."""
    from engine.remote import EndpointProblem, endpoint_ref, normalize_base_url

    endpoint = getattr(args, "endpoint", None)
    if endpoint is None:
        if getattr(args, "remote_model", None) or getattr(args, "api_key_env", None):
            raise ValueError("--model and --api-key-env go with --endpoint URL")
        if not args.model:
            raise ValueError("give a model (PACKDIR, a GGUF file or demo) or --endpoint URL")
        return str(args.model)
    if args.model:
        raise ValueError(f"give either a model ({args.model}) or --endpoint, not both")
    try:
        url = normalize_base_url(endpoint)
    except EndpointProblem as exc:
        raise ValueError(f"--endpoint: {exc.message}") from None
    return endpoint_ref(url, args.remote_model) if args.remote_model else url


def api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key-env (None without it); ValueError when that variable is unset or empty."""
    name = getattr(args, "api_key_env", None)
    if not name:
        return None
    value = os.environ.get(name, "")
    if not value:
        raise ValueError(f"--api-key-env {name}: the environment variable {name} is not set (or empty); "
                         f"export {name}=YOUR_KEY first")
    return value


def endpoint_service(args: argparse.Namespace, on_event: Callable[[Any], None]) -> Any | None:
    """A RemoteService when --endpoint was given (no /metrics polling: a command prints its own stats)."""
    if getattr(args, "endpoint", None) is None:
        return None
    from engine.remote.service import RemoteService

    return RemoteService(on_event, api_key=api_key(args), metrics_interval_s=None)


def endpoint_flags(args: argparse.Namespace) -> list[str]:
    """The flags that name the endpoint again (for the bench record's command line; never the key)."""
    flags = ["--endpoint", str(args.endpoint)]
    if args.api_key_env:
        flags += ["--api-key-env", args.api_key_env]
    if args.remote_model:
        flags += ["--model", args.remote_model]
    return flags
