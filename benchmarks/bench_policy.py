"""Replacement policies compared on the same traces: hit rate, ratio to Belady, cost.

    python benchmarks/bench_policy.py               # all traces, ~5-10 minutes on one core
    python benchmarks/bench_policy.py --small       # smoke test (seconds)
    python benchmarks/bench_policy.py --markdown    # also print the table docs/cache.md holds

Every policy is the runtime's own class (`engine.runtime.policy.make_policy`) replayed
through the cache's planning code (`engine.runtime.trace.replay_policy`), so a hit rate
here is the hit rate the cache would have with that many slots. Belady's MIN (it
knows the future) is the reference; "oracle" is an online policy that knows the
synthetic generator's true probabilities (evict the largest expected time to next
use): no online policy can expect to do much better, so it shows the limit a target
"x of Belady" can reach on that trace. Traces:

- demo: recorded from the demo model (benchmarks/traces/demo-seed10.npz, decode rows;
  4 MoE layers x 16 experts, top-2: 64 keys, so budgets are coarse);
- ds4-calibrated / kimi-calibrated: `synthetic_trace(**CALIBRATED)` at DeepSeek-V4-Flash
  (43 x 256, top-6) and Kimi-K3 (92 x 896, top-16) geometry (docs/traces.md);
- ds4-skewed: the older default synthetic trace (more skewed), for continuity with
  earlier results.

Budgets: 2, 5, 15, 40% of the keys (layers x experts), at least top-k slots. Policy
cost: microseconds per acquire spent in the policy's decisions (plan_acquire and the
guess hand-over), on this machine. Writes benchmarks/results/policy-<host>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import heapq
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from engine.runtime.policy import POLICIES, make_policy  # noqa: E402
from engine.runtime.trace import (  # noqa: E402
    CALIBRATED,
    AccessTrace,
    belady_hit_rate,
    replay_policy,
    synthetic_trace,
    trace_statistics,
)

BUDGETS = (0.02, 0.05, 0.15, 0.40)
TARGETS = {0.05: 0.90, 0.15: 0.95}  # hit rate / Belady (issue 22)
TARGET_US = 20.0
DEMO_TRACE = ROOT / "benchmarks" / "traces" / "demo-seed10.npz"


def traces(small: bool) -> dict[str, tuple[AccessTrace, int, int]]:
    """name -> (trace, keys, top_k)."""
    out: dict[str, tuple[AccessTrace, int, int]] = {}
    demo = AccessTrace.load(DEMO_TRACE).decode_only()
    out["demo"] = (demo, int(demo.meta["moe_layers"]) * int(demo.meta["n_experts"]), int(demo.meta["top_k"]))
    if small:
        shapes = {"ds4-calibrated": (dict(layers=8, experts=64, top_k=4, tokens=150), CALIBRATED)}
    else:
        shapes = {
            "ds4-calibrated": (dict(layers=43, experts=256, top_k=6, tokens=600), CALIBRATED),
            "kimi-calibrated": (dict(layers=92, experts=896, top_k=16, tokens=200), CALIBRATED),
            "ds4-skewed": (dict(layers=43, experts=256, top_k=6, tokens=600), {}),
        }
    for name, (shape, params) in shapes.items():
        trace = synthetic_trace(**shape, **params, seed=0)
        out[name] = (trace, shape["layers"] * shape["experts"], shape["top_k"])
    return out


def oracle_hit_rate(trace: AccessTrace, capacity: int) -> float:
    """Hit rate of an online policy that knows a synthetic trace's true probabilities.

    On each eviction it drops the keys with the largest expected time to next use,
    phase(layer) + layers * (1 - p) / p, where p is the chance the key's layer picks it
    at its next visit: kept from the previous token with probability `reuse`, else
    drawn by the segment's true popularity (`trace.truth`)."""
    assert trace.truth is not None, "the oracle needs a synthetic trace"
    params = trace.meta["params"]
    layers, top_k, reuse, segment = params["layers"], params["top_k"], params["reuse"], params["segment_tokens"]
    chance: dict[int, np.ndarray] = {}
    resident: set[tuple[int, int]] = set()
    hits = accesses = 0
    for record in trace.acquire_records():
        layer, keys = record.layer, [(record.layer, e) for e in record.experts]
        misses = [k for k in keys if k not in resident]
        hits += len(keys) - len(misses)
        accesses += len(keys)
        need = len(resident) + len(misses) - capacity
        if need > 0:
            current = set(keys)

            def expected_wait(key: tuple[int, int], now: int = layer) -> float:
                kl, e = key
                q = float(chance[kl][e]) if kl in chance else 1e-9
                return (kl - now - 1) % layers + layers * (1 - q) / max(q, 1e-9)

            resident.difference_update(heapq.nlargest(need, (k for k in resident if k not in current),
                                                      key=expected_wait))
        resident.update(misses)
        fresh = np.minimum(1.0, top_k * trace.truth[record.step // segment][layer])
        q = fresh.copy()
        chosen = list(record.experts)
        q[chosen] = reuse + (1 - reuse) * fresh[chosen]
        chance[layer] = q
    return hits / accesses if accesses else 0.0


def run(small: bool, policies: tuple[str, ...], with_oracle: bool) -> dict:
    rows = []
    statistics = {}
    for name, (trace, keys, top_k) in traces(small).items():
        statistics[name] = trace_statistics(trace)
        for fraction in BUDGETS:
            capacity = max(top_k, int(fraction * keys))
            optimal = belady_hit_rate(trace, capacity)
            row: dict = {"trace": name, "budget": fraction, "capacity": capacity, "keys": keys,
                         "belady": optimal, "policies": {}}
            for policy in policies:
                result = replay_policy(trace, capacity, make_policy(policy, capacity))
                row["policies"][policy] = {
                    "hit_rate": result.hit_rate, "over_belady": result.hit_rate / optimal if optimal else None,
                    "us_per_acquire": result.us_per_acquire}
            if with_oracle and trace.truth is not None and keys <= 20_000:  # O(resident) per eviction
                oracle = oracle_hit_rate(trace, capacity)
                row["oracle"] = {"hit_rate": oracle, "over_belady": oracle / optimal if optimal else None}
            rows.append(row)
            print(format_row(row, policies), flush=True)
    return {"rows": rows, "trace_statistics": statistics}


def format_row(row: dict, policies: tuple[str, ...]) -> str:
    cells = [f"{row['trace']:16}", f"{row['budget']:>4.0%}", f"{row['capacity']:>6}", f"{row['belady']:7.3f}"]
    for policy in policies:
        ratio = row["policies"][policy]["over_belady"]
        cells.append(f"{ratio:7.3f}" if ratio is not None else f"{'-':>7}")
    oracle = row.get("oracle", {}).get("over_belady")
    cells.append(f"{oracle:7.3f}" if oracle is not None else f"{'-':>7}")
    return " ".join(cells)


def header(policies: tuple[str, ...]) -> str:
    return " ".join([f"{'trace':16}", f"{'bud':>4}", f"{'slots':>6}", f"{'Belady':>7}",
                     *(f"{p:>7}" for p in policies), f"{'oracle':>7}"])


def markdown(result: dict, policies: tuple[str, ...]) -> str:
    """The comparison as a Markdown table: hit rate / Belady per policy, Belady's hit rate."""
    lines = ["| trace | budget | slots | Belady hit rate | " + " | ".join(policies) + " | oracle |",
             "|---|---|---|---|" + "---|" * (len(policies) + 1)]
    for row in result["rows"]:
        best = max((row["policies"][p]["over_belady"] or 0.0) for p in policies)
        cells = []
        for p in policies:
            ratio = row["policies"][p]["over_belady"]
            text = "-" if ratio is None else f"{ratio:.3f}"
            cells.append(f"**{text}**" if ratio is not None and ratio == best and best > 0 else text)
        oracle = row.get("oracle", {}).get("over_belady")
        lines.append(f"| {row['trace']} | {row['budget']:.0%} | {row['capacity']} | {row['belady']:.3f} | "
                     + " | ".join(cells) + f" | {'-' if oracle is None else f'{oracle:.3f}'} |")
    cost = result["cost_us_per_acquire"]
    lines.append("")
    lines.append("Policy cost, microseconds per acquire (median over the rows): "
                 + ", ".join(f"{p} {cost[p]:.1f}" for p in policies))
    return "\n".join(lines)


def machine_info() -> dict:
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="small traces: a smoke test in seconds")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated (default {','.join(POLICIES)})")
    p.add_argument("--no-oracle", action="store_true", help="skip the oracle limit (the slowest column)")
    p.add_argument("--markdown", action="store_true", help="also print the Markdown table")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="folder for the JSON")
    args = p.parse_args(argv)
    policies = tuple(x.strip() for x in args.policies.split(",") if x.strip())
    for name in policies:
        make_policy(name, 8)  # a clear error for an unknown name, before minutes of work
    start = time.perf_counter()
    print(header(policies) + "   (hit rate / Belady)", flush=True)
    result = run(args.small, policies, not args.no_oracle)
    result["cost_us_per_acquire"] = {
        name: float(np.median([r["policies"][name]["us_per_acquire"] for r in result["rows"]])) for name in policies}
    result["targets"] = {"over_belady": {f"{k:.0%}": v for k, v in TARGETS.items()}, "us_per_acquire": TARGET_US}
    now = _dt.datetime.now()
    result.update(machine=machine_info(), date=now.isoformat(timespec="seconds"), seconds=time.perf_counter() - start,
                  command=[sys.executable, *sys.argv] if argv is None else ["bench_policy.py", *argv])
    print("\npolicy cost (us per acquire, median): "
          + ", ".join(f"{k} {v:.1f}" for k, v in result["cost_us_per_acquire"].items()))
    if args.markdown:
        print("\n" + markdown(result, policies))
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"policy-{socket.gethostname()}-{now:%Y%m%d-%H%M%S}{'-small' if args.small else ''}.json"
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"\nwrote {out}")
    return out


if __name__ == "__main__":
    main()
