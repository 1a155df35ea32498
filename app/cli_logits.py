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

from app.cli_options import add_runtime_arguments, runtime_options
from app.cli_paths import UsageError, output_file, write_atomically

DEFAULT_OUT = "logits.npy"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="PACKDIR|GGUF|demo",
                        help="an Expert Pack folder, a GGUF file (any shard of a split set), or `demo` for the "
                             "built-in tiny demo model")
    parser.add_argument("--tokens", required=True,
                        help="token ids, comma- or space-separated, e.g. 1,2,3")
    parser.add_argument("--out", required=True, metavar="F",
                        help=f"where to write the logits: a .npy of float32 [tokens, vocab] (a folder: "
                             f"{DEFAULT_OUT} in it)")
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


def _model_path(ref: str) -> str:
    """The file or folder to load: `ref`, or the demo's pack (built at first use) for `demo`."""
    from engine.demo import ensure_demo_pack, is_demo_ref

    if not is_demo_ref(ref):
        return ref
    print("[loading] the demo model", file=sys.stderr, flush=True)
    return str(ensure_demo_pack())


def run(args: argparse.Namespace) -> int:
    try:  # every argument is checked before the model loads
        tokens = parse_tokens(args.tokens)
        if args.chunk < 0:
            raise ValueError("--chunk must be 0 (one chunk) or a positive number of tokens")
        out = output_file(args.out, option="--out", default_name=DEFAULT_OUT)
    except (UsageError, ValueError) as exc:
        print(f"expertdesk logits: error: {exc}", file=sys.stderr)
        return 2

    import numpy as np
    import torch

    from engine.demo import DemoModelError
    from engine.loader import load_model
    from engine.runtime.errors import ExpertReadError, RuntimeStartError

    try:
        started = time.perf_counter()
        model = load_model(_model_path(args.model), runtime_options(args))  # a device it lacks: ValueError
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
    except (OSError, ValueError, KeyError, RuntimeStartError, ExpertReadError, DemoModelError) as exc:
        print(f"expertdesk logits: error: {exc}", file=sys.stderr)  # files, input, model, runtime
        return 2

    write_atomically(out, lambda f: np.save(f, result))  # to a file object: no ".npy" appended
    seconds = done - loaded
    print(
        f"wrote logits {list(result.shape)} float32 to {out} "
        f"({args.mode}{'' if args.mode == 'decode' else f', chunk {step}'}, {len(tokens)} tokens in "
        f"{seconds:.2f} s = {len(tokens) / max(seconds, 1e-9):.1f} tok/s; load {loaded - started:.2f} s)"
    )
    return 0


COMMANDS = [
    ("logits", "Run a model on token ids and save every position's logits (.npy)", add_arguments, run),
]
