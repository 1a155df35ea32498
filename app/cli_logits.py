"""`expertdesk logits`: run a model on given token ids and save every position's logits.

The reference-check command: its output can be compared with another
implementation (transformers, llama.cpp) position by position. `--mode decode`
feeds one token at a time through the incremental state, `--mode prefill` feeds
the whole list (or `--chunk N` tokens at a time); all modes must agree.

Any architecture `engine.loader` knows runs here (it dispatches on the GGUF's
`general.architecture`): `deepseek4` (DeepSeek-V4) and `kimi-k3` (Kimi-K3).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from app.cli_options import add_runtime_arguments, runtime_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="PACKDIR|GGUF",
                        help="an Expert Pack folder, or a GGUF file (any shard of a split set)")
    parser.add_argument("--tokens", required=True,
                        help="token ids, comma- or space-separated, e.g. 1,2,3")
    parser.add_argument("--out", required=True, type=Path,
                        help="where to write the logits: a .npy of float32 [tokens, vocab]")
    parser.add_argument("--mode", choices=("prefill", "decode"), default="prefill",
                        help="prefill: feed the tokens in chunks (default); decode: one token at a time")
    parser.add_argument("--chunk", type=int, default=0, metavar="N",
                        help="prefill chunk size in tokens (default 0: all tokens in one chunk)")
    add_runtime_arguments(parser, dtype_default="float32")  # float32: the exact reference setting


def parse_tokens(text: str) -> list[int]:
    """'1,2, 3' or '1 2 3' -> [1, 2, 3]; ValueError with the offending item otherwise."""
    items = [item for item in text.replace(",", " ").split() if item]
    if not items:
        raise ValueError("--tokens is empty: give at least one token id, e.g. --tokens 1,2,3")
    tokens = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            raise ValueError(f"--tokens: {item!r} is not an integer token id") from None
        if value < 0:
            raise ValueError(f"--tokens: {value} is negative")
        tokens.append(value)
    return tokens


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.loader import load_model
    from engine.runtime.errors import ExpertReadError, RuntimeStartError

    try:
        tokens = parse_tokens(args.tokens)
        if args.chunk < 0:
            raise ValueError("--chunk must be 0 (one chunk) or a positive number of tokens")
        started = time.perf_counter()
        model = load_model(args.model, runtime_options(args))  # a device this machine lacks: ValueError
        loaded = time.perf_counter()
        vocab = model.config.vocab_size
        bad = [t for t in tokens if t >= vocab]
        if bad:
            raise ValueError(f"--tokens: {bad[0]} is outside this model's vocabulary (0..{vocab - 1})")

        ids = torch.tensor(tokens, dtype=torch.long)
        step = 1 if args.mode == "decode" else (args.chunk or len(tokens))
        state = model.new_state()
        logits = [model.forward(ids[i:i + step], state).cpu() for i in range(0, len(tokens), step)]
        result = torch.cat(logits).numpy().astype(np.float32, copy=False)
        done = time.perf_counter()
    except (OSError, ValueError, KeyError, RuntimeStartError, ExpertReadError) as exc:  # files, input, model, runtime
        print(f"expertdesk logits: error: {exc}", file=sys.stderr)
        return 2

    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.save(args.out, result)
    seconds = done - loaded
    print(
        f"wrote logits {list(result.shape)} float32 to {args.out} "
        f"({args.mode}{'' if args.mode == 'decode' else f', chunk {step}'}, {len(tokens)} tokens in "
        f"{seconds:.2f} s = {len(tokens) / max(seconds, 1e-9):.1f} tok/s; load {loaded - started:.2f} s)"
    )
    return 0


COMMANDS = [
    ("logits", "Run a model on token ids and save every position's logits (.npy)", add_arguments, run),
]
