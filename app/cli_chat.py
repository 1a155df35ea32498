"""`expertdesk generate`, `chat` and `bench`: the chat engine (EngineService) from a terminal.

All three run the same EngineService the desktop app uses, so what they print is what
the app would show. The model is an Expert Pack folder, a GGUF file, or the word
`demo` (the built-in tiny demo model, built on first use).

Events arrive on the engine's worker thread; they are put on a queue and printed by
the main thread, which also handles Ctrl+C (it must stay responsive to signals).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from app.cli_options import add_runtime_arguments, runtime_flags, runtime_options
from app.cli_paths import output_file, write_atomically

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
STATS_NAME = "stats.json"  # generate --stats-json FOLDER writes this file in it


# --------------------------------------------------------------------------- arguments

def _add_model_arguments(parser: argparse.ArgumentParser, *, endpoint: bool = False) -> None:
    """The model positional and the engine's options; with `endpoint`, --endpoint may replace the model."""
    parser.add_argument("model", metavar="PACKDIR|GGUF|demo", nargs="?" if endpoint else None,
                        help="an Expert Pack folder, a GGUF file, or `demo` for the built-in tiny demo model"
                             + (" (or --endpoint URL: a model on a server)" if endpoint else ""))
    add_runtime_arguments(parser.add_argument_group("engine"))
    if endpoint:
        from app.remote_cli import add_endpoint_arguments

        add_endpoint_arguments(parser)


def _add_sampling_arguments(parser: argparse.ArgumentParser, *, max_tokens_default: int | None = None) -> None:
    group = parser.add_argument_group("sampling (defaults: temperature 0.7, top-p 0.95, top-k 40, min-p 0.05)")
    group.add_argument("--temperature", type=float, default=None, help="0 = greedy (always the most likely token)")
    group.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass, 1 = off")
    group.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens, 0 = off")
    group.add_argument("--min-p", type=float, default=None, help="drop tokens below min-p x the top probability")
    group.add_argument("--repeat-penalty", type=float, default=None, help="repetition penalty, 1 = off")
    group.add_argument("--max-tokens", type=int, default=max_tokens_default, help="most tokens in a reply")
    group.add_argument("--seed", type=int, default=None, help="random seed (reproducible sampling)")
    group.add_argument("--stop", action="append", default=None, metavar="TEXT",
                       help="stop when TEXT appears (repeatable); TEXT is not printed")
    group.add_argument("--think", dest="think", action=argparse.BooleanOptionalAction, default=None,
                       help="switch the model's reasoning on (--think) or off (--no-think); default: the model's")


def _sampling(args: argparse.Namespace, **fixed: Any):
    from engine.text import SamplingParams

    values = {
        "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
        "repetition_penalty": args.repeat_penalty, "max_tokens": args.max_tokens, "seed": args.seed,
        "stop": tuple(args.stop) if args.stop else None,
    }
    values.update(fixed)
    return SamplingParams(**{k: v for k, v in values.items() if v is not None})


# --------------------------------------------------------------------------- the engine from a terminal

