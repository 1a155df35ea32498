"""Benchmark the token sampler (engine.text.sampling.Sampler) at the real vocabularies.

Every reply's decode step ends on the CPU: the step's logits come to the host and
`Sampler.sample` picks the next token (float64, the whole vocabulary). At DeepSeek-V4's
129,280 and Kimi-K3's 163,840 ids that is per token, beside a GPU decode step of a few ms
(benchmarks/RESULTS.md). Timed here: `sample` with the defaults (temperature 0.7, top-k 40,
top-p 0.95, min-p 0.05), greedy, and top-p alone (top-k 0: the whole vocabulary sorted),
on logits shaped like a language model's (a few dozen ids far above a Gaussian bulk) and on
a flat Gaussian (the harder case for top-k's window).

    python benchmarks/bench_sampling.py

Results go to benchmarks/results/sampling-<hostname>-<stamp>.json or --out.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.result_file import kernel_machine, result_header, write_result  # noqa: E402
from engine.text.sampling import Sampler, SamplingParams  # noqa: E402

VOCABS = {"deepseek-v4-flash": 129_280, "kimi-k3": 163_840}
PARAMS = {"defaults": SamplingParams(), "greedy": SamplingParams(temperature=0.0),
          "top-p only": SamplingParams(top_k=0, min_p=0.0)}


def logits_of(shape: str, vocab: int, seed: int) -> torch.Tensor:
    """float32 logits: "peaked" (a Gaussian bulk, 40 ids 6-14 above it), or "flat" (Gaussian)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 2.0, size=vocab)
    if shape == "peaked":
        x[rng.choice(vocab, 40, replace=False)] += rng.uniform(6, 14, size=40)
    return torch.tensor(x, dtype=torch.float32)


def ms_per_call(sampler: Sampler, logits: torch.Tensor, calls: int) -> float:
    sampler.sample(logits)
    start = time.perf_counter()
    for _ in range(calls):
        sampler.sample(logits)
    return (time.perf_counter() - start) / calls * 1e3


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/...)")
    args = parser.parse_args(argv)
    now = _dt.datetime.now()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    rows = []
    print(f"torch threads {torch.get_num_threads()}, code {commit}")
    print(f"{'vocabulary':<18} {'logits':<7} {'params':<11} {'ms/token':>9}")
    for model, vocab in VOCABS.items():
        for shape in ("peaked", "flat"):
            logits = logits_of(shape, vocab, seed=vocab)
            for name, params in PARAMS.items():
                ms = ms_per_call(Sampler(params), logits, args.calls)
                rows.append({"model": model, "vocab": vocab, "logits": shape, "params": name, "ms_per_token": ms})
                print(f"{model:<18} {shape:<7} {name:<11} {ms:>9.3f}")
    result = {**result_header("sampling", __file__, argv, kernel_machine("cpu", None), now),
              "code": commit, "torch_threads": torch.get_num_threads(), "rows": rows}
    write_result(result, args.out, "sampling", now)
    return result


if __name__ == "__main__":
    main()
