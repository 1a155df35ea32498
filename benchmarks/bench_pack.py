"""Benchmark the pack builder against the raw sequential bandwidth of the disk it runs on.

Writes a synthetic GGUF with DeepSeek-V4-Flash expert geometry (hidden 4096, 256
experts, moe_ff 2048, MXFP4: gate/up (256, 2048, 4096), down (256, 4096, 2048), about
3.4 GB per layer) into --dir (or --source-dir), measures the raw O_DIRECT sequential
write and read bandwidth (16 MiB requests, several in flight) and a raw copy (read and
write at the same time), then packs the GGUF end to end with build_pack and reports the
pack rate against the slower raw direction and against the raw copy. On one drive the
two directions share its bandwidth, so the raw copy is the real ceiling there.

    python benchmarks/bench_pack.py --dir /mnt/nvme/bench            # 8 GB of experts
    python benchmarks/bench_pack.py --dir /tmp/b --gb 0.2 --raw-gb 0.2  # CPU smoke test

Below one layer's size, --gb keeps the per-expert geometry and uses fewer experts.
Results go to benchmarks/results/pack-<host>-<date>.json (or --results-dir).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import shutil
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType, GGUFWriter  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

from expertpack import load_manifest  # noqa: E402
from packer.builder import PackBuilder  # noqa: E402
from packer.diskio import MIB, aligned_buffer, drop_cache, mount_point, open_for_read, open_for_write  # noqa: E402

HIDDEN, MOE_FF, EXPERTS = 4096, 2048, 256
MXFP4 = GGMLQuantizationType.MXFP4
ROLE_BYTES = MOE_FF * HIDDEN // 32 * 17  # one expert's gate (or up, or down): 4,456,448 bytes
GB = 10**9


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="folder on the disk to measure (the pack and raw test files go here)")
    p.add_argument("--source-dir", default=None,
                   help="folder for the synthetic GGUF, to pack from another drive (default: --dir)")
    p.add_argument("--gb", type=float, default=8.0, help="GB of routed experts in the synthetic model (default 8)")
    p.add_argument("--raw-gb", type=float, default=4 * 1.073741824,
                   help="size of the raw bandwidth test file (default 4 GiB)")
    p.add_argument("--request-mib", type=int, default=16, help="raw test request size (default 16 MiB)")
    p.add_argument("--depth", type=int, default=8, help="raw test requests in flight (default 8)")
    p.add_argument("--threads", type=int, default=None, help="builder worker threads (default: its own choice)")
    p.add_argument("--keep", action="store_true", help="keep the synthetic GGUF and the pack")
    p.add_argument("--results-dir", default=str(Path(__file__).resolve().parent / "results"))
    return p.parse_args(argv)


def model_shape(gb: float) -> tuple[int, int]:
    """(layers, experts per layer) for about `gb` GB of experts with the real per-expert geometry."""
    layer_bytes = 3 * ROLE_BYTES * EXPERTS
    if gb * GB >= layer_bytes:
        return max(1, round(gb * GB / layer_bytes)), EXPERTS
    return 1, max(4, int(gb * GB // (3 * ROLE_BYTES)))


def write_synthetic_gguf(path: Path, layers: int, experts: int) -> int:
    """Write the model: header via GGUFWriter, tensor data streamed from a random pool. Returns bytes."""
    rng = np.random.default_rng(1234)
    pool = rng.integers(0, 256, size=64 * MIB + 4096 * 64, dtype=np.uint8)
    block, size = GGML_QUANT_SIZES[MXFP4]
    tensors: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]] = []

    def add(name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType) -> None:
        b, s = GGML_QUANT_SIZES[qtype]
        byte_shape = (*shape[:-1], shape[-1] // b * s)
        tensors.append((name, byte_shape, qtype, int(np.prod(byte_shape))))

    add("token_embd.weight", (4096, HIDDEN), GGMLQuantizationType.Q8_0)
    for b in range(layers):
        add(f"blk.{b}.attn_norm.weight", (HIDDEN,), GGMLQuantizationType.F32)
        add(f"blk.{b}.attn_q_a.weight", (1024, HIDDEN), GGMLQuantizationType.Q8_0)
        add(f"blk.{b}.ffn_gate_inp.weight", (experts, HIDDEN), GGMLQuantizationType.F32)
        add(f"blk.{b}.ffn_gate_exps.weight", (experts, MOE_FF, HIDDEN), MXFP4)
        add(f"blk.{b}.ffn_up_exps.weight", (experts, MOE_FF, HIDDEN), MXFP4)
        add(f"blk.{b}.ffn_down_exps.weight", (experts, HIDDEN, MOE_FF), MXFP4)
    add("output_norm.weight", (HIDDEN,), GGMLQuantizationType.F32)

    w = GGUFWriter(path, "deepseek4")
    w.add_uint32("deepseek4.block_count", layers)
    w.add_uint32("deepseek4.embedding_length", HIDDEN)
    w.add_uint32("deepseek4.expert_count", experts)
    w.add_uint32("deepseek4.expert_used_count", min(6, experts))
    w.add_uint32("deepseek4.expert_feed_forward_length", MOE_FF)
    w.add_string("general.name", "synthetic DeepSeek-V4-Flash geometry (bench_pack)")
    for name, byte_shape, qtype, nbytes in tensors:
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    header = w.fout[0].tell()
    w.close()
    align = w.data_alignment
    total = 0
    with open(path, "r+b", buffering=0) as f:
        f.seek(header)
        f.write(bytes(-header % align))
        chunk = 64 * MIB
        k = 0
        for _, _, _, nbytes in tensors:
            left = nbytes
            while left:
                n = min(chunk, left)
                start = (k * 7 * 4096) % (len(pool) - chunk)  # different bytes per chunk, no CPU cost
                f.write(memoryview(pool[start : start + n]))
                left -= n
                k += 1
            f.write(bytes(-nbytes % align))
            total += nbytes
        f.flush()
        os.fsync(f.fileno())
        drop_cache(f.fileno())  # the pack must read the source from the disk, not from RAM
    return path.stat().st_size


def _run_requests(fd: int, op, nbytes: int, bufs: list, request: int) -> None:
    """Issue sequential requests of `request` bytes over [0, nbytes), len(bufs) in flight."""
    lock = threading.Lock()
    queue = iter(range(0, nbytes, request))

    def worker(slot: int) -> None:
        view = memoryview(bufs[slot])
        while True:
            with lock:
                off = next(queue, None)
            if off is None:
                return
            op(fd, view, off)

    with ThreadPoolExecutor(len(bufs)) as ex:
        list(ex.map(worker, range(len(bufs))))


def _pwrite(fd: int, view: memoryview, off: int) -> None:
    os.pwrite(fd, view, off)


def _pread(fd: int, view: memoryview, off: int) -> None:
    os.preadv(fd, [view], off)


def raw_bandwidth(read_dir: Path, write_dir: Path, nbytes: int, request: int, depth: int) -> dict:
    """Sequential O_DIRECT bandwidth in GB/s: write (in write_dir), read (in read_dir), and copy.

    `copy` reads a file in read_dir while writing another in write_dir at the same
    time, as packing does: on one drive both directions share its bandwidth, so
    this, not the slower single direction, is the ceiling for a same-disk pack.
    """
    nbytes = max(request, nbytes // request * request)
    bufs = [aligned_buffer(request) for _ in range(2 * depth)]
    for i, b in enumerate(bufs):
        b[:] = np.random.default_rng(i).integers(0, 256, size=request, dtype=np.uint8).tobytes()
    a, b = read_dir / "bench_pack_raw_a.bin", write_dir / "bench_pack_raw_b.bin"
    result = {}
    try:
        fd, direct_w = open_for_write(a if read_dir == write_dir else b, True)
        os.ftruncate(fd, nbytes)
        t0 = time.perf_counter()
        _run_requests(fd, _pwrite, nbytes, bufs[:depth], request)
        os.fsync(fd)
        result["write"] = nbytes / (time.perf_counter() - t0) / GB
        os.close(fd)
        if read_dir != write_dir:  # the file to read must live on the source drive
            fd, _ = open_for_write(a, True)
            os.ftruncate(fd, nbytes)
            _run_requests(fd, _pwrite, nbytes, bufs[:depth], request)
            os.fsync(fd)
            os.close(fd)
        fd, direct_r = open_for_read(a, True)
        t0 = time.perf_counter()
        _run_requests(fd, _pread, nbytes, bufs[:depth], request)
        result["read"] = nbytes / (time.perf_counter() - t0) / GB
        wfd, _ = open_for_write(b, True)
        os.ftruncate(wfd, nbytes)
        t0 = time.perf_counter()
        reader = threading.Thread(target=_run_requests, args=(fd, _pread, nbytes, bufs[:depth], request))
        reader.start()
        _run_requests(wfd, _pwrite, nbytes, bufs[depth:], request)
        reader.join()
        os.fsync(wfd)
        result["copy"] = nbytes / (time.perf_counter() - t0) / GB
        os.close(fd)
        os.close(wfd)
        result["direct"] = direct_w and direct_r
        return result
    finally:
        a.unlink(missing_ok=True)
        b.unlink(missing_ok=True)
        for buf in bufs:
            buf.close()


def machine_info(folder: Path) -> dict:
    info = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or "",
        "mount": str(mount_point(folder)),
    }
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        import psutil

        info["ram_bytes"] = psutil.virtual_memory().total
        for part in psutil.disk_partitions(all=True):
            if part.mountpoint == info["mount"]:
                info["device"], info["fstype"] = part.device, part.fstype
    except Exception:
        pass
    return info


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    folder = Path(args.dir)
    src_folder = Path(args.source_dir) if args.source_dir else folder
    folder.mkdir(parents=True, exist_ok=True)
    src_folder.mkdir(parents=True, exist_ok=True)
    layers, experts = model_shape(args.gb)
    src = src_folder / "bench-dsv4-geometry.gguf"
    out = folder / "bench-dsv4-geometry.expertpack"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out.with_name(out.name + ".partial"), ignore_errors=True)

    print(f"writing a synthetic GGUF: {layers} layer(s) x {experts} experts, "
          f"{3 * ROLE_BYTES / 1e6:.2f} MB per expert", file=sys.stderr)
    t0 = time.perf_counter()
    src_bytes = write_synthetic_gguf(src, layers, experts)
    t_src = time.perf_counter() - t0

    print(f"measuring raw O_DIRECT bandwidth ({args.raw_gb:.2f} GB, {args.request_mib} MiB x {args.depth})",
          file=sys.stderr)
    raw = raw_bandwidth(src_folder, folder, int(args.raw_gb * GB), args.request_mib * MIB, args.depth)

    print("packing", file=sys.stderr)
    builder = PackBuilder(src, out, threads=args.threads)
    t0 = time.perf_counter()
    builder.run()
    seconds = time.perf_counter() - t0
    m = load_manifest(out)
    pack_bytes = sum(p.stat().st_size for p in out.iterdir())
    rate = src_bytes / seconds / GB
    slower = min(raw["read"], raw["write"])
    result = {
        "benchmark": "pack",
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(["bench_pack.py", *argv]),
        "machine": machine_info(folder),
        "same_drive": mount_point(src_folder) == mount_point(folder),
        "model": {"layers": layers, "experts": experts, "expert_bytes": 3 * ROLE_BYTES, "stride": m.expert_stride},
        "source_gb": src_bytes / GB,
        "pack_gb": pack_bytes / GB,
        "seconds": seconds,
        "pack_gb_per_s": rate,
        "raw_read_gb_per_s": raw["read"],
        "raw_write_gb_per_s": raw["write"],
        "raw_copy_gb_per_s": raw["copy"],
        "raw_direct_io": raw["direct"],
        "ratio_to_slower_raw": rate / slower if slower else None,
        "ratio_to_raw_copy": rate / raw["copy"] if raw["copy"] else None,
        "builder": {
            "direct_io": builder.stats.direct_io,
            "threads": builder.threads,
            "phases_s": builder.stats.phases,
            "verified": builder.stats.verified,
        },
        "synthetic_source_write_s": t_src,
    }
    header = ["source GB", "pack GB", "seconds", "pack GB/s", "raw read GB/s", "raw write GB/s", "ratio",
              "raw copy GB/s", "ratio to copy"]
    row = [f"{result['source_gb']:.2f}", f"{result['pack_gb']:.2f}", f"{seconds:.1f}", f"{rate:.2f}",
           f"{raw['read']:.2f}", f"{raw['write']:.2f}", f"{result['ratio_to_slower_raw']:.0%}",
           f"{raw['copy']:.2f}", f"{result['ratio_to_raw_copy']:.0%}"]
    widths = [max(len(h), len(r)) for h, r in zip(header, row)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("  ".join(r.rjust(w) for r, w in zip(row, widths)))
    print("(ratio: pack rate / slower raw direction; ratio to copy: / simultaneous read+write, "
          "the ceiling when source and pack share a drive)", file=sys.stderr)

    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = results_dir / f"pack-{socket.gethostname()}-{stamp}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {path}", file=sys.stderr)
    result["results_path"] = str(path)
    if not args.keep:
        src.unlink()
        shutil.rmtree(out)
    return result


if __name__ == "__main__":
    main()
