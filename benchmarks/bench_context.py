"""Long context: decode speed and the attention state a model really holds at 2k-32k tokens.

Why: a conversation's KV state competes with the expert cache for the device's memory
(engine/memory_plan.py plans it), and the attention cost of a decode step grows with
the context. This measures both through the product's own loader and models:

- the demo model (engine/demo.py builds its GGUF and pack in a temporary
  EXPERTDESK_HOME), loaded by `engine.loader.open_model` with the options the service
  gives it: at each context (default 2k, 8k, 32k tokens) the prompt is prefilled in the
  service's chunks (`engine.memory_plan.prompt_chunk`), then 8 greedy decode steps
  are timed. One state grows from one context to the next (the prefill rate of a row is
  that of the tokens added since the previous row). The state's tensors are walked
  (`state_bytes`): bytes in use, bytes allocated (row buffers double), and the
  formula's (`engine.memory_plan.kv_size`);
- DeepSeek-V4-Flash (compressed KV: sliding window, CSA entries + indexer keys, HCA
  entries) and Kimi-K3 (KDA linear-attention fixed state + MLA rows): the KV bytes per
  token and the fixed part at the real dimensions, from `kv_size` on the config the
  engine reads from the real-geometry metadata (benchmarks/real_geometry.py), at 8k and
  32k tokens; cross-checked by building each real model on a small-scale real-geometry
  GGUF (`--scale small`: the real layer pattern, shrunk widths) with `load_model` and
  measuring its state at two contexts: the measured bytes per token must be the
  formula's. `--real-decode 8192,32768` also times those models' decode there.

    python3 benchmarks/bench_context.py --real-decode 8192,32768                # CPU
    python3 benchmarks/bench_context.py --device cuda --real-decode 8192,32768  # GPU

Prints a table and writes benchmarks/results/context-<host>-<stamp>.json (machine,
command, date).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.real_geometry import geometry, model_metadata, plan_tensors, write_real_geometry_gguf  # noqa: E402
from engine.loader import load_model, open_model  # noqa: E402
from engine.memory_plan import kv_size, prompt_chunk  # noqa: E402
from engine.models import ARCHITECTURES  # noqa: E402
from engine.models.common import state_bytes  # noqa: E402
from engine.options import RuntimeOptions  # noqa: E402
from engine.runtime import ExpertCache  # noqa: E402

MIB = 1 << 20
REAL_MODELS = ("deepseek-v4-flash", "kimi-k3")
REAL_CONTEXTS = (8192, 32768)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_to(model: Any, state: Any, tokens: int, chunk: int, seed: int) -> tuple[float, int]:
    """Feed random prompt tokens until `state` holds `tokens`, `chunk` per forward pass
    as the service does; returns (seconds, the greedy next token)."""
    need = tokens - state.position
    ids = torch.randint(0, model.config.vocab_size, (max(0, need),), generator=torch.Generator().manual_seed(seed))
    sync(model.device)
    t = time.perf_counter()
    logits = None
    for start in range(0, need, chunk):
        logits = model.forward(ids[start:start + chunk], state, only_last=True)
    sync(model.device)
    return time.perf_counter() - t, int(torch.argmax(logits[-1])) if logits is not None else 0


def decode(model: Any, state: Any, token: int, steps: int) -> list[float]:
    """`steps` greedy decode steps, each timed to its sampled token (ms)."""
    times = []
    for _ in range(steps):
        sync(model.device)
        t = time.perf_counter()
        logits = model.forward(torch.tensor([token]), state)
        token = int(torch.argmax(logits[-1]))  # the sampler's own device sync
        times.append((time.perf_counter() - t) * 1e3)
    return times


def kv_row(kv: Any, tokens: int) -> dict[str, Any]:
    """The formula's numbers at `tokens`: used (fixed + per token) and planned (growth counted)."""
    return {"tokens": tokens, "formula_used_bytes": kv.fixed + round(kv.per_token * tokens),
            "formula_planned_bytes": kv.at(tokens), "kv_bytes_per_token": kv.per_token,
            "fixed_bytes": kv.fixed}


