"""bf16 against float32 on the same model and tokens: where reduced precision goes wrong.

Loads a GGUF twice with the app's loader (float32, then bfloat16), runs the same tokens
through each as one prefill chunk and compares the logits per position (relative L2,
top-1 agreement). It also records, through the expert-provider contract, which routed
experts every MoE layer chose for every token: a position where bf16 picks another
expert set than float32 (a "route flip", a near-tie of the router's scores decided the
other way by rounding upstream) gets a different function, not a rounding of the same
one. The table separates the positions with a flip in any layer from the others, so
the numeric drift and the discrete flips are seen apart; a third run (float32 compute
on the dense weights rounded to bf16 values) shows the weights' share of the error.
Both ways a model reads tokens are measured: one prefill chunk (the dense weights, kept
in their GGUF types on a GPU, are dequantized to the compute dtype per use) and decode
steps (on a GPU the quantized GEMV reads them in place and sums in float32). A fourth
decode row measures the engine's mixed mode (`--dtype bfloat16 --decode-dtype float32`):
the prompt in bf16, the state kept in float32, the decode steps in float32 (decode reads
weights, not activations, so float32 costs it little; prefill's GEMMs need bf16's tensor
cores).

Inputs: random token ids (the hardest case: a model is unsure of what follows noise,
so its routers and logits sit near ties) and text that ships with Python (the `json`
module's documentation and source, what the demo model was trained on).

    python benchmarks/bench_precision.py [--model demo|PATH.gguf] [--device cpu|cuda] [--tokens 256]
"""

from __future__ import annotations

import argparse
import datetime as dt
import inspect
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.result_file import kernel_machine, result_header, write_result  # noqa: E402
from engine.demo import write_demo_gguf  # noqa: E402
from engine.loader import load_model, open_model_source  # noqa: E402
from engine.options import RuntimeOptions  # noqa: E402
from engine.text.tokenizer import GGUFTokenizer  # noqa: E402


class RecordingExperts:
    """The model's expert provider, unchanged, that also keeps every layer's chosen experts."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: dict[int, list[torch.Tensor]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def graph_safe(self, x: torch.Tensor, k: int) -> bool:
        return False  # every layer through routed() below, eagerly

    def routed(self, block: int, x: torch.Tensor, chosen: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls.setdefault(block, []).append(chosen.sort(dim=-1).values.cpu())
        return self.inner.routed(block, x, chosen, *args, **kwargs)

    def chosen(self, skip: int) -> dict[int, torch.Tensor]:
        """Each layer's choices [T, k] for the tokens after the first `skip`."""
        return {block: torch.cat(calls)[skip:] for block, calls in self.calls.items()}


def run(gguf: Path, device: str, dtype: torch.dtype, tokens: torch.Tensor, decode_from: int | None,
        bf16_weights: bool = False, decode_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, dict]:
    """Logits [T, vocab] and the experts each layer chose [T, k]: all tokens as one prefill
    chunk (decode_from None), or the first decode_from as one chunk and the rest one at a
    time (decode steps), of which only those are returned. `bf16_weights`: the dense
    matrices dequantized at load and rounded to bfloat16 values (kept in `dtype`): the
    weights' share of the error. `decode_dtype`: the decode steps' dtype (the engine's
    `RuntimeOptions.decode_dtype`; default `dtype`)."""
    if bf16_weights:
        os.environ["EXPERTDESK_QUANT_GEMV"] = "0"  # the loader then dequantizes them once
    try:
        model = load_model(gguf, RuntimeOptions(device=device, dtype=dtype, decode_dtype=decode_dtype))
    finally:
        os.environ.pop("EXPERTDESK_QUANT_GEMV", None)
    if bf16_weights:
        for matrix in model.weights.materialized_matrices():
            matrix.values.copy_(matrix.values.to(torch.bfloat16))  # stacked views round their matrix too
    recorder = RecordingExperts(model.experts)
    model.experts = recorder
    tokens = tokens.to(model.device)
    state = model.new_state()
    if decode_from is None:
        return model.forward(tokens, state).double().cpu(), recorder.chosen(0)
    model.forward(tokens[:decode_from], state)
    logits = [model.forward(tokens[i:i + 1], state).double().cpu() for i in range(decode_from, tokens.numel())]
    return torch.cat(logits), recorder.chosen(decode_from)


