"""The fit estimate (`expertdesk fit`, packer/fit.py) against the decode speed really measured.

Why: the wizard and `expertdesk fit` promise a tokens/s range before anything is
downloaded. This checks that promise on a pack it can run, the built-in demo (built by
engine/demo.py in a temporary EXPERTDESK_HOME):

1. estimate: `packer.fit.release_from_pack` turns the pack's manifest into the entry a
   catalogue release would have, and `packer.fit.estimate_fit` measures this PC against
   it exactly as for a catalogue release (2-second O_DIRECT read probe in the pack's
   folder), with the caches set to those the measurement runs with (the service's demo
   cache, `engine.demo.DEMO_CACHE_MIB`, no host tier). That is the drive bound;
2. compute term: the same prompts through the product with every expert resident
   (cache larger than the pack's experts): the decode tokens/s of compute alone.
   `packer.fit.speed_with_compute` combines both into a range and says which side
   limits it (on a CPU the demo is compute-bound: its drive bound is far above);
3. measured: decode tokens/s through `engine.service.EngineService` on the seed10
   protocol (`engine.bench_suites`: one request at a time, temperature 0), first
   `--prompts` prompts, `--max-tokens` each, with the demo's streaming cache.

    python3 benchmarks/bench_fit.py                      # CPU, 5 prompts, 64 tokens
    python3 benchmarks/bench_fit.py --prompts 10 --device cuda

Prints a table and writes benchmarks/results/fit-<host>-<stamp>.json (machine, command, date).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import queue
import socket
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from app.cli_chat import machine_info  # noqa: E402
from engine.bench_suites import SEED10_TEMPERATURE, suite  # noqa: E402
from engine.demo import DEMO_CACHE_MIB, ensure_demo_pack  # noqa: E402
from engine.options import RuntimeOptions  # noqa: E402
from engine.service import EngineService  # noqa: E402
from engine.service_events import DoneEvent, ErrorEvent, GenerateRequest, PhaseEvent  # noqa: E402
from engine.text import SamplingParams  # noqa: E402
from packer.diskio import MIB  # noqa: E402
from packer.fit import FitReport, ReadProbe, estimate_fit, release_from_pack, speed_with_compute  # noqa: E402


def estimate(pack: Path, *, cache_mib: int = DEMO_CACHE_MIB, host_cache_mib: int = 0,
             read_probe: ReadProbe | None = None, probe_seconds: float = 2.0) -> FitReport:
    """The fit estimate of a built pack, with the caches the measurement runs with."""
    report = estimate_fit(release_from_pack(pack), pack.parent, read_probe=read_probe, probe_seconds=probe_seconds)
    return dataclasses.replace(report, cache_vram_bytes=cache_mib * MIB, host_cache_bytes=host_cache_mib * MIB)


def _wait_idle(events: queue.Queue, what: str) -> None:
    """Drain a service's events to the end of its load; RuntimeError if it failed."""
    while not (isinstance(ev := events.get(timeout=300), PhaseEvent) and ev.phase == "idle"):
        if isinstance(ev, ErrorEvent):
            raise RuntimeError(f"loading {what} failed: {ev.message}")


def _reply(service: EngineService, events: queue.Queue, prompt: str, params: SamplingParams) -> Any:
    """One request, one at a time: its ReplyStats."""
    rid = service.submit(GenerateRequest([{"role": "user", "content": prompt}], params))
    while True:
        ev = events.get(timeout=300)
        if getattr(ev, "request_id", None) != rid:
            continue
        if isinstance(ev, ErrorEvent):
            raise RuntimeError(f"{ev.kind}: {ev.message}")
        if isinstance(ev, DoneEvent):
            return ev.stats