def sweep(model: Any, state: Any, contexts: list[int], steps: int, chunk: int,
          label: str) -> list[dict[str, Any]]:
    """Grow `state` to each context in turn (prefill in `chunk`s), measure the state's
    bytes there, then time `steps` decode steps (none for 0). The next context prefills
    from where the decode steps left the state."""
    kv = kv_size(model.config, model.decode_dtype)
    rows: list[dict[str, Any]] = []
    for i, tokens in enumerate(sorted(contexts)):
        start = state.position
        seconds, token = prefill_to(model, state, tokens, chunk, seed=i)
        held = state_bytes(state)
        row = {"context": tokens, "prefill_tokens": tokens - start, "prefill_s": seconds,
               "prefill_tok_s": (tokens - start) / seconds if seconds else None, "state_used_bytes": held["used"],
               "state_allocated_bytes": held["allocated"], "measured_bytes_per_token": held["used"] / tokens,
               **kv_row(kv, tokens)}
        if rows:  # what the context added, per token: the formula's per_token when linear
            prev = rows[-1]
            added = held["used"] - prev["state_used_bytes"]
            row["measured_slope_bytes_per_token"] = added / (tokens - prev["context"])
        line = f"{label} @ {tokens:6} tokens: prefill {row['prefill_tok_s'] or 0:7.1f} tok/s"
        if steps:
            times = decode(model, state, token, steps)
            # min beside the median: on a shared, loaded machine single steps stall for other processes
            row.update(decode_ms_per_token_median=statistics.median(times), decode_ms_per_token_min=min(times),
                       decode_ms=times,
                       decode_tok_s=1e3 / statistics.median(times),
                       state_used_bytes_after_decode=state_bytes(state)["used"])
            line += f", decode {row['decode_ms_per_token_median']:7.1f} ms/token (min {min(times):.1f})"
        rows.append(row)
        print(f"{line}, state {held['used'] / MIB:7.2f} MiB used / {held['allocated'] / MIB:7.2f} MiB allocated "
              f"(formula {row['formula_used_bytes'] / MIB:.2f} / {row['formula_planned_bytes'] / MIB:.2f} MiB)",
              flush=True)
    return rows


def run_demo(device: str, contexts: list[int], steps: int, chunk: int | None, home: Path) -> dict[str, Any]:
    """The demo at each context, opened as the service opens it (DEMO_CACHE_MIB, page-cache fallback)."""
    os.environ["EXPERTDESK_HOME"] = str(home)
    from engine.demo import DEMO_CACHE_MIB, ensure_demo_pack

    pack = ensure_demo_pack()
    options = RuntimeOptions(device=device, cache_mib=DEMO_CACHE_MIB)
    model, source = open_model(pack, options, buffered_fallback=lambda: print("demo: reading through the page cache"))
    kv = kv_size(model.config, model.decode_dtype)
    chunk = chunk or prompt_chunk(model)  # None: the service's choice
    try:
        rows = sweep(model, model.new_state(), contexts, steps, chunk, "demo")
    finally:
        cache = model.experts
        assert isinstance(cache, ExpertCache)  # a pack streams through the cache
        cache.close()
        cache.store.close()
        source.close()
    return {"model": "demo", "pack": str(pack), "dtype": str(model.dtype).removeprefix("torch."),
            "cache_mib": DEMO_CACHE_MIB, "prefill_chunk": chunk, "decode_steps": steps,
            "kv_detail": kv.detail, "kv_bytes_per_token": kv.per_token, "kv_fixed_bytes": kv.fixed, "rows": rows}


def real_config(model: str) -> Any:
    """The config the engine reads from the real model's metadata and tensor names (full scale)."""
    g = geometry(model, "full")
    metadata = {key: value[0] for key, value in model_metadata(model, g, g.n_layers).items()}
    names = [plan.name for plan in plan_tensors(model, g.n_layers, scale="full")]
    arch = "deepseek4" if model == "deepseek-v4-flash" else "kimi-k3"
    metadata["general.architecture"] = arch  # the GGUF writer's own key
    return ARCHITECTURES[arch][0].from_metadata(metadata, names)


def run_real(model: str, layers: int, check: tuple[int, int], decode_at: list[int], steps: int, device: str,
             chunk: int | None, work: Path) -> dict[str, Any]:
    """Real-dimension KV formula at 8k/32k, the state a small real-geometry model really
    keeps at the two `check` contexts and, at each of `decode_at`, its decode speed."""
    config = real_config(model)
    full = kv_size(config, torch.bfloat16)
    gguf = write_real_geometry_gguf(work / f"{model}-{layers}l-small.gguf", model, layers, scale="small", threads=1)
    small_model = load_model(gguf, RuntimeOptions(device=device))
    kv = kv_size(small_model.config, small_model.decode_dtype)
    chunk = chunk or prompt_chunk(small_model)  # None: the service's choice
    state = small_model.new_state()
    label = f"{model} small {layers}l"
    measured = sweep(small_model, state, list(check), 0, chunk, label)
    slope = measured[1]["measured_slope_bytes_per_token"]
    result = {"model": model, "bf16_full": {"detail": full.detail, "kv_bytes_per_token": full.per_token,
                                            "fixed_bytes": full.fixed, "layers": config.n_layers,
                                            "at": [kv_row(full, t) for t in REAL_CONTEXTS]},
              "small_check": {"layers": layers, "dtype": str(small_model.dtype).removeprefix("torch."),
                              "detail": kv.detail, "formula_bytes_per_token": kv.per_token,
                              "measured_bytes_per_token": slope, "formula_fixed_bytes": kv.fixed,
                              "measured_fixed_bytes": measured[1]["state_used_bytes"] - slope * check[1],
                              "rows": measured},
              "small_decode": sweep(small_model, state, [t for t in decode_at if t > check[1]], steps, chunk, label)}
    print(f"{model}: {full.per_token:,.1f} B/token + {full.fixed / MIB:,.1f} MiB fixed (bf16, all "
          f"{config.n_layers} layers); small {layers}-layer check: measured {slope:.1f} B/token, "
          f"formula {kv.per_token:.1f}", flush=True)
    del small_model, state
    gguf.unlink()
    return result


