"""Exactness on the GPU: both architectures through a real pack and a tiny VRAM cache.

- Kimi-K3: the committed tiny GGUFs (tests/fixtures/kimi_k3) against llama.cpp's
  reference logits, one-shot prefill and token-by-token decode (same tolerance as the
  CPU tests: relative L2 <= 1e-3 per position and identical argmax).
- DeepSeek-V4: the demo model (a trained tiny deepseek4) on CUDA through its pack
  with a cache of a few slots, against the same model on the CPU with every expert
  resident (the CPU engine is proven against transformers in tests/test_deepseek4.py).
- Every case runs twice: the seed design (plain acquires, no prefetch, no RAM tier,
  copies after a layer's reads) and with every lever (streaming, exact and speculative
  prefetch, an exclusive RAM tier, per-expert copies); the two must agree bit for bit.

Writes JSON (machine, command, date, per-case errors and cache counters).
Usage: python benchmarks/parity_cuda.py [--out DIR] [--device cuda]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.demo import write_demo_gguf  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.options import RuntimeOptions  # noqa: E402
from engine.runtime import ExpertCache, ExpertStore  # noqa: E402
from packer.builder import build_pack  # noqa: E402

KIMI = ROOT / "tests" / "fixtures" / "kimi_k3"


def tiny_cache(pack: Path, device: str, slots: int, levers: bool) -> ExpertCache:
    """`levers`: a RAM tier of 6 experts, per-expert copies, guesses into any free queue depth."""
    store = ExpertStore(pack)
    stride = store.manifest.expert_stride
    if not levers:
        return ExpertCache(store, device=device, cache_bytes=slots * stride, reserve_bytes=0, pipeline_h2d=False)
    return ExpertCache(store, device=device, cache_bytes=slots * stride, reserve_bytes=0,
                       host_cache_bytes=6 * stride, speculative="tail")


def run_both(pack: Path, device: str, slots: int, tokens: torch.Tensor, chunk: int, **load) -> tuple:
    """(logits with every lever, counters, whether they equal the seed-design run bit for bit)."""
    out = {}
    for levers in (False, True):
        cache = tiny_cache(pack, device, slots, levers)
        cache.streaming = cache.prefetching = levers  # off: the seed design's plain acquires
        model = load_model(pack, RuntimeOptions(device=device, dtype=load.get("dtype", torch.float32)), experts=cache)
        out[levers] = (run(model, tokens, chunk), counters(cache))
        cache.close()
        cache.store.close()
    return out[True][0], out[True][1], bool(torch.equal(out[True][0], out[False][0]))


def run(model, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
    state = model.new_state()
    return torch.cat([model.forward(tokens[i : i + chunk], state).float().cpu() for i in range(0, len(tokens), chunk)])


def errors(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    ours, ref = ours.double(), torch.as_tensor(ref).double()
    rel = (ours - ref).norm(dim=-1) / ref.norm(dim=-1)
    return {
        "max_rel_l2": float(rel.max()),
        "max_abs": float((ours - ref).abs().max()),
        "argmax_agree": float((ours.argmax(-1) == ref.argmax(-1)).double().mean()),
    }


def counters(cache: ExpertCache) -> dict:
    snap = cache.telemetry.snapshot()
    return {k: snap.get(k) for k in ("cache_hits", "cache_misses", "cache_evictions", "io_errors", "fallback_count",
                                     "host_hits", "host_demotions", "prefetch_issued", "prefetch_hits")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run this on the GPU machine (or --device cpu)")
        return 2
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        tmp = Path(tmp)
        reference = np.load(KIMI / "reference.npz")
        for kind, gguf in (("f32", KIMI / "tiny-f32.gguf"), ("q", KIMI / "tiny-q2k-00001-of-00003.gguf")):
            pack = build_pack(gguf, tmp / f"kimi-{kind}.expertpack")
            tokens = torch.from_numpy(reference[f"tokens_{kind}"]).long()
            for mode, chunk in (("prefill", len(tokens)), ("decode", 1)):
                logits, stats, same = run_both(pack, args.device, 3, tokens, chunk)
                e = errors(logits, reference[f"{kind}_{mode}"])
                ok = e["max_rel_l2"] <= 1e-3 and e["argmax_agree"] == 1.0 and same
                rows.append({"model": f"kimi-k3 tiny-{kind}", "mode": mode, "dtype": "float32", "tokens": len(tokens),
                             "reference": "llama.cpp (committed)", **e, "identical_to_seed": same, "ok": ok,
                             **stats})

        demo = write_demo_gguf(tmp / "demo.gguf")
        pack = build_pack(demo, tmp / "demo.expertpack")
        tokens = torch.randint(0, 1000, (300,), generator=torch.Generator().manual_seed(1))
        cpu_ref = run(load_model(demo), tokens, len(tokens))
        for dtype in (torch.float32, torch.bfloat16):
            for mode, chunk in (("prefill", len(tokens)), ("chunked-37", 37), ("decode", 1)):
                logits, stats, same = run_both(pack, args.device, 4, tokens, chunk, dtype=dtype)
                e = errors(logits, cpu_ref)
                ok = (e["max_abs"] <= 1e-4 if dtype == torch.float32 else e["argmax_agree"] >= 0.9) and same
                rows.append({"model": "deepseek4 demo", "mode": mode, "dtype": str(dtype).removeprefix("torch."),
                             "tokens": len(tokens), "reference": "our CPU float32, all experts resident",
                             **e, "identical_to_seed": same, "ok": ok, **stats})

    print(f"{'model':18} {'mode':11} {'dtype':9} {'max rel L2':>11} {'max abs':>10} {'argmax':>7} "
          f"{'misses':>7} {'evict':>6} {'RAM hit':>7} {'prefet':>6} =seed ok")
    for r in rows:
        print(f"{r['model']:18} {r['mode']:11} {r['dtype']:9} {r['max_rel_l2']:11.2e} {r['max_abs']:10.2e} "
              f"{r['argmax_agree']:7.3f} {r['cache_misses']:7} {r['cache_evictions']:6} {r['host_hits']:7} "
              f"{r['prefetch_issued']:6} {r['identical_to_seed']} {r['ok']}")
    now = dt.datetime.now(dt.timezone.utc)
    result = {
        "benchmark": "parity_cuda",
        "date": now.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "hostname": platform.node(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        "rows": rows,
        "all_ok": all(r["ok"] for r in rows),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"parity-{platform.node()}-{now:%Y-%m-%d}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}; all ok: {result['all_ok']}")
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
