"""Record a routing trace (docs/traces.md) of a model over the seed10 prompts, greedy.

    python benchmarks/record_trace.py demo --out benchmarks/traces/demo-seed10.npz
    python benchmarks/record_trace.py PACKDIR --out trace.npz --max-tokens 64 --device cuda

Why a script next to `expertdesk generate --trace`: a policy comparison needs a few
hundred decode tokens from fixed prompts, reproducibly; the CLI stops at the model's
end-of-text and records one conversation. This one runs each prompt as a fresh
sequence (prefill, then greedy decode until end-of-text, or with `--through-eos`
past it, for `--max-tokens`), through
the same recorder the CLI installs (`RuntimeOptions.trace_file`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.bench_suites import suite  # noqa: E402
from engine.demo import ensure_demo_pack, is_demo_ref  # noqa: E402
from engine.loader import open_model  # noqa: E402
from engine.options import RuntimeOptions  # noqa: E402
from engine.text.tokenizer import GGUFTokenizer  # noqa: E402


def record(model_ref: str, out: Path, *, max_tokens: int, device: str, cache_mib: int | None,
           through_eos: bool = False) -> int:
    """Run every seed10 prompt; returns the decode tokens recorded."""
    path = ensure_demo_pack() if is_demo_ref(model_ref) else Path(model_ref)
    if is_demo_ref(model_ref) and cache_mib is None:
        cache_mib = 1
    options = RuntimeOptions(device=device, cache_mib=cache_mib, trace_file=str(out))
    model, source = open_model(path, options, buffered_fallback=lambda: None)
    tokenizer = GGUFTokenizer.from_metadata(source.metadata)
    decoded = 0
    try:
        with torch.inference_mode():
            for prompt in suite("seed10"):
                state = model.new_state()
                ids = tokenizer.encode(prompt.prompt)
                logits = model.forward(torch.tensor(ids, dtype=torch.long), state)
                for _ in range(max_tokens):
                    token = int(logits[-1].argmax())
                    if token in tokenizer.eos_ids and not through_eos:
                        break
                    logits = model.forward(torch.tensor([token], dtype=torch.long), state)
                    decoded += 1
    finally:
        if model.experts is not None:
            model.experts.close()  # writes the trace
        source.close()
    return decoded


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="demo, a pack folder or a GGUF")
    p.add_argument("--out", type=Path, required=True, help="trace file (.npz or .json)")
    p.add_argument("--max-tokens", type=int, default=48, help="decode tokens per prompt at most")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cache-mib", type=int, default=None)
    p.add_argument("--through-eos", action="store_true",
                   help="keep decoding past end-of-text (more tokens from short answers; still the model's routing)")
    args = p.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    n = record(args.model, args.out, max_tokens=args.max_tokens, device=args.device, cache_mib=args.cache_mib,
               through_eos=args.through_eos)
    print(f"recorded {n} decode tokens of 10 prompts into {args.out}")


if __name__ == "__main__":
    main()