def compare(ref: tuple[torch.Tensor, dict], low: tuple[torch.Tensor, dict]) -> dict:
    (a, chosen_a), (b, chosen_b) = ref, low
    rel = (b - a).norm(dim=-1) / a.norm(dim=-1)
    agree = a.argmax(-1) == b.argmax(-1)
    flips_per_layer = {}
    flipped = torch.zeros(a.shape[0], dtype=torch.bool)
    for layer in sorted(chosen_a):
        differ = (chosen_a[layer] != chosen_b[layer]).any(dim=-1)
        flips_per_layer[layer] = int(differ.sum())
        flipped |= differ
    steady = ~flipped

    def stats(mask: torch.Tensor) -> dict:
        if not mask.any():
            return {"positions": 0}
        return {"positions": int(mask.sum()), "rel_l2_max": float(rel[mask].max()),
                "rel_l2_median": float(rel[mask].median()), "top1_agreement": float(agree[mask].double().mean())}

    return {"positions": a.shape[0], "rel_l2_max": float(rel.max()), "rel_l2_median": float(rel.median()),
            "rel_l2_mean": float(rel.mean()), "top1_agreement": float(agree.double().mean()),
            "route_flips_per_layer": flips_per_layer, "without_route_flips": stats(steady),
            "with_route_flips": stats(flipped)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="'demo' (the built-in model) or a GGUF file")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: benchmarks/results/...)")
    args = parser.parse_args(argv)
    now = dt.datetime.now(dt.timezone.utc)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = write_demo_gguf(Path(tmp) / "demo.gguf") if args.model == "demo" else Path(args.model)
        source, _ = open_model_source(gguf)
        tokenizer = GGUFTokenizer.from_metadata(source.metadata)
        vocab = int(source.tensors["token_embd.weight"].shape[-1])
        text = inspect.getdoc(json) + "\n\n" + inspect.getsource(json.dumps)
        inputs = {
            "random token ids": torch.randint(0, vocab, (args.tokens,), generator=torch.Generator().manual_seed(1)),
            "text (json module docs and source)": torch.tensor(tokenizer.encode(text)[: args.tokens]),
        }
        rows = []
        for name, tokens in inputs.items():
            for forward, decode_from in (("prefill", None), ("decode", tokens.numel() // 2)):
                ref = run(gguf, args.device, torch.float32, tokens, decode_from)
                low = run(gguf, args.device, torch.bfloat16, tokens, decode_from)
                rows.append({"input": name, "forward": forward, "dtype": "bfloat16 vs float32",
                             **compare(ref, low)})
                rounded = run(gguf, args.device, torch.float32, tokens, decode_from, bf16_weights=True)
                rows.append({"input": name, "forward": forward,
                             "dtype": "float32, dense weights rounded to bf16, vs float32", **compare(ref, rounded)})
                if decode_from is not None:
                    mixed = run(gguf, args.device, torch.bfloat16, tokens, decode_from, decode_dtype=torch.float32)
                    rows.append({"input": name, "forward": forward,
                                 "dtype": "bf16 prefill, float32 decode (--decode-dtype float32), vs float32",
                                 **compare(ref, mixed)})
    print(f"{'input':36} {'forward':8} {'run':12} {'rel L2 max':>10} {'median':>8} {'top-1':>6} {'flipped':>7} "
          f"{'max w/o flips':>13} {'top-1 w/o':>9}")
    for r in rows:
        s = r["without_route_flips"]
        print(f"{r['input']:36} {r['forward']:8} {r['dtype'][:12]:12} {r['rel_l2_max']:10.3e} "
              f"{r['rel_l2_median']:8.2e} {r['top1_agreement']:6.3f} "
              f"{r['with_route_flips']['positions']:7} {s.get('rel_l2_max', float('nan')):13.3e} "
              f"{s.get('top1_agreement', float('nan')):9.3f}")
    result = result_header("bench_precision", __file__, argv, kernel_machine(args.device, None), now)
    result |= {"model": args.model, "forward": "prefill: every token in one chunk; decode: the first half in one "
               "chunk, then one token a step (the rows compare those steps)", "rows": rows}
    write_result(result, args.out, "precision", now)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