class TerminalEngine:
    """An EngineService whose events are handed to the main thread through a queue."""

    def __init__(self, args: argparse.Namespace, *, status: Callable[[str], None] | None = None) -> None:
        from app.remote_cli import endpoint_service, model_ref
        from engine.service import EngineService

        self.events: queue.Queue = queue.Queue()
        self.status = status or (lambda line: print(line, file=sys.stderr, flush=True))
        self.ref = model_ref(args)  # what load() gets: the model, or the --endpoint server's (ValueError if unclear)
        self.service = endpoint_service(args, self.events.put) or EngineService(self.events.put, runtime_options(args))
        self.model = None

    def load(self, ref: str) -> bool:
        """Load the model, printing progress; False (after printing why) if it failed."""
        from engine.service_events import ErrorEvent, ModelLoadedEvent, PhaseEvent

        self.service.load(ref)
        while True:
            event = self.events.get()
            if isinstance(event, PhaseEvent) and event.phase == "loading" and event.detail:
                self.status(f"[loading] {event.detail}")
            elif isinstance(event, ModelLoadedEvent):
                self.model = event
                label = " - a DEMO, not a real model" if event.is_demo else ""
                self.status(f"[loaded] {event.model_name} ({event.architecture}, context {event.context_length}, "
                            f"{event.runs_on}){label}")
            elif isinstance(event, ErrorEvent):
                self.status(f"expertdesk: error ({event.kind}): {event.message}")
            elif isinstance(event, PhaseEvent) and event.phase == "idle":
                return self.model is not None

    def run_request(self, request, on_text: Callable[[str, bool], None]):
        """Submit `request` and stream its text to on_text(text, reasoning) until it ends.

        Returns the DoneEvent or ErrorEvent. The first Ctrl+C cancels the reply (it ends
        with stop reason "cancelled"); a second one raises KeyboardInterrupt.
        """
        from engine.service_events import DoneEvent, ErrorEvent, PhaseEvent, TokenEvent

        rid = self.service.submit(request)
        result = None
        cancelling = False
        while True:
            try:
                event = self.events.get(timeout=0.1)  # a timeout keeps Ctrl+C deliverable
            except queue.Empty:
                continue
            except KeyboardInterrupt:
                if cancelling:
                    raise
                cancelling = True
                self.service.cancel(rid)
                self.status("\n[stopping - press Ctrl+C again to quit]")
                continue
            if getattr(event, "request_id", rid) != rid:
                continue
            if isinstance(event, TokenEvent):
                on_text(event.text, event.reasoning)
            elif isinstance(event, (DoneEvent, ErrorEvent)):
                result = event
            elif isinstance(event, PhaseEvent) and event.phase == "idle":
                return result

    def close(self) -> None:
        self.service.shutdown()


def _rate(value: float, measured: bool, digits: int) -> str:
    """A tokens/s figure, or "n/a" when there was no interval to measure it over."""
    return f"{value:.{digits}f} tok/s" if measured else "n/a"


def _stats_line(stats) -> str:
    # Decode speed needs two generated tokens (one interval); prefill needs a token that ran.
    decode = _rate(stats.decode_tok_s, stats.completion_tokens > 1 and stats.decode_tok_s > 0, 2)
    prefill = _rate(stats.prefill_tok_s, stats.prefill_tok_s > 0, 1)
    return (f"[{stats.prompt_tokens} prompt + {stats.completion_tokens} tokens, ttft {stats.ttft_s:.2f} s, "
            f"prefill {prefill}, decode {decode}, "
            f"hit rate {_known(stats.hit_rate, '.1%')}, SSD {_known(stats.ssd_gb_per_token * 1000, '.2f')} MB/token, "
            f"stop: {stats.stop_reason}]")


def _known(value: float | None, spec: str) -> str:
    """`value` formatted, or "n/a" when it is not known (None or NaN: a server does not report it)."""
    return "n/a" if value is None or value != value else format(value, spec)


def _stats_dict(stats) -> dict:
    """The stats as JSON values: a quantity the model's server does not report (NaN) is null."""
    from dataclasses import asdict

    return {k: None if isinstance(v, float) and v != v else v for k, v in asdict(stats).items()}


# --------------------------------------------------------------------------- generate

def _add_trace_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=None, metavar="FILE",
                        help="record the router's choices (experts and weights per token and layer) into FILE "
                             "(.npz, or .json) when the command ends; format: docs/traces.md")


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    _add_model_arguments(parser, endpoint=True)
    _add_trace_argument(parser)
    parser.add_argument("--prompt", required=True, help="the user message ('-' reads it from stdin)")
    parser.add_argument("--system", default=None, help="a system prompt")
    _add_sampling_arguments(parser)
    parser.add_argument("--stats-json", default=None, metavar="F",
                        help="also write the reply's stats (tokens, speeds, hit rate, SSD traffic) to F as JSON "
                             f"(a folder: {STATS_NAME} in it)")


