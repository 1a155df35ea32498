"""Expert-runtime benchmark: miss delivery vs raw SSD, H2D vs raw copies, policy vs Belady.

    python benchmarks/bench_runtime.py                      # CUDA machine, ~6 GB pack
    python benchmarks/bench_runtime.py --pack DIR.expertpack
    python benchmarks/bench_runtime.py --device cpu --small # smoke test (seconds)

Three measurements, each against a baseline taken in the same run:
1. Miss delivery: acquires of `--batch` experts that all miss a small cache, SSD ->
   staging -> device slots, as effective SSD bandwidth; baseline: plain os.preadv of
   the same file, same request size, same sub-reads, same concurrency, same batches.
   Repeated with direct_io=False (page cache dropped first; the JSON says how).
   Raw and cache batches alternate (A/B) so drive drift hits both alike; each pass
   reads every expert at most once, so no page-cache reuse flatters the buffered
   path. Target: >= 85% of the raw O_DIRECT bandwidth.
2. H2D: host tier -> device slots (all device misses, all host hits); baseline: torch
   copies from a pinned tensor, same chunk size, and one large copy (the link's peak).
3. Policy: hit rate of the runtime's replacement policy (the default, `forecast`) /
   Belady's optimum on skewed synthetic MoE traces (43 layers x 256 experts, top-6) at
   5%, 15%, 40% capacity. Target >= 0.85. benchmarks/bench_policy.py compares every
   policy on recorded and calibrated traces.

Writes benchmarks/results/runtime-<host>-<date>.json (or --out DIR) with machine info.
The synthetic pack uses DeepSeek-V4-Flash's expert geometry (3 MXFP4 roles of 2048 x
4096, 4.46 MB each) filled with random bytes; the runtime never looks at the values.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

from engine.runtime import ExpertCache, ExpertStore, split_ranges  # noqa: E402
from engine.runtime.policy import DEFAULT_POLICY  # noqa: E402
from engine.runtime.staging import aligned_host_buffer  # noqa: E402
from engine.runtime.trace import belady_hit_rate, simulate_policy, synthetic_trace  # noqa: E402
from expertpack import PackManifest, align_up, experts_file_header  # noqa: E402
from synthetic_pack import bench_layers, bench_manifest, finish_pack  # noqa: E402

GB = 1e9
MIB = 1 << 20
MXFP4 = (39, "MXFP4", 17)  # ggml type id, name, bytes per 32 values
Q8_0 = (8, "Q8_0", 34)
TARGET_DELIVERY = 0.85
TARGET_POLICY = 0.85


# The pack -----------------------------------------------------------------------------
def role_specs(small: bool) -> list[tuple]:
    """(name, ggml_type, type_name, shape, nbytes): DeepSeek-V4-Flash's routed expert, or a tiny one."""
    if small:
        shapes, qtype = {"gate": (64, 512), "up": (64, 512), "down": (512, 64)}, Q8_0
    else:
        shapes, qtype = {"gate": (2048, 4096), "up": (2048, 4096), "down": (4096, 2048)}, MXFP4
    type_id, type_name, block_bytes = qtype
    return [(n, type_id, type_name, s, s[0] * s[1] // 32 * block_bytes) for n, s in shapes.items()]


def write_pack(directory: Path, *, layers: int, num_experts: int, small: bool, seed: int = 0) -> Path:
    """A complete pack of random expert bytes (format per docs/expert-pack-format.md)."""
    directory.mkdir(parents=True, exist_ok=True)
    layer_entries = bench_layers(range(3, 3 + layers), role_specs(small))
    roles = layer_entries[0].roles
    pack = dict(num_experts=num_experts, top_k=6, tool="expertdesk bench_runtime")
    header_manifest = bench_manifest(layer_entries, **pack)
    stride = header_manifest.expert_stride

    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, 64 * MIB + stride, dtype=np.uint8)  # slices of it fill the blocks
    digests = []
    block = np.zeros(stride, dtype=np.uint8)
    with open(directory / "experts.bin", "wb") as f:
        f.write(experts_file_header(header_manifest))
        for index in range(layers * num_experts):
            at = (index * 7919 * 64) % (64 * MIB)
            block[:] = 0
            li, e = divmod(index, num_experts)
            for r, role in enumerate(roles):
                block[role.offset : role.end] = pool[at + role.offset : at + role.end]
                digests.append(header_manifest.slice_digest(li, e, r, block[role.offset : role.end]))
            f.write(memoryview(block))
        f.flush()
        os.fsync(f.fileno())
    finish_pack(directory, layer_entries, b"".join(digests), **pack)
    return directory


def drop_page_cache(path: Path, *, system_wide: bool = True) -> str:
    """Evict `path` from the page cache; says which method worked.

    As root, `echo 3 > /proc/sys/vm/drop_caches` (the whole machine's cache); otherwise,
    or with `system_wide=False`, posix_fadvise(DONTNEED) on the file alone.
    """
    os.sync()
    if system_wide:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError:
            pass
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return "posix_fadvise(DONTNEED)"
    except (OSError, AttributeError) as exc:
        return f"none ({exc})"


def batches_one_pass(manifest: PackManifest, batch: int, seed: int) -> list[tuple[int, list[int]]]:
    """Every (layer, expert) once, as shuffled per-layer batches of `batch` experts."""
    rng = np.random.default_rng(seed)
    out = []
    for li in range(manifest.num_layers):
        experts = rng.permutation(manifest.num_experts).tolist()
        out += [(li, experts[i : i + batch]) for i in range(0, len(experts) - batch + 1, batch)]
    order = rng.permutation(len(out))
    return [out[i] for i in order]


# 1. Miss delivery -----------------------------------------------------------------------
class RawReader:
    """Plain os.preadv of whole experts: what the drive gives this request pattern."""

    def __init__(self, path: Path, manifest: PackManifest, *, direct: bool, splits: int, threads: int,
                 per_batch: int) -> None:
        self.manifest = manifest
        self.nbytes = manifest.layers[0].read_nbytes
        self.ranges = split_ranges(self.nbytes, splits)
        self.buffers = [memoryview(aligned_host_buffer(self.nbytes).numpy()) for _ in range(per_batch)]
        self.fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        self.pool = ThreadPoolExecutor(threads)

    def _read(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError("short read")
            done += n

    def read_batch(self, layer_index: int, experts: list[int]) -> int:
        """The runtime's pattern: one batch in flight, then wait for all of it."""
        futures = [self.pool.submit(self._read, self.buffers[i][a : a + n],
                                    self.manifest.block_offset(layer_index, e) + a)
                   for i, e in enumerate(experts) for a, n in self.ranges]
        for fut in futures:
            fut.result()
        return self.nbytes * len(experts)

    def read_continuous(self, batches, per_batch: int) -> int:
        """No batch barrier: `per_batch` experts always in flight."""
        local = threading.local()

        def read_expert(offset):
            if not hasattr(local, "view"):
                local.view = memoryview(aligned_host_buffer(self.nbytes).numpy())
            for a, n in self.ranges:
                self._read(local.view[a : a + n], offset + a)

        with ThreadPoolExecutor(per_batch) as experts_pool:
            futures = [experts_pool.submit(read_expert, self.manifest.block_offset(li, e))
                       for li, experts in batches for e in experts]
            for fut in futures:
                fut.result()
        return self.nbytes * sum(len(experts) for _li, experts in batches)

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.fd)


def miss_delivery_ab(pack: Path, batches, *, device: str, direct: bool, splits: int, threads: int,
                     seconds: float) -> tuple[dict, dict]:
    """Raw reads and cache misses, batch by batch in alternation (A/B/A/B...).

    Alternating makes drifts of a virtual or thermally throttled drive hit both sides
    alike; every batch reads experts no other batch reads (no cache reuse).
    Cache side: SSD -> staging -> device slots, timed until the device holds them.
    """
    per_batch = len(batches[0][1])
    store = ExpertStore(pack, direct_io=direct, read_splits=splits, io_threads=threads, stage_slots=per_batch)
    manifest = store.manifest
    cache = ExpertCache(store, device=device, cache_bytes=2 * per_batch * manifest.expert_stride,
                        reserve_bytes=0, max_inflight=per_batch)
    raw = RawReader(pack / manifest.experts_file, manifest, direct=direct, splits=splits, threads=threads,
                    per_batch=per_batch)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    (li0, warm), (li1, warm_raw), *batches = batches
    with cache.acquire(manifest.layers[li0].block, warm):  # warm-up: threads, CUDA context, page faults
        sync()
    raw.read_batch(li1, warm_raw)
    before = store.telemetry.snapshot()
    raw_bytes = raw_time = cache_time = 0.0
    raw_batches = 0
    latencies = []
    start = time.perf_counter()
    for i, (li, experts) in enumerate(batches):
        t0 = time.perf_counter()
        if i % 2 == 0:
            raw_bytes += raw.read_batch(li, experts)
            raw_time += time.perf_counter() - t0
            raw_batches += 1
        else:
            with cache.acquire(manifest.layers[li].block, experts):
                sync()  # the experts are in device memory, usable by compute
            latencies.append(time.perf_counter() - t0)
            cache_time += latencies[-1]
        if time.perf_counter() - start > 2 * seconds and i % 2 == 1:
            break
    after = store.telemetry.snapshot()
    verified = verify_slots(cache, store)
    raw.close()
    store.close()
    read = after["pack_read_bytes"] - before["pack_read_bytes"]
    raw_result = {"bytes": raw_bytes, "seconds": raw_time, "gbps": raw_bytes / raw_time / GB,
                  "batches": raw_batches}
    cache_result = {
        "bytes": read, "seconds": cache_time, "gbps": read / cache_time / GB, "acquires": len(latencies),
        "acquire_ms_p50": 1e3 * float(np.percentile(latencies, 50)),
        "acquire_ms_p99": 1e3 * float(np.percentile(latencies, 99)),
        "misses": after["cache_misses"] - before["cache_misses"], "hits": after["cache_hits"] - before["cache_hits"],
        "buffered_reads": after["buffered_reads"], "fallback_count": after["fallback_count"],
        "io_errors": after["io_errors"], "slot_count": cache.slot_count, "verified_experts": verified,
    }
    return raw_result, cache_result


def raw_continuous(pack: Path, manifest: PackManifest, batches, *, splits: int, threads: int) -> dict:
    raw = RawReader(pack / manifest.experts_file, manifest, direct=True, splits=splits, threads=threads,
                    per_batch=len(batches[0][1]))
    start = time.perf_counter()
    total = raw.read_continuous(batches, len(batches[0][1]))
    elapsed = time.perf_counter() - start
    raw.close()
    return {"bytes": total, "seconds": elapsed, "gbps": total / elapsed / GB}


def verify_slots(cache: ExpertCache, store: ExpertStore, limit: int = 4) -> int:
    """Compare a few resident slots with a fresh read: the benchmark must move real bytes."""
    checked = 0
    for (li, e), slot in list(cache._where.items())[:limit]:
        n = store.manifest.layers[li].read_nbytes
        on_device = cache.buffer[slot.index * cache.stride : slot.index * cache.stride + n].cpu()
        if not torch.equal(on_device, store.read_expert(li, e)):
            raise AssertionError(f"slot of expert {e} of pack layer {li} does not match the pack")
        checked += 1
    return checked


# 2. H2D -------------------------------------------------------------------------------------
def h2d_phase(pack: Path, *, device: str, per_batch: int, host_experts: int, seconds: float) -> dict:
    """Host tier -> device slots: every acquire misses the device tier and hits the host tier."""
    store = ExpertStore(pack, io_threads=8, stage_slots=per_batch)
    manifest = store.manifest
    stride = manifest.expert_stride
    cache = ExpertCache(store, device=device, cache_bytes=per_batch * stride, reserve_bytes=0,
                        host_cache_bytes=host_experts * stride, policy="lru")
    host_experts = cache.host.count
    li = 0
    block = manifest.layers[li].block
    groups = [list(range(i, i + per_batch)) for i in range(0, host_experts - per_batch + 1, per_batch)]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for experts in groups:  # fill the host tier from the SSD
        with cache.acquire(block, experts):
            sync()
    before = store.telemetry.snapshot()
    start = time.perf_counter()
    rounds = 0
    while time.perf_counter() - start < seconds or rounds < 2:
        for experts in groups:
            with cache.acquire(block, experts):
                sync()
        rounds += 1
    elapsed = time.perf_counter() - start
    after = store.telemetry.snapshot()
    store.close()
    moved = after["h2d_bytes"] - before["h2d_bytes"]
    n = manifest.layers[li].read_nbytes
    return {
        "bytes": moved, "seconds": elapsed, "gbps": moved / elapsed / GB,
        "host_hits": after["host_hits"] - before["host_hits"],
        "ssd_reads_during": after["reads"] - before["reads"], "chunk_bytes": n,
        "pinned": cache.host.slab.pinned,
        "baseline_chunked_gbps": raw_copy_gbps(device, n, per_batch * 4, seconds / 2),
        "baseline_large_gbps": raw_copy_gbps(device, 256 * MIB if device.startswith("cuda") else 64 * MIB, 1,
                                             seconds / 2),
    }


def raw_copy_gbps(device: str, nbytes: int, count: int, seconds: float) -> float:
    """torch copies of `count` chunks of `nbytes` from pinned host memory to `device`."""
    cuda = device.startswith("cuda")
    src = torch.empty(count * nbytes, dtype=torch.uint8, pin_memory=cuda)
    src.fill_(7)
    dst = torch.empty(count * nbytes, dtype=torch.uint8, device=device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dst.copy_(src, non_blocking=cuda)
    sync()
    moved, start = 0, time.perf_counter()
    while True:
        for i in range(count):
            dst[i * nbytes : (i + 1) * nbytes].copy_(src[i * nbytes : (i + 1) * nbytes], non_blocking=cuda)
        sync()
        moved += count * nbytes
        if time.perf_counter() - start > seconds:
            break
    return moved / (time.perf_counter() - start) / GB


# 3. Policy -----------------------------------------------------------------------------------
def policy_phase(small: bool) -> list[dict]:
    shape = (dict(layers=8, experts=64, top_k=4, tokens=200) if small
             else dict(layers=43, experts=256, top_k=6, tokens=1000))
    trace = synthetic_trace(**shape, seed=0)
    keys = shape["layers"] * shape["experts"]
    rows = []
    for fraction in (0.05, 0.15, 0.40):
        capacity = max(shape["top_k"], int(fraction * keys))
        start = time.perf_counter()
        optimal = belady_hit_rate(trace, capacity)
        ours = simulate_policy(trace, capacity, DEFAULT_POLICY)
        lru = simulate_policy(trace, capacity, "lru")
        rows.append({
            "capacity_fraction": fraction, "capacity": capacity, "belady_hit_rate": optimal,
            "ours_hit_rate": ours, "lru_hit_rate": lru, "ours_over_optimal": ours / optimal if optimal else None,
            "lru_over_optimal": lru / optimal if optimal else None, "seconds": time.perf_counter() - start,
            "policy": DEFAULT_POLICY, "trace": {**shape, "accesses": trace.accesses,
                      "generator": "engine.runtime.trace.synthetic_trace defaults"},
        })
    return rows


# Machine info ----------------------------------------------------------------------------------
def machine_info(pack: Path, device: str) -> dict:
    info = {
        "hostname": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total, "torch": torch.__version__,
        "cuda": torch.version.cuda, "device": device,
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        try:
            info["gpu_driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    info["disk"] = disk_info(pack)
    return info


def disk_info(path: Path) -> dict:
    """Filesystem and block device holding `path` (best effort, Linux)."""
    path = path.resolve()
    best = ("", "", "")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if str(path).startswith(mnt) and len(mnt) >= len(best[1]):
                best = (dev, mnt, fstype)
    except OSError:
        pass
    usage = shutil.disk_usage(path)
    info = {"device": best[0], "mount": best[1], "fstype": best[2], "total_bytes": usage.total}
    name = Path(best[0]).name
    for sys_dir in (Path("/sys/block") / name, *Path("/sys/block").glob(f"*/{name}")):
        base = sys_dir if (sys_dir / "queue").exists() else sys_dir.parent
        for key, rel in (("model", "device/model"), ("rotational", "queue/rotational")):
            try:
                info[key] = (base / rel).read_text().strip()
            except OSError:
                pass
        if "model" in info or "rotational" in info:
            break
    return info


# Main ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=default_device, help=f"device tier (default {default_device})")
    p.add_argument("--small", action="store_true", help="tiny pack and traces: a smoke test in seconds")
    p.add_argument("--pack", type=Path, help="use this pack instead of writing a synthetic one")
    p.add_argument("--workdir", type=Path, default=ROOT / "benchmarks" / ".data",
                   help="where the synthetic pack is written (put it on the SSD under test)")
    p.add_argument("--gb", type=float, default=6.0, help="size of the synthetic pack in GB")
    p.add_argument("--batch", type=int, default=16, help="experts per acquire (reads in flight)")
    p.add_argument("--read-splits", type=int, default=1, help="aligned sub-reads per expert")
    p.add_argument("--io-threads", type=int, default=16, help="I/O threads (runtime and baseline)")
    p.add_argument("--seconds", type=float, default=10.0, help="time limit per phase")
    p.add_argument("--experts", type=int, default=None, help="experts per layer of the synthetic pack (256)")
    p.add_argument("--no-drop-caches", action="store_true",
                   help="never drop the whole machine's page cache; use posix_fadvise on the pack only")
    p.add_argument("--skip-policy", action="store_true")
    p.add_argument("--keep-pack", action="store_true", help="do not delete the synthetic pack afterwards")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="folder for the JSON")
    args = p.parse_args(argv)
    if args.small:
        args.seconds = min(args.seconds, 2.0)
        args.batch = min(args.batch, 8)
    return args


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    device = args.device
    wrote_pack = args.pack is None
    if wrote_pack:
        pack = args.workdir / ("bench-small.expertpack" if args.small else "bench.expertpack")
        stride = align_up(sum(align_up(r[4]) for r in role_specs(args.small)))
        num_experts = args.experts or (32 if args.small else 256)
        layers = 2 if args.small else max(1, round(args.gb * GB / (num_experts * stride)))
        t0 = time.perf_counter()
        if pack.exists():
            shutil.rmtree(pack)
        write_pack(pack, layers=layers, num_experts=num_experts, small=args.small)
        print(f"wrote {pack} ({layers} layers x {num_experts} experts x {stride / MIB:.2f} MiB) "
              f"in {time.perf_counter() - t0:.1f}s", flush=True)
    else:
        pack = args.pack
    try:
        result = run(args, pack, device)
    finally:
        if wrote_pack and not args.keep_pack:
            shutil.rmtree(pack, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now()
    out = args.out / f"runtime-{socket.gethostname()}-{now:%Y%m%d-%H%M%S}.json"
    result["date"] = now.isoformat(timespec="seconds")
    result["command"] = [sys.executable, *sys.argv] if argv is None else ["bench_runtime.py", *argv]
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print_table(result)
    print(f"\nwrote {out}")
    return out


def run(args: argparse.Namespace, pack: Path, device: str) -> dict:
    store = ExpertStore(pack, direct_io=False)  # just for the manifest
    manifest = store.manifest
    store.close()
    experts_bin = pack / manifest.experts_file
    common = dict(splits=args.read_splits, threads=args.io_threads, seconds=args.seconds)
    result: dict = {
        "machine": machine_info(pack, device),
        "pack": {"path": str(pack), "synthetic": args.pack is None, "layers": manifest.num_layers,
                 "num_experts": manifest.num_experts, "expert_stride": manifest.expert_stride,
                 "read_nbytes": manifest.layers[0].read_nbytes, "bytes": manifest.experts_file_size},
        "settings": {"batch": args.batch, "read_splits": args.read_splits, "io_threads": args.io_threads,
                     "seconds_per_phase": args.seconds},
        "targets": {"miss_delivery_over_raw": TARGET_DELIVERY, "policy_over_optimal": TARGET_POLICY},
    }
    delivery: dict = {}
    seed = iter(range(100, 200))

    def batches():
        return batches_one_pass(manifest, args.batch, next(seed))

    print("miss delivery, O_DIRECT ...", flush=True)
    delivery["raw_direct"], delivery["cache_direct"] = miss_delivery_ab(pack, batches(), device=device, direct=True,
                                                                         **common)
    pass_batches = batches()
    limit = max(2, int(len(pass_batches) * min(1.0, args.seconds / 10)))
    delivery["raw_direct_continuous"] = raw_continuous(pack, manifest, pass_batches[:limit],
                                                       splits=args.read_splits, threads=args.io_threads)
    print("miss delivery, page cache ...", flush=True)
    system_wide = not args.no_drop_caches
    delivery["page_cache_drop_method"] = drop_page_cache(experts_bin, system_wide=system_wide)
    delivery["raw_buffered"], delivery["cache_buffered"] = miss_delivery_ab(pack, batches(), device=device,
                                                                             direct=False, **common)
    delivery["cache_direct_over_raw_direct"] = delivery["cache_direct"]["gbps"] / delivery["raw_direct"]["gbps"]
    delivery["cache_direct_over_raw_continuous"] = (delivery["cache_direct"]["gbps"]
                                                    / delivery["raw_direct_continuous"]["gbps"])
    delivery["cache_buffered_over_raw_direct"] = delivery["cache_buffered"]["gbps"] / delivery["raw_direct"]["gbps"]
    delivery["meets_target"] = delivery["cache_direct_over_raw_direct"] >= TARGET_DELIVERY
    delivery["method"] = ("raw and cache batches alternate within one pass over the pack (A/B), each expert read "
                          "at most once per pass; buffered pair after dropping the page cache")
    result["miss_delivery"] = delivery

    print("H2D ...", flush=True)
    host_experts = min(manifest.num_experts, 4 * args.batch)
    h2d = h2d_phase(pack, device=device, per_batch=args.batch, host_experts=host_experts, seconds=args.seconds / 2)
    h2d["over_chunked_baseline"] = h2d["gbps"] / h2d["baseline_chunked_gbps"]
    h2d["over_large_copy"] = h2d["gbps"] / h2d["baseline_large_gbps"]
    result["h2d"] = h2d

    if not args.skip_policy:
        print("policy vs Belady ...", flush=True)
        rows = policy_phase(args.small)
        result["policy"] = {"rows": rows, "meets_target": all(r["ours_over_optimal"] >= TARGET_POLICY for r in rows)}
    return result


def print_table(result: dict) -> None:
    d, h = result["miss_delivery"], result["h2d"]
    m = result["machine"]
    print(f"\nmachine: {m['hostname']}  {m.get('gpu', m['device'])}  torch {m['torch']}  cuda {m['cuda']}  "
          f"disk {m['disk'].get('fstype')} {m['disk'].get('device')}")
    print(f"pack: {result['pack']['layers']} layers x {result['pack']['num_experts']} experts, "
          f"{result['pack']['read_nbytes'] / MIB:.2f} MiB per expert read; batch {result['settings']['batch']}, "
          f"read_splits {result['settings']['read_splits']}, io_threads {result['settings']['io_threads']}")
    print(f"\n{'miss delivery':34} {'GB/s':>8} {'vs raw':>8}")
    raw = d["raw_direct"]["gbps"]
    for key, label in (("raw_direct", "raw O_DIRECT preadv (batched)"),
                       ("raw_direct_continuous", "raw O_DIRECT preadv (continuous)"),
                       ("cache_direct", "ExpertCache, direct_io=True"),
                       ("raw_buffered", "raw buffered preadv (batched)"),
                       ("cache_buffered", "ExpertCache, direct_io=False")):
        print(f"{label:34} {d[key]['gbps']:8.2f} {d[key]['gbps'] / raw:8.1%}")
    print(f"  page cache dropped by: {d['page_cache_drop_method']}; target >= {TARGET_DELIVERY:.0%}: "
          f"{'met' if d['meets_target'] else 'NOT met'}; acquire p50 {d['cache_direct']['acquire_ms_p50']:.1f} ms")
    print(f"\n{'H2D (host tier -> device)':34} {'GB/s':>8}")
    print(f"{'ExpertCache host hits':34} {h['gbps']:8.2f}")
    print(f"{'torch pinned copies, same chunks':34} {h['baseline_chunked_gbps']:8.2f}  "
          f"(ours {h['over_chunked_baseline']:.1%})")
    print(f"{'torch pinned copy, one large':34} {h['baseline_large_gbps']:8.2f}  (ours {h['over_large_copy']:.1%})")
    if "policy" in result:
        print(f"\n{'policy':10} {'Belady':>8} {'ours':>8} {'LRU':>8} {'ours/opt':>9} {'LRU/opt':>8}")
        for r in result["policy"]["rows"]:
            print(f"{r['capacity_fraction']:<10.0%} {r['belady_hit_rate']:8.3f} {r['ours_hit_rate']:8.3f} "
                  f"{r['lru_hit_rate']:8.3f} {r['ours_over_optimal']:9.3f} {r['lru_over_optimal']:8.3f}")


if __name__ == "__main__":
    main()
