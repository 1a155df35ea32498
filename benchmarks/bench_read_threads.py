"""What the store's reader threads cost the decode thread: GIL round trips under reads.

The decode thread runs Python between its GPU launches and copies; each time it hands
the GIL over (any torch call, a copy, a wait) it must get it back from whichever thread
holds it. The expert store's reader threads run Python around every sub-read (taking a
task, counting the read, completing the expert). This measures, through the product's
`ExpertStore` on a pack in RAM (no rate cap unless given), how long a GIL round trip
(`time.sleep(0)`: release, then take back) takes on the main thread while 16 experts
are kept in flight, for each `read_splits`, beside the same round trip with no reads,
and how many expert reads completed meanwhile.

    python benchmarks/bench_read_threads.py [--pack DIR] [--splits 1,2,8] [--seconds 2]

Without --pack it writes a small Kimi-K3 real-geometry GGUF and its pack in a temporary
folder. Writes results/read-threads-<host>-<stamp>.json (machine, command, date, the
git commit of the engine measured).
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.result_file import kernel_machine, result_header, write_result  # noqa: E402
from engine.runtime import ExpertStore  # noqa: E402

IN_FLIGHT = 16


def round_trips(seconds: float) -> list[float]:
    """GIL round trips (microseconds) on this thread for `seconds`."""
    out = []
    end = time.perf_counter() + seconds
    while True:
        t = time.perf_counter()
        if t > end:
            return out
        time.sleep(0)
        out.append((time.perf_counter() - t) * 1e6)


def stats(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"n": len(ordered), "median_us": statistics.median(ordered), "mean_us": statistics.fmean(ordered),
            "p90_us": ordered[int(0.9 * (len(ordered) - 1))], "p99_us": ordered[int(0.99 * (len(ordered) - 1))]}


def under_reads(pack: Path, splits: int, seconds: float, rate: float | None) -> dict:
    """Round trips while a helper thread keeps IN_FLIGHT expert reads going through the store."""
    with ExpertStore(pack, direct_io=False, read_splits=splits, stage_slots=IN_FLIGHT,
                     rate_limit_bytes_per_s=rate) as store:
        layers, experts = len(store.manifest.layers), store.manifest.num_experts
        stop = threading.Event()
        done = [0]

        def reader() -> None:
            buffers = [store.staging.view(i) for i in range(IN_FLIGHT)]
            i = 0
            while not stop.is_set():
                handles = [store.submit(i % layers, (i + j) % experts, buffers[j]) for j in range(IN_FLIGHT)]
                for handle in handles:
                    handle.result()
                done[0] += len(handles)
                i += 1

        thread = threading.Thread(target=reader)
        thread.start()
        time.sleep(0.2)
        before, t = done[0], time.perf_counter()
        samples = round_trips(seconds)
        reads = (done[0] - before) / (time.perf_counter() - t)
        stop.set()
        thread.join()
        nbytes = store.manifest.layers[0].read_nbytes
    return {"read_splits": splits, "expert_bytes": nbytes, "reads_per_s": reads,
            "gb_per_s": reads * nbytes / 1e9, **stats(samples)}


def small_pack(folder: Path) -> Path:
    from packer.builder import build_pack

    gguf = folder / "kimi-k3-small.gguf"
    subprocess.run([sys.executable, "-m", "benchmarks.real_geometry", "--model", "kimi-k3", "--layers", "4",
                    "--scale", "small", "--out", str(gguf)], check=True, cwd=ROOT, capture_output=True)
    return build_pack(gguf, folder / "kimi-k3-small.expertpack", direct_io=False)


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pack", type=Path, default=None)
    parser.add_argument("--splits", default="1,2,8")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rate-gbps", type=float, default=None, help="the store's rate cap (drive emulation)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    now = dt.datetime.now()
    result = result_header("read-threads", __file__, argv, kernel_machine("cpu", None), now)
    result["engine_commit"] = git_commit()
    result["switch_interval_s"] = sys.getswitchinterval()
    with tempfile.TemporaryDirectory() as tmp:
        pack = args.pack or small_pack(Path(tmp))
        result["idle"] = stats(round_trips(args.seconds))
        rate = None if args.rate_gbps is None else args.rate_gbps * 1e9
        result["rows"] = [under_reads(pack, int(s), args.seconds, rate) for s in args.splits.split(",")]
    print(f"GIL round trip with no reads: median {result['idle']['median_us']:.0f} us, "
          f"mean {result['idle']['mean_us']:.0f} us")
    print(f"{'splits':>6} {'reads/s':>9} {'GB/s':>6} {'median us':>10} {'mean us':>8} {'p90 us':>8} {'p99 us':>8}")
    for r in result["rows"]:
        print(f"{r['read_splits']:6d} {r['reads_per_s']:9.0f} {r['gb_per_s']:6.2f} {r['median_us']:10.0f} "
              f"{r['mean_us']:8.0f} {r['p90_us']:8.0f} {r['p99_us']:8.0f}")
    write_result(result, args.out, "read-threads", now)
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise SystemExit(main())