def run_generate(args: argparse.Namespace) -> int:
    """One reply: the answer streams to stdout, reasoning and stats go to stderr."""
    from engine.service_events import DoneEvent, GenerateRequest

    try:
        stats_path = (output_file(args.stats_json, option="--stats-json", default_name=STATS_NAME)
                      if args.stats_json is not None else None)
        params = _sampling(args)
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        engine = TerminalEngine(args)
    except ValueError as exc:  # UsageError too
        print(f"expertdesk generate: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if not engine.load(engine.ref):
            return EXIT_USAGE
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": prompt}]
        in_reasoning = False

        def show(text: str, reasoning: bool) -> None:
            nonlocal in_reasoning
            if reasoning:
                if not in_reasoning:
                    sys.stderr.write("[thinking] ")
                    in_reasoning = True
                sys.stderr.write(text)
                sys.stderr.flush()
            else:
                if in_reasoning:
                    sys.stderr.write("\n[/thinking]\n")
                    in_reasoning = False
                sys.stdout.write(text)
                sys.stdout.flush()

        try:
            result = engine.run_request(GenerateRequest(messages, params, thinking=args.think), show)
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        sys.stdout.write("\n")
        sys.stdout.flush()
        if not isinstance(result, DoneEvent):
            kind, message = (result.kind, result.message) if result is not None else ("internal", "no reply")
            print(f"expertdesk generate: error ({kind}): {message}", file=sys.stderr)
            return EXIT_FAILED
        print(_stats_line(result.stats), file=sys.stderr)
        if stats_path is not None:
            record = {"model": engine.model.model_name, "is_demo": engine.model.is_demo,
                      "sampling": {k: v for k, v in vars(params).items() if k != "stop"} | {"stop": list(params.stop)},
                      "stats": _stats_dict(result.stats)}
            _write_json(stats_path, record)
        return EXIT_INTERRUPTED if result.stats.stop_reason == "cancelled" else EXIT_OK
    finally:
        engine.close()


def _write_json(path: Path, data: dict) -> None:
    """Write `data` to `path` (already checked by `output_file`)."""
    write_atomically(path, lambda f: f.write((json.dumps(data, indent=1) + "\n").encode("utf-8")))


# --------------------------------------------------------------------------- chat

CHAT_HELP = "commands: /reset (new conversation), /exit (quit), /help. Ctrl+C stops a reply; twice quits."


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    _add_model_arguments(parser, endpoint=True)
    _add_trace_argument(parser)
    parser.add_argument("--system", default=None, help="a system prompt for the conversation")
    _add_sampling_arguments(parser)


def run_chat(args: argparse.Namespace) -> int:
    """Terminal chat with streaming replies (see CHAT_HELP)."""
    from engine.service_events import DoneEvent, GenerateRequest

    try:
        params = _sampling(args)
        engine = TerminalEngine(args)
    except ValueError as exc:
        print(f"expertdesk chat: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    dim = ("\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "")
    try:
        if not engine.load(engine.ref):
            return EXIT_USAGE
        print(CHAT_HELP, file=sys.stderr)
        system = [{"role": "system", "content": args.system}] if args.system else []
        history: list[dict] = []
        while True:
            try:
                line = input("you> ")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return EXIT_OK
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                return EXIT_OK
            if text == "/reset":
                history = []
                print("[new conversation]", file=sys.stderr)
                continue
            if text == "/help":
                print(CHAT_HELP, file=sys.stderr)
                continue
            history.append({"role": "user", "content": line})
            state = {"reasoning": False, "started": False}

            def show(delta: str, reasoning: bool, state: dict[str, bool] = state) -> None:
                if not state["started"]:
                    sys.stdout.write("model> ")
                    state["started"] = True
                if reasoning and not state["reasoning"]:
                    sys.stdout.write(dim[0] + "[thinking] ")
                    state["reasoning"] = True
                elif not reasoning and state["reasoning"]:
                    sys.stdout.write(" [/thinking]" + dim[1] + "\n")
                    state["reasoning"] = False
                sys.stdout.write(delta)
                sys.stdout.flush()

            try:
                result = engine.run_request(GenerateRequest(system + history, params, thinking=args.think), show)
            except KeyboardInterrupt:
                print("\n[quit]", file=sys.stderr)
                return EXIT_OK
            if state["reasoning"]:
                sys.stdout.write(dim[1])
            sys.stdout.write("\n")
            sys.stdout.flush()
            if isinstance(result, DoneEvent):
                history.append({"role": "assistant", "content": result.text})
                print(dim[0] + _stats_line(result.stats) + dim[1], file=sys.stderr)
            else:
                history.pop()  # the turn failed: let the user send it again
                kind, message = (result.kind, result.message) if result is not None else ("internal", "no reply")
                print(f"[error ({kind}): {message}]", file=sys.stderr)
    finally:
        engine.close()


# --------------------------------------------------------------------------- bench

def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    _add_model_arguments(parser, endpoint=True)
    parser.add_argument("--suite", default="seed10", help="prompt suite (default seed10: the reference protocol)")
    parser.add_argument("--max-tokens", type=int, default=200,
                        help="completion tokens per prompt (default 200, the reference setting)")
    parser.add_argument("--json", default=None, metavar="F",
                        help="write every number, the machine, the command and the date to F as JSON "
                             "(a folder: bench-SUITE-DATE.json in it)")


def machine_info() -> dict:
    """What the benchmark ran on: OS, CPU, RAM, GPU, versions."""
    import psutil
    import torch

    from app import __version__

    info = {
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(), "torch": torch.__version__, "expertdesk": __version__,
        "gpu": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)}
    return info