def machine(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"host": socket.gethostname(), "platform": platform.platform(),
                            "python": platform.python_version(), "torch": torch.__version__, "device": device,
                            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    return info


def print_table(result: dict[str, Any]) -> None:
    demo = result.get("demo")
    if demo:
        print(f"\ndemo ({demo['dtype']}, {demo['kv_detail']})")
        print(f"{'context':>8} {'prefill tok/s':>13} {'decode ms/tok':>13} {'min ms/tok':>10} {'state used MiB':>14} "
              f"{'allocated MiB':>13} {'formula MiB':>11} {'B/token':>8}")
        for r in demo["rows"]:
            print(f"{r['context']:8} {r['prefill_tok_s']:13.1f} {r['decode_ms_per_token_median']:13.1f} "
                  f"{r['decode_ms_per_token_min']:10.1f} "
                  f"{r['state_used_bytes'] / MIB:14.3f} {r['state_allocated_bytes'] / MIB:13.3f} "
                  f"{r['formula_used_bytes'] / MIB:11.3f} {r.get('measured_slope_bytes_per_token', 0):8.1f}")
    for real in result.get("real", []):
        full, small = real["bf16_full"], real["small_check"]
        print(f"\n{real['model']} (bf16, real dimensions): {full['detail']}")
        print(f"  {full['kv_bytes_per_token']:,.1f} bytes/token + {full['fixed_bytes'] / MIB:,.1f} MiB fixed; "
              + ", ".join(f"{a['tokens'] // 1024}k: {a['formula_used_bytes'] / MIB:,.1f} MiB "
                          f"(planned with growth {a['formula_planned_bytes'] / MIB:,.1f})" for a in full["at"]))
        print(f"  small-scale check ({small['layers']} layers, {small['dtype']}): measured "
              f"{small['measured_bytes_per_token']:.1f} B/token, formula {small['formula_bytes_per_token']:.1f}")
        for r in real["small_decode"]:
            print(f"  small-scale decode @ {r['context']} tokens: {r['decode_ms_per_token_median']:.1f} ms/token, "
                  f"prefill {r['prefill_tok_s']:.1f} tok/s, state {r['state_used_bytes'] / MIB:.2f} MiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda / cuda:N")
    parser.add_argument("--contexts", default="2048,8192,32768", help="demo contexts in tokens, comma-separated")
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps at each context")
    parser.add_argument("--chunk", type=int, default=None,
                        help="prefill tokens per forward pass (default: the service's choice, "
                             "engine.memory_plan.prompt_chunk)")
    parser.add_argument("--real", default=",".join(REAL_MODELS),
                        help="real-geometry models to check ('' skips): " + ", ".join(REAL_MODELS))
    parser.add_argument("--real-layers", type=int, default=4,
                        help="layers of the small real-geometry GGUFs (4 hold every layer kind)")
    parser.add_argument("--real-check", default="256,512",
                        help="the two contexts the small models' state is measured at")
    parser.add_argument("--real-decode", default="",
                        help="contexts at which the small real-geometry models' decode is also timed "
                             "(e.g. 8192,32768 on a GPU; none by default)")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    device = str(RuntimeOptions(device=args.device).resolved_device())  # a clear error for an absent GPU
    contexts = [int(x) for x in args.contexts.split(",") if x.strip()]
    check = tuple(int(x) for x in args.real_check.split(","))
    if len(check) != 2 or check[0] >= check[1]:
        parser.error(f"--real-check needs two increasing contexts, got {args.real_check!r}")
    real_decode = [int(x) for x in args.real_decode.split(",") if x.strip()]
    models = [m for m in args.real.split(",") if m.strip()]
    unknown = set(models) - set(REAL_MODELS)
    if unknown:
        parser.error(f"unknown --real model(s) {', '.join(sorted(unknown))}; use {', '.join(REAL_MODELS)}")

    command = " ".join(["python3", "benchmarks/bench_context.py", *(sys.argv[1:] if argv is None else argv)])
    result: dict[str, Any] = {"benchmark": "bench_context", "command": command,
                              "date": dt.datetime.now(dt.timezone.utc).isoformat(), "machine": machine(device)}
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = args.out / f"context-{socket.gethostname()}-{stamp}.json"
    with tempfile.TemporaryDirectory(prefix="bench-context-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if contexts:
            result["demo"] = run_demo(device, contexts, args.steps, args.chunk, work / "home")
            path.write_text(json.dumps(result, indent=1))  # a run cut short keeps what it measured
        result["real"] = [run_real(m, args.real_layers, check, real_decode, args.steps, device, args.chunk, work)
                          for m in models]
    path.write_text(json.dumps(result, indent=1))
    print_table(result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