def measure(pack: Path, *, device: str, caches: dict[str, int], prompts: int,
            max_tokens: int) -> dict[str, list[dict[str, Any]]]:
    """Decode stats of the first `prompts` seed10 prompts through one engine service per
    cache size (name -> cache MiB). The services take turns prompt by prompt, in
    alternating order, so a busy machine's drifting load falls on all of them alike."""
    opened = []
    try:
        for name, mib in caches.items():
            events: queue.Queue = queue.Queue()
            service = EngineService(events.put, RuntimeOptions(device=device, cache_mib=mib))
            opened.append((name, service, events))
            service.load(str(pack))
            _wait_idle(events, f"{pack} ({name})")
        params = SamplingParams(temperature=SEED10_TEMPERATURE, max_tokens=max_tokens, seed=0)
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in caches}
        for i, item in enumerate(suite("seed10")[:prompts]):
            for name, service, events in (opened if i % 2 == 0 else opened[::-1]):
                s = _reply(service, events, item.prompt, params)
                rows[name].append({"sample_id": item.sample_id, "completion_tokens": s.completion_tokens,
                                   "decode_tok_s": s.decode_tok_s, "hit_rate": s.hit_rate,
                                   "ssd_bytes_per_token": s.ssd_gb_per_token * 1e9})
        return rows
    finally:
        for _, service, _ in opened:
            service.shutdown()


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Means over the prompts that decoded more than one token (decode rate needs two)."""
    ok = [r for r in rows if r["completion_tokens"] > 1] or rows
    return {k: statistics.fmean(r[k] for r in ok) for k in ("decode_tok_s", "hit_rate", "ssd_bytes_per_token")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", type=int, default=5, help="first N seed10 prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--probe-seconds", type=float, default=2.0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    now = dt.datetime.now(dt.timezone.utc)
    with tempfile.TemporaryDirectory(prefix="expertdesk-fit-") as home:
        os.environ["EXPERTDESK_HOME"] = home
        pack = ensure_demo_pack()
        report = estimate(pack, probe_seconds=args.probe_seconds)
        resident_mib = -(-report.release.expert_bytes // MIB) + 1  # every expert fits: compute alone
        runs = measure(pack, device=args.device, caches={"resident": resident_mib, "demo": DEMO_CACHE_MIB},
                       prompts=args.prompts, max_tokens=args.max_tokens)
    measured, resident = summary(runs["demo"]), summary(runs["resident"])
    compute = [r["decode_tok_s"] for r in runs["resident"] if r["completion_tokens"] > 1]
    slow, fast = speed_with_compute(report, min(compute)), speed_with_compute(report, max(compute))
    speed = dataclasses.replace(fast, low=slow.low)  # the compute rate varies prompt to prompt: span it
    drive_low, drive_high = report.tokens_per_s
    got = measured["decode_tok_s"]
    inside = speed.low <= got <= speed.high
    hit_low, hit_high = report.hit_range
    print(f"demo pack, {args.device}: {report.cache_fraction:.0%} of experts cached, drive "
          f"{report.read.bytes_per_s / MIB:.0f} MiB/s ({report.read.detail})")
    print(f"{'':34} {'low':>10} {'high':>10}")
    print(f"{'hit rate (estimate)':34} {hit_low:10.2f} {hit_high:10.2f}   measured {measured['hit_rate']:.2f}")
    print(f"{'drive bound tok/s':34} {drive_low or 0:10.1f} {drive_high or 0:10.1f}")
    print(f"{'compute (all resident) tok/s':34} {min(compute):10.1f} {max(compute):10.1f}"
          f"   mean {resident['decode_tok_s']:.1f}")
    print(f"{'estimate with compute tok/s':34} {speed.low:10.1f} {speed.high:10.1f}   bound: {speed.bound}")
    print(f"{'measured decode tok/s':34} {got:10.1f}   {'inside' if inside else 'OUTSIDE'} the estimate")
    result = {
        "machine": machine_info(), "command": " ".join(["python3", "benchmarks/bench_fit.py", *(argv or sys.argv[1:])]),
        "date": now.isoformat(timespec="seconds"),
        "settings": {"device": args.device, "prompts": args.prompts, "max_tokens": args.max_tokens,
                     "suite": "seed10", "temperature": SEED10_TEMPERATURE, "cache_mib": DEMO_CACHE_MIB},
        "estimate": report.to_dict(),
        "speed_with_compute": dataclasses.asdict(speed) | {"compute_tokens_per_s": [min(compute), max(compute)]},
        "resident": resident, "measured": measured,
        "prompts": runs, "measured_inside_estimate": inside,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"fit-{socket.gethostname()}-{now.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
