"""What `--verify-reads` costs: SHA-256 speed on this CPU, and expert reads with and without it.

    python benchmarks/bench_verify_reads.py                 # ~1 GB synthetic pack in /tmp, a minute
    python benchmarks/bench_verify_reads.py --experts 8     # smoke test

Two measurements:
1. SHA-256 of DeepSeek-V4-Flash-sized slices (4.46 MB, the keyed digest the pack
   stores: `PackManifest.slice_digest`), on one thread and on every core at once, in GB/s.
2. ExpertStore reads of whole experts (3 x 4.46 MB), many in flight, verify off and on,
   in GB/s delivered. The pack is read through the page cache after a warm-up pass, so
   the drive costs nothing and what remains is the CPU work per byte: the worst case
   for verification (a real drive only makes the relative cost smaller). Off and on
   alternate, several rounds; the best round of each counts.

From (1) it derives the cores needed to hash at a PCIe 4 (7 GB/s) and PCIe 5 (12.5 GB/s)
drive's speed. Writes benchmarks/results/verify-reads-<host>-<date>.json (or --out DIR)
with the machine, the command and the date.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):  # run from a checkout without `pip install -e .`
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import numpy as np  # noqa: E402

from bench_runtime import write_pack  # noqa: E402
from engine.runtime import ExpertStore  # noqa: E402
from expertpack import load_manifest  # noqa: E402

GB = 1e9
DRIVES_GBPS = {"pcie4_nvme": 7.0, "pcie5_nvme": 12.5}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def machine_info() -> dict:
    flags = cpu_flags()
    return {
        "hostname": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
        "openssl": __import__("ssl").OPENSSL_VERSION, "cpu": cpu_model(), "cpu_count": os.cpu_count(),
        "sha_ni": "sha_ni" in flags, "avx2": "avx2" in flags,
        # Other work on the machine slows both sides alike; a high load makes the GB/s low.
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def sha256_speed(slice_bytes: int, total_bytes: int, threads: int) -> float:
    """GB/s of keyed slice digests (the pack's), `threads` at once over distinct buffers."""
    rng = np.random.default_rng(0)
    buffers = [memoryview(rng.integers(0, 256, slice_bytes, dtype=np.uint8).tobytes()) for _ in range(threads)]
    per_thread = max(1, total_bytes // slice_bytes // threads)
    key = b'[0,3,0,"gate","blk.3.ffn_gate_exps.weight",39,"MXFP4",[2048,4096],4096,4456448]\0'

    def work(buf: memoryview) -> None:
        for _ in range(per_thread):
            digest = hashlib.sha256(key)
            digest.update(buf)
            digest.digest()

    work(buffers[0])  # warm up
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, buffers))
    return per_thread * threads * slice_bytes / (time.perf_counter() - t0) / GB


def read_all(store: ExpertStore, keys: list[tuple[int, int]], in_flight: int) -> tuple[float, int]:
    """Read every (layer, expert) once, `in_flight` at a time; (seconds, bytes)."""
    slots = list(range(min(in_flight, len(keys))))
    t0 = time.perf_counter()
    nbytes = 0
    pending: list = []
    free = list(slots)
    for li, e in keys:
        if not free:
            handle, slot = pending.pop(0)
            handle.result()
            free.append(slot)
        slot = free.pop()
        pending.append((store.submit(li, e, store.staging.view(slot)), slot))
        nbytes += store.read_nbytes(li)
    for handle, _slot in pending:
        handle.result()
    return time.perf_counter() - t0, nbytes


def bench_store(pack: Path, *, rounds: int, in_flight: int) -> dict:
    m = load_manifest(pack)
    keys = [(li, e) for li in range(m.num_layers) for e in range(m.num_experts)]
    stores = {verify: ExpertStore(pack, direct_io=False, io_threads=in_flight, stage_slots=in_flight,
                                  pin_memory=False, verify=verify) for verify in (False, True)}
    best: dict[bool, float] = {False: 0.0, True: 0.0}
    try:
        read_all(stores[False], keys, in_flight)  # warm the page cache: the drive drops out
        for _ in range(rounds):
            for verify in (False, True):
                seconds, nbytes = read_all(stores[verify], keys, in_flight)
                best[verify] = max(best[verify], nbytes / seconds / GB)
        mismatches = stores[True].telemetry.get("hash_mismatches")
    finally:
        for store in stores.values():
            store.close()
    expert_mb = m.layers[0].read_nbytes / 1e6
    return {
        "experts": len(keys), "expert_mb": round(expert_mb, 2), "reads_in_flight": in_flight, "rounds": rounds,
        "io": "buffered, page cache warm (CPU-bound: the worst case for verification)",
        "verify_off_gbps": round(best[False], 3), "verify_on_gbps": round(best[True], 3),
        "slowdown": round(best[False] / best[True], 3) if best[True] else None,
        "ms_per_expert_off": round(expert_mb / 1e3 / best[False] * 1e3, 3),
        "ms_per_expert_on": round(expert_mb / 1e3 / best[True] * 1e3, 3),
        "hash_mismatches": mismatches,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=40, help="experts per layer (13.4 MB each; at least 6)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--in-flight", type=int, default=8, help="expert reads in flight at once")
    p.add_argument("--work", type=Path, default=None, help="folder for the synthetic pack (default: a temp dir)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    now = _dt.datetime.now()
    result: dict = {
        "benchmark": "verify-reads",
        "date": now.isoformat(timespec="seconds"),
        "command": [sys.executable, *sys.argv] if argv is None else ["bench_verify_reads.py", *argv],
        "machine": machine_info(),
    }
    slice_bytes = 2048 * 4096 // 32 * 17  # one MXFP4 role of DeepSeek-V4-Flash: 4.46 MB
    cores = os.cpu_count() or 1
    one = sha256_speed(slice_bytes, 1 << 30, 1)
    many = sha256_speed(slice_bytes, 1 << 30 if cores <= 4 else 4 << 30, cores)
    result["sha256"] = {
        "slice_mb": round(slice_bytes / 1e6, 2), "one_thread_gbps": round(one, 3),
        "threads": cores, "all_threads_gbps": round(many, 3),
        "cores_to_keep_up": {name: round(rate / one, 1) for name, rate in DRIVES_GBPS.items()},
    }
    work = Path(tempfile.mkdtemp(prefix="bench-verify-", dir=args.work))
    try:
        pack = write_pack(work / "bench.expertpack", layers=args.layers, num_experts=args.experts, small=False)
        result["store"] = bench_store(pack, rounds=args.rounds, in_flight=args.in_flight)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"verify-reads-{socket.gethostname()}-{now:%Y%m%d-%H%M%S}.json"
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    s, st = result["sha256"], result["store"]
    print(f"machine: {result['machine']['cpu']} x{cores}, SHA-NI {result['machine']['sha_ni']}")
    print(f"SHA-256: {s['one_thread_gbps']:.2f} GB/s one thread, {s['all_threads_gbps']:.2f} GB/s on {cores} threads; "
          f"cores to hash at 7 / 12.5 GB/s: {s['cores_to_keep_up']['pcie4_nvme']} / "
          f"{s['cores_to_keep_up']['pcie5_nvme']}")
    print(f"store reads (page cache, CPU-bound): {st['verify_off_gbps']:.2f} GB/s off, {st['verify_on_gbps']:.2f} GB/s "
          f"verified ({st['slowdown']}x); {st['ms_per_expert_off']} -> {st['ms_per_expert_on']} ms per 13.4 MB expert")
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