def _mean(values: list[float | None]) -> float | None:
    """The mean of the known values (None when none is known: a server's reply has no hit rate)."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else (None if values else 0.0)


def bench_summary(rows: list[dict]) -> dict:
    """Unweighted per-request means per dataset, like the reference."""
    summary: dict[str, dict] = {}
    for dataset in sorted({r["dataset"] for r in rows}):
        mine = [r for r in rows if r["dataset"] == dataset and r.get("error") is None]
        summary[dataset] = {key: _mean([r[key] for r in mine])
                            for key in ("prefill_tok_s", "decode_tok_s", "hit_rate", "ssd_gb_per_token")}
        summary[dataset]["requests"] = len(mine)
    return summary


def bench_tables(model_name: str, rows: list[dict], summary: dict) -> str:
    """The per-prompt table and the reference-style summary table (Markdown)."""
    out = ["| # | sample | dataset | prompt tok | completion tok | prefill tok/s | decode tok/s | hit rate "
           "| SSD GB/token | stop |", "|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for i, r in enumerate(rows, 1):
        if r.get("error"):
            out.append(f"| {i} | {r['sample_id']} | {r['dataset']} | | | | | | | error: {r['error']} |")
            continue
        out.append(f"| {i} | {r['sample_id']} | {r['dataset']} | {r['prompt_tokens']} | {r['completion_tokens']} "
                   f"| {r['prefill_tok_s']:.3f} | {r['decode_tok_s']:.3f} | {_known(r['hit_rate'], '.1%')} "
                   f"| {_known(r['ssd_gb_per_token'], '.4g')} | {r['stop_reason']} |")
    a, m = summary.get("Alpaca", {}), summary.get("MMLU", {})

    def pair(key: str, fmt: str) -> str:
        return " / ".join(_known(d[key], fmt) if d else "-" for d in (a, m))

    out += ["", "| model | prefill tok/s (Alpaca / MMLU) | decode tok/s (Alpaca / MMLU) | hit rate "
            "| SSD GB per generated token |", "|---|---|---|---|---|",
            f"| {model_name} | {pair('prefill_tok_s', '.3f')} | {pair('decode_tok_s', '.3f')} "
            f"| {pair('hit_rate', '.1%')} | {pair('ssd_gb_per_token', '.4g')} |"]
    return "\n".join(out)


def _bench_command(args: argparse.Namespace) -> str:
    from app.remote_cli import endpoint_flags

    where = endpoint_flags(args) if args.endpoint else [str(args.model)]
    parts = ["expertdesk", "bench", *where, "--suite", args.suite, "--max-tokens", str(args.max_tokens),
             *([] if args.endpoint else runtime_flags(runtime_options(args)))]
    if args.json is not None:
        parts += ["--json", str(args.json)]
    return " ".join(parts)


def run_bench(args: argparse.Namespace) -> int:
    """Run a prompt suite one request at a time at temperature 0; print the tables, write JSON."""
    from engine.bench_suites import SEED10_TEMPERATURE, suite
    from engine.service_events import DoneEvent, GenerateRequest
    from engine.text import SamplingParams

    now = datetime.now(timezone.utc)
    date = now.isoformat(timespec="seconds")
    try:
        prompts = suite(args.suite)
        json_path = (output_file(args.json, option="--json",
                                 default_name=f"bench-{args.suite}-{now.strftime('%Y%m%dT%H%M%SZ')}.json")
                     if args.json is not None else None)
        params = SamplingParams(temperature=SEED10_TEMPERATURE, max_tokens=args.max_tokens, seed=0)
        engine = TerminalEngine(args)
    except ValueError as exc:  # UsageError too
        print(f"expertdesk bench: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    rows: list[dict] = []
    try:
        if not engine.load(engine.ref):
            return EXIT_USAGE
        for i, item in enumerate(prompts, 1):
            print(f"[{i}/{len(prompts)}] {item.sample_id} ...", file=sys.stderr, flush=True)
            # Each prompt is a fresh one-message conversation; the engine resets its state
            # because the prompt does not extend the previous one.
            request = GenerateRequest([{"role": "user", "content": item.prompt}], params)
            try:
                result = engine.run_request(request, lambda text, reasoning: None)
            except KeyboardInterrupt:
                print("interrupted", file=sys.stderr)
                return EXIT_INTERRUPTED
            row = {"sample_id": item.sample_id, "dataset": item.dataset}
            if isinstance(result, DoneEvent):
                row.update(_stats_dict(result.stats))
                row["text"] = result.text
                row["reasoning"] = result.reasoning
                row["error"] = None
            else:
                row["error"] = f"{result.kind}: {result.message}" if result is not None else "no reply"
            rows.append(row)
        summary = bench_summary(rows)
        model_name = engine.model.model_name
        print(bench_tables(model_name, rows, summary))
        if json_path is not None:
            snapshot = engine.service.snapshot()
            _write_json(json_path, {
                "machine": machine_info(), "command": _bench_command(args), "date": date,
                "model": {"name": model_name, "architecture": engine.model.architecture,
                          "is_demo": engine.model.is_demo, "ref": engine.ref, "device": engine.model.device},
                "suite": args.suite, "settings": {"temperature": SEED10_TEMPERATURE, "max_tokens": args.max_tokens,
                                                  "one_request_at_a_time": True},
                "runtime": {k: v for k, v in snapshot["runtime"].items() if k != "layers"},
                "prompts": rows, "summary": summary,
            })
            print(f"wrote {json_path}", file=sys.stderr)
        return EXIT_FAILED if any(r["error"] for r in rows) else EXIT_OK
    finally:
        engine.close()


COMMANDS = [
    ("generate", "Generate one reply to a prompt (streams to stdout; stats to stderr)",
     add_generate_arguments, run_generate),
    ("chat", "Chat with a model in the terminal (streaming; /reset, /exit; Ctrl+C stops a reply)",
     add_chat_arguments, run_chat),
    ("bench", "Benchmark a model on a fixed prompt suite (seed10: the reference protocol)",
     add_bench_arguments, run_bench),
]
