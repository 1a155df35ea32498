"""Hostile GGUF files: every one is refused or read in bounded time and memory.

The limits are in ``packer/limits.py`` and explained in ``docs/limits.md``. Files that
could make the reader loop or allocate without bound are opened in a subprocess with
a capped address space (``RLIMIT_AS``); the subprocess reports each file's outcome,
CPU and wall time, and peak RSS over the subprocess's baseline (``VmHWM``, reset
before each file through ``/proc/self/clear_refs``) as JSON lines.

The fuzz corpus (bottom) is derived from one seed: a small valid GGUF written by
``gguf_factory`` and mutated deterministically (bit flips, truncations, counts and
lengths set to huge values, type fields set to invalid values, overlapping tensor
offsets, claims made true by growing the file, random combinations), plus the
regression files in ``tests/fixtures/hostile_gguf/``.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as V

from gguf_factory import Typed, write_gguf
from pack_fixtures import deepseek4_metadata, deepseek4_tensors, write_deepseek4
from packer import limits
from packer.adapters import UnsupportedLayoutError, plan_experts
from packer.gguf_source import GGUFFormatError, GGUFSource, split_set_paths

REPO = Path(__file__).resolve().parents[1]
TIME_LIMIT_S = 2.0  # CPU seconds (user + sys) of the worker per file: what the file costs
WALL_SLACK = 3  # wall-clock may be this much longer on a busy 2-core machine (other tests running)
MEMORY_LIMIT_MIB = 200
ADDRESS_SPACE_CAP = 1 << 30  # RLIMIT_AS of the worker: 1 GiB of virtual memory

# The worker: opens every file named in the JSON list argv[1], one after the other, and
# prints one JSON line per file. "begin" lines come first so that a hang names its file.
_WORKER = r"""
import json, os, resource, sys, time, traceback
cap = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
from packer.errors import PackBuildError
from packer.gguf_source import GGUFFormatError, GGUFSource, read_header
from packer.preflight import model_sizes


def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak():
    # Linux: writing 5 to clear_refs resets the peak-RSS mark (VmHWM) to the current RSS.
    # Without it, VmHWM (like ru_maxrss) is the peak since the start: per-file peaks only grow.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def use(path):
    # What the app does with an accepted file: every tensor view, the raw header (pack
    # builder), the expert plan and pack sizes (`expertdesk check`, the wizard).
    size = os.path.getsize(path)
    with GGUFSource.open(path) as source:
        for name, info in source.tensors.items():
            assert 0 <= info.offset and info.offset + info.nbytes <= size, name
            assert source.tensor_bytes(name).shape == (info.nbytes,), name
            if len(info.shape) >= 2:
                assert source.expert_bytes(name, info.shape[0] - 1).nbytes == info.expert_nbytes()
        read_header(path)
        try:
            model_sizes(source)
        except PackBuildError:
            pass


baseline = status_kib("VmRSS")
for path in json.loads(open(sys.argv[1]).read()):
    print(json.dumps({"begin": path}), flush=True)
    reset_peak()
    before = status_kib("VmRSS")
    start, cpu = time.perf_counter(), time.process_time()
    result = {"path": path}
    try:
        use(path)
        result["outcome"] = "accepted"
    except GGUFFormatError as err:
        result["outcome"] = "refused"
        result["message"] = str(err)
        result["names_file"] = str(err.path) == path and os.path.basename(path) in str(err)
    except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails
        result["outcome"] = "crashed"
        result["message"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:2000]
    result["seconds"] = time.perf_counter() - start
    result["cpu_seconds"] = time.process_time() - cpu
    peak = status_kib("VmHWM")
    result["rss_mib"] = (peak - before) / 1024
    result["peak_over_baseline_mib"] = (peak - baseline) / 1024
    print(json.dumps(result), flush=True)
"""


def run_worker(paths: list[Path], tmp_path: Path, *, timeout: float) -> list[dict]:
    """Open `paths` in one capped subprocess; one result dict per path, in order."""
    listing = tmp_path / f"batch-{os.getpid()}-{len(list(tmp_path.glob('batch-*')))}.json"
    listing.write_text(json.dumps([str(p) for p in paths]))
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _WORKER, str(listing), str(ADDRESS_SPACE_CAP)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
        )
        stdout, returncode, stderr = proc.stdout, proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        returncode, stderr = None, "timed out"
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    results = [line for line in lines if "begin" not in line]
    if len(results) != len(paths):
        begun = [line["begin"] for line in lines if "begin" in line]
        stuck = begun[-1] if begun else "(none)"
        raise AssertionError(f"worker stopped (exit {returncode}) while opening {stuck}: {stderr[-3000:]}")
    return results


def assert_bounded(result: dict) -> None:
    where = Path(result["path"]).name
    assert result["outcome"] in ("accepted", "refused"), f"{where}: {result['message']}"
    if result["outcome"] == "refused":
        assert result["names_file"], f"{where}: the error does not name the file: {result['message']}"
        # A MemoryError caught by the reader is a refusal in the app, but a broken limit here.
        assert "ran out of memory" not in result["message"], f"{where}: {result['message']}"
    assert result["cpu_seconds"] < TIME_LIMIT_S, f"{where}: took {result['cpu_seconds']:.2f} s of CPU time"
    assert result["seconds"] < TIME_LIMIT_S * WALL_SLACK, f"{where}: took {result['seconds']:.2f} s"
    assert result["peak_over_baseline_mib"] < MEMORY_LIMIT_MIB, (
        f"{where}: peak RSS grew by {result['peak_over_baseline_mib']:.0f} MiB"
    )


@contextlib.contextmanager
def capped_address_space(extra: int = 1 << 30):
    """Cap this process's address space at its current size + `extra` (MemoryError instead of OOM)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[0]) * resource.getpagesize()
    cap = current + extra
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# -- hand-written files ---------------------------------------------------------------


def _gguf_string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def write_string_array_gguf(path: Path, n: int, width: int = 0) -> Path:
    """A GGUF (no tensors) whose ``tokenizer.ggml.tokens`` holds `n` strings.

    ``width=0``: all empty (8 bytes each, the least a string can take); ``width=8``:
    distinct 8-character hex strings (16 bytes each). Written with numpy: GGUFWriter
    takes minutes for millions of strings.
    """
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 2)
    head += _gguf_string(b"general.architecture") + struct.pack("<I", int(V.STRING)) + _gguf_string(b"testarch")
    head += _gguf_string(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", int(V.ARRAY), int(V.STRING), n)
    records = np.zeros((n, 8 + width), np.uint8)
    records[:, :8] = np.frombuffer(struct.pack("<Q", width), np.uint8)
    if width:
        shifts = 4 * np.arange(width - 1, -1, -1, dtype=np.uint64)
        digits = (np.arange(n, dtype=np.uint64)[:, None] >> shifts) & np.uint64(15)
        records[:, 8:] = np.frombuffer(b"0123456789abcdef", np.uint8)[digits.astype(np.intp)]
    with open(path, "wb") as f:
        f.write(head)
        f.write(records.tobytes())
    return path


def write_ds4_with(path: Path, **metadata) -> Path:
    """The tiny DeepSeek-V4 test model with some metadata values replaced."""
    meta = {**deepseek4_metadata(), **metadata}
    return write_gguf(path, deepseek4_tensors(), meta, arch="deepseek4")


# -- the findings of the issue --------------------------------------------------------


def test_two_million_string_array_is_refused_or_read_within_budget(tmp_path):
    """Found: 2,097,152 empty strings took 38 s and 875 MB in GGUFSource.open."""
    path = write_string_array_gguf(tmp_path / "strings-2097152.gguf", 2_097_152)
    (result,) = run_worker([path], tmp_path, timeout=60)
    assert_bounded(result)


def test_string_array_at_the_limit_is_read_within_budget(tmp_path):
    """Right at the limit the file is accepted, and reading it stays within the budget."""
    n = limits.MAX_METADATA_STRINGS
    path = write_string_array_gguf(tmp_path / "strings-at-limit.gguf", n, width=8)
    (result,) = run_worker([path], tmp_path, timeout=60)
    assert_bounded(result)
    assert result["outcome"] == "accepted"


def test_string_array_over_the_limit_is_refused_before_reading(tmp_path):
    path = write_string_array_gguf(tmp_path / "strings-over.gguf", limits.MAX_METADATA_STRINGS + 1)
    with pytest.raises(GGUFFormatError) as info:
        GGUFSource.open(path)
    assert str(limits.MAX_METADATA_STRINGS) in str(info.value) and "docs/limits.md" in str(info.value)


ABSURD = 2**32 - 1


@pytest.mark.parametrize("key,limit", [
    ("deepseek4.block_count", limits.MAX_BLOCK_COUNT),
    ("deepseek4.expert_count", limits.MAX_EXPERTS),
    ("deepseek4.expert_used_count", limits.MAX_EXPERTS),
    ("deepseek4.nextn_predict_layers", limits.MAX_BLOCK_COUNT),
])
def test_absurd_count_is_refused_by_gguf_source(tmp_path, key, limit):
    path = write_ds4_with(tmp_path / "absurd.gguf", **{key: Typed(ABSURD, V.UINT32)})
    with capped_address_space(), pytest.raises(GGUFFormatError) as info:
        GGUFSource.open(path)
    message = str(info.value)
    assert info.value.path == path
    assert key in message and str(ABSURD) in message and f"at most {limit}" in message, message


def test_negative_block_count_is_refused(tmp_path):
    path = write_ds4_with(tmp_path / "negative.gguf", **{"deepseek4.block_count": Typed(-1, V.INT32)})
    with pytest.raises(GGUFFormatError, match="deepseek4.block_count is -1"):
        GGUFSource.open(path)


def test_absurd_block_count_is_refused_by_check(tmp_path, capsys):
    from app.cli import main

    path = write_ds4_with(tmp_path / "absurd.gguf", **{"deepseek4.block_count": Typed(ABSURD, V.UINT32)})
    with capped_address_space():
        code = main(["check", str(tmp_path), "--source", str(path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err
    assert "deepseek4.block_count" in err and str(limits.MAX_BLOCK_COUNT) in err, err


def test_absurd_block_count_is_refused_by_the_wizard_inspect_step(tmp_path):
    from app.gui.wizard_logic import inspect_gguf

    path = write_ds4_with(tmp_path / "absurd.gguf", **{"deepseek4.block_count": Typed(ABSURD, V.UINT32)})
    with capped_address_space(), pytest.raises(GGUFFormatError) as info:
        inspect_gguf(path)
    assert "deepseek4.block_count" in str(info.value) and str(limits.MAX_BLOCK_COUNT) in str(info.value)


@pytest.mark.parametrize("key", ["deepseek4.block_count", "deepseek4.nextn_predict_layers"])
def test_adapter_refuses_absurd_counts_without_allocating(tmp_path, key):
    """plan_experts takes any SourceLike: it must not trust the counts either."""
    with GGUFSource.open(write_deepseek4(tmp_path / "ok")) as source:
        source.metadata[key] = -ABSURD if key.endswith("nextn_predict_layers") else ABSURD
        with capped_address_space(), pytest.raises(UnsupportedLayoutError) as info:
            plan_experts(source)
    assert key in str(info.value) and str(limits.MAX_BLOCK_COUNT) in str(info.value)


def test_adapter_finds_a_missing_moe_layer_in_a_long_range(tmp_path):
    """A block count within the limit but past the real layers: named as the first missing one."""
    with GGUFSource.open(write_deepseek4(tmp_path / "ok")) as source:
        source.metadata["deepseek4.block_count"] = limits.MAX_BLOCK_COUNT
        with pytest.raises(UnsupportedLayoutError, match=r"blk\.4 should be an MoE layer"):
            plan_experts(source)


# -- the other limits -----------------------------------------------------------------


def test_header_counts_over_the_limits(tmp_path, monkeypatch):
    import packer.gguf_source as gguf_source

    path = write_gguf(tmp_path / "two.gguf", {"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)},
                      {"x.a": 1, "x.b": 2})
    monkeypatch.setattr(gguf_source, "MAX_TENSORS", 1)
    with pytest.raises(GGUFFormatError, match=r"2 tensors, more than the limit of 1 .*docs/limits\.md"):
        GGUFSource.open(path)
    monkeypatch.setattr(gguf_source, "MAX_TENSORS", limits.MAX_TENSORS)
    monkeypatch.setattr(gguf_source, "MAX_METADATA_KEYS", 2)
    with pytest.raises(GGUFFormatError, match=r"3 metadata entries, more than the limit of 2"):
        GGUFSource.open(path)


def test_metadata_array_elements_over_the_limit(tmp_path, monkeypatch):
    import packer.gguf_source as gguf_source

    monkeypatch.setattr(gguf_source, "MAX_METADATA_ARRAY_ELEMENTS", 5)
    path = write_gguf(tmp_path / "arr.gguf", {}, {"a.x": Typed([1, 2, 3], V.ARRAY, V.UINT8),
                                                   "a.y": Typed([1.0, 2.0, 3.0], V.ARRAY, V.FLOAT32)})
    with pytest.raises(GGUFFormatError, match="hold 6 elements .*more than the limit of 5 elements"):
        GGUFSource.open(path)


def test_string_over_the_length_limit(tmp_path, monkeypatch):
    import packer.gguf_source as gguf_source

    monkeypatch.setattr(gguf_source, "MAX_STRING_BYTES", 30)  # keys are strings too: the longest here has 21 bytes
    path = write_gguf(tmp_path / "s.gguf", {}, {"general.name": "x" * 31})
    with pytest.raises(GGUFFormatError, match="31-byte string, more than the limit of 30 bytes"):
        GGUFSource.open(path)
    path = write_gguf(tmp_path / "a.gguf", {}, {"tokenizer.ggml.tokens": ["ok", "y" * 31]})
    with pytest.raises(GGUFFormatError, match="31-byte string, more than the limit of 30 bytes"):
        GGUFSource.open(path)


def test_name_over_the_length_limit(tmp_path, monkeypatch):
    import packer.gguf_source as gguf_source

    monkeypatch.setattr(gguf_source, "MAX_NAME_BYTES", 24)  # general.architecture has 20 bytes
    key, tensor = "x." + "k" * 23, "t." + "n" * 23
    path = write_gguf(tmp_path / "k.gguf", {}, {key: 1})
    with pytest.raises(GGUFFormatError, match=f"metadata key '{key}' is 25 bytes long, more than the limit of 24"):
        GGUFSource.open(path)
    path = write_gguf(tmp_path / "t.gguf", {tensor: np.ones(4, np.float32)})
    with pytest.raises(GGUFFormatError, match=f"tensor name '{tensor}' is 25 bytes long, more than the limit of 24"):
        GGUFSource.open(path)


def test_split_name_with_an_absurd_shard_count(tmp_path):
    name = tmp_path / "M-00001-of-99999999999999.gguf"
    with capped_address_space(), pytest.raises(GGUFFormatError, match=f"at most {limits.MAX_SHARDS} shards"):
        split_set_paths(name)


def test_every_limit_is_documented():
    text = (REPO / "docs" / "limits.md").read_text()
    for name in limits.__all__:
        value = getattr(limits, name)
        if isinstance(value, int):
            assert f"`{name}`" in text, f"{name} is not in docs/limits.md"
            assert f"{value:,}" in text or str(value) in text, f"the value of {name} is not in docs/limits.md"
    for name in limits.ARCH_COUNT_LIMITS:
        assert f"`{name}`" in text, f"the count key {name} is not in docs/limits.md"


# -- the fuzz corpus ------------------------------------------------------------------

CORPUS_SEED = 20_251_201
FIXTURES = Path(__file__).parent / "fixtures" / "hostile_gguf"
CORPUS_BATCHES = 3  # subprocesses (not one per mutant: process start-up is most of the cost)


def write_seed(path: Path) -> Path:
    """The corpus's seed: a small valid deepseek2-layout MoE (packable), every metadata kind."""
    from gguf.constants import GGMLQuantizationType as Q

    from gguf_factory import quantized_bytes

    rng = np.random.default_rng(CORPUS_SEED)

    def f32(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    tensors = {
        "token_embd.weight": f32(4, 8),
        "blk.0.ffn_up.weight": f32(8, 8),
        "blk.1.attn_q.weight": quantized_bytes((2, 32), Q.Q8_0, seed=1),
        "blk.1.ffn_gate_inp.weight": f32(2, 8),
        "blk.1.ffn_gate_exps.weight": f32(2, 4, 8),
        "blk.1.ffn_up_exps.weight": f32(2, 4, 8),
        "blk.1.ffn_down_exps.weight": f32(2, 8, 4),
    }
    metadata = {
        "general.name": "hostile seed",
        "deepseek2.block_count": Typed(2, V.UINT32),
        "deepseek2.leading_dense_block_count": Typed(1, V.UINT32),
        "deepseek2.expert_count": Typed(2, V.UINT32),
        "deepseek2.expert_used_count": Typed(1, V.UINT32),
        "deepseek2.nextn_predict_layers": Typed(0, V.UINT32),
        "deepseek2.rope.freq_base": Typed(1e4, V.FLOAT32),
        "tokenizer.ggml.tokens": ["<s>", "a", "b", "héllo"],
        "tokenizer.ggml.scores": Typed([0.0, 1.0, 2.0, 3.0], V.ARRAY, V.FLOAT32),
        "tokenizer.ggml.token_type": Typed([3, 1, 1, 1], V.ARRAY, V.INT32),
    }
    return write_gguf(path, tensors, metadata, arch="deepseek2")


def seed_layout(path: Path) -> dict:
    """Where the seed's fields are, from the reference GGUFReader: every u64 and u32 field by role."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    origin = int(reader.data.ctypes.data)

    def at(part) -> int:
        return int(part.ctypes.data) - origin

    u64, u32, tensor_offsets = [], [], []
    ends = {"kv": 24, "tensors": 24}
    arrays = {}
    for name, field in reader.fields.items():
        for index, part in enumerate(field.parts):
            if part.dtype.kind in "ui" and part.dtype.itemsize in (4, 8):
                for k in range(part.size):
                    spot = (at(part) + k * part.dtype.itemsize, f"{name}[{index}]")
                    (u64 if part.dtype.itemsize == 8 else u32).append(spot)
        if not name.startswith("GGUF."):
            ends["kv"] = max(ends["kv"], at(field.parts[-1]) + field.parts[-1].nbytes)
            if field.types and field.types[0] == V.ARRAY:
                arrays[name] = (at(field.parts[4]), at(field.parts[-1]) + field.parts[-1].nbytes)
    for tensor in reader.tensors:
        parts = tensor.field.parts
        for index, part in enumerate(parts):
            for k in range(part.size if part.dtype.kind in "ui" and part.dtype.itemsize in (4, 8) else 0):
                spot = (at(part) + k * part.dtype.itemsize, f"{tensor.name}[{index}]")
                (u64 if part.dtype.itemsize == 8 else u32).append(spot)
        tensor_offsets.append((at(parts[5]), int(parts[5][0]), tensor.name))
        ends["tensors"] = max(ends["tensors"], at(parts[-1]) + parts[-1].nbytes)
    return {"u64": u64, "u32": u32, "tensor_offsets": tensor_offsets, "ends": ends, "arrays": arrays,
            "data_offset": int(reader.data_offset)}


def _put(data: bytes, at: int, fmt: str, value: int) -> bytes:
    packed = struct.pack(fmt, value)
    return data[:at] + packed[: max(0, len(data) - at)] + data[at + len(packed):]


def _grow(seed: bytes, layout: dict, at: int, extra: bytes) -> bytes:
    """`extra` inserted at `at` in the seed's header, the tensor data moved to stay aligned (32)."""
    header = seed[:layout["ends"]["tensors"]]
    header = header[:at] + extra + header[at:]
    return header + bytes(-len(header) % 32) + seed[layout["data_offset"]:]


def hostile_corpus(seed: bytes, layout: dict) -> list[tuple[str, bytes]]:
    """(kind, bytes) of every mutant of `seed`, the same on every run (CORPUS_SEED)."""
    rng = np.random.default_rng(CORPUS_SEED)
    size, header = len(seed), layout["data_offset"]
    out: list[tuple[str, bytes]] = []
    # Bit flips: one per header byte (tensor data is never parsed), plus a few in the data.
    for at in [*range(header), *rng.integers(header, size, 8).tolist()]:
        buf = bytearray(seed)
        buf[at] ^= 1 << int(rng.integers(8))
        out.append(("flip", bytes(buf)))
    # Truncations: every second header byte, a few in the data.
    for cut in [*range(0, header, 2), *rng.integers(header, size, 8).tolist()]:
        out.append(("cut", seed[:cut]))
    # Counts, lengths, dimensions, offsets set to huge values, and to just more than the file holds.
    for at, _what in layout["u64"]:
        left = size - at - 8
        for value in (0, 1, 2**16, 2_097_152, 2**24, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63, 2**64 - 1,
                      left, left // 8 + 1, left // 4 + 1):
            out.append(("u64", _put(seed, at, "<Q", value)))
    # Type fields (value, element, GGML type), n_dims and u32 values set to invalid or huge values.
    for at, _what in layout["u32"]:
        for value in (0, 5, 8, 9, 12, 13, 14, 31, 39, 40, 99, 2**16, 2**31, 2**32 - 1):
            out.append(("u32", _put(seed, at, "<I", value)))
    # Overlapping and misplaced tensors: each offset set to the others', one block off, past the end.
    offsets = [relative for _, relative, _ in layout["tensor_offsets"]]
    for at, own, _name in layout["tensor_offsets"]:
        for value in {*offsets, own + 32, own - 32, own + 1, size - header, 2**64 - 32} - {own}:
            out.append(("overlap", _put(seed, at, "<Q", value % 2**64)))
    out.extend(_grown_mutants(seed, layout))
    # Random combinations of 2-4 of the primitive mutations above, anywhere in the header.
    values32 = (0, 9, 13, 99, 2**32 - 1)
    values64 = (0, 1, 2**21, 2**32 - 1, 2**63, 2**64 - 1, size)
    for _ in range(600):
        buf = seed
        for _ in range(int(rng.integers(2, 5))):
            kind, at = int(rng.integers(5)), int(rng.integers(0, header))
            if kind == 0:
                buf = bytes(b ^ (1 << int(rng.integers(8))) if i == at else b for i, b in enumerate(buf))
            elif kind == 1:
                buf = _put(buf, at, "<B", int(rng.integers(256)))
            elif kind == 2:
                buf = _put(buf, at, "<I", values32[int(rng.integers(len(values32)))])
            elif kind == 3:
                buf = _put(buf, at, "<Q", values64[int(rng.integers(len(values64)))])
            else:
                buf = buf[: max(at, 24)]
        out.append(("random", buf))
    return out


def _grown_mutants(seed: bytes, layout: dict) -> list[tuple[str, bytes]]:
    """Claims made true by growing the file: right at each limit (accepted or refused on the
    following bytes, but read), and one past it (refused before reading)."""
    out = []
    tokens_count_at, tokens_end = layout["arrays"]["tokenizer.ggml.tokens"]
    scores_count_at, scores_end = layout["arrays"]["tokenizer.ggml.scores"]
    for extra in (limits.MAX_METADATA_STRINGS - 4, limits.MAX_METADATA_STRINGS - 3):  # 4 tokens in the seed
        grown = _grow(seed, layout, tokens_end, bytes(8 * extra))  # extra empty strings
        out.append(("grown", _put(grown, tokens_count_at, "<Q", 4 + extra)))
    for extra in (limits.MAX_METADATA_ARRAY_ELEMENTS - 12, limits.MAX_METADATA_ARRAY_ELEMENTS - 11):
        grown = _grow(seed, layout, scores_end, bytes(4 * extra))  # extra 0.0 scores; 12 elements in the seed
        out.append(("grown", _put(grown, scores_count_at, "<Q", 4 + extra)))
    (n_tensors,) = struct.unpack_from("<Q", seed, 8)
    (n_keys,) = struct.unpack_from("<Q", seed, 16)
    for total in (limits.MAX_TENSORS, limits.MAX_TENSORS + 1):  # all-zero tensor infos (24 bytes each)
        grown = _grow(seed, layout, layout["ends"]["tensors"], bytes(24 * (total - n_tensors)))
        out.append(("grown", _put(grown, 8, "<Q", total)))
    for total in (limits.MAX_METADATA_KEYS, limits.MAX_METADATA_KEYS + 1):  # distinct uint8 keys
        keys = b"".join(struct.pack("<Q", 9) + b"z.%07d" % i + struct.pack("<IB", int(V.UINT8), 1)
                        for i in range(total - n_keys))
        out.append(("grown", _put(_grow(seed, layout, layout["ends"]["kv"], keys), 16, "<Q", total)))
    return out


# Regression files (tests/fixtures/hostile_gguf/, README.md there): name -> what the refusal says.
REGRESSION_FILES = {
    "string-array-2097152.gguf.gz": "hold 2097152 strings, more than the limit of 1048576 strings",
    "block-count-4294967295.gguf": "deepseek4.block_count is 4294967295, not a count from 0 to at most 4096",
    "expert-count-4294967295.gguf": "deepseek4.expert_count is 4294967295, not a count from 0 to at most 16384",
    "tensor-count-16385.gguf.gz": "header claims 16385 tensors, more than the limit of 16384 tensors",
}


def regression_file_bytes(name: str) -> bytes:
    """What each regression file holds (the committed files are these bytes, gzipped where named .gz)."""
    head = b"GGUF" + struct.pack("<I", 3)
    arch = _gguf_string(b"general.architecture") + struct.pack("<I", int(V.STRING))
    if name == "string-array-2097152.gguf.gz":  # the issue's first finding: 38 s, 875 MB
        kvs = arch + _gguf_string(b"testarch")
        kvs += _gguf_string(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", int(V.ARRAY), int(V.STRING), 2_097_152)
        return head + struct.pack("<QQ", 0, 2) + kvs + bytes(8 * 2_097_152)
    if name in ("block-count-4294967295.gguf", "expert-count-4294967295.gguf"):  # the second: MemoryError
        key = b"deepseek4." + name.split("-count")[0].encode() + b"_count"
        kvs = arch + _gguf_string(b"deepseek4") + _gguf_string(key) + struct.pack("<II", int(V.UINT32), 2**32 - 1)
        return head + struct.pack("<QQ", 0, 2) + kvs
    if name == "tensor-count-16385.gguf.gz":  # room for every claimed tensor info, one over the limit
        kvs = arch + _gguf_string(b"testarch")
        return head + struct.pack("<QQ", 16_385, 1) + kvs + bytes(24 * 16_385)
    raise KeyError(name)


def test_regression_files_are_what_their_generator_writes():
    import gzip

    assert sorted(p.name for p in FIXTURES.iterdir() if p.name != "README.md") == sorted(REGRESSION_FILES)
    total = sum(p.stat().st_size for p in FIXTURES.iterdir())
    assert total < 2 * 2**20, f"the committed corpus is {total} bytes"
    for name in REGRESSION_FILES:
        data = (FIXTURES / name).read_bytes()
        assert (gzip.decompress(data) if name.endswith(".gz") else data) == regression_file_bytes(name), name


def test_the_seed_is_valid_and_packable(tmp_path):
    from packer.preflight import model_sizes

    with GGUFSource.open(write_seed(tmp_path / "seed.gguf")) as source:
        sizes = model_sizes(source)
        assert (sizes.moe_layers, sizes.num_experts, sizes.top_k) == (1, 2, 1)
        assert len(source.metadata["tokenizer.ggml.tokens"]) == 4


def test_fuzz_corpus_is_refused_or_read_within_budget(tmp_path):
    """Every mutant is accepted or refused with GGUFFormatError naming it, in < 2 s and < 200 MB."""
    import gzip

    seed_path = write_seed(tmp_path / "seed.gguf")
    seed = seed_path.read_bytes()
    corpus = hostile_corpus(seed, seed_layout(seed_path))
    folder = tmp_path / "corpus"
    folder.mkdir()
    paths, kinds = [], {}
    for index, (kind, data) in enumerate(corpus):
        path = folder / f"{index:05d}-{kind}.gguf"
        path.write_bytes(data)
        paths.append(path)
        kinds[str(path)] = kind
    for name in REGRESSION_FILES:
        data = (FIXTURES / name).read_bytes()
        path = folder / name.removesuffix(".gz")
        path.write_bytes(gzip.decompress(data) if name.endswith(".gz") else data)
        paths.append(path)
        kinds[str(path)] = "regression"

    results = []
    for batch in np.array_split(np.arange(len(paths)), CORPUS_BATCHES):
        results += run_worker([paths[i] for i in batch], tmp_path, timeout=180)
    for result in results:
        assert_bounded(result)
    by_name = {Path(r["path"]).name: r for r in results}
    for name, fragment in REGRESSION_FILES.items():
        result = by_name[name.removesuffix(".gz")]
        assert result["outcome"] == "refused" and fragment in result["message"], (name, result)

    summary: dict[str, dict[str, int]] = {}
    for result in results:
        counts = summary.setdefault(kinds[result["path"]], {"accepted": 0, "refused": 0})
        counts[result["outcome"]] += 1
    slowest = max(results, key=lambda r: r["cpu_seconds"])
    biggest = max(results, key=lambda r: r["peak_over_baseline_mib"])
    refused = sum(r["outcome"] == "refused" for r in results)
    print(
        f"\nhostile corpus: {len(results)} files, {refused} refused, {len(results) - refused} accepted; "
        f"max CPU {slowest['cpu_seconds']:.3f} s ({Path(slowest['path']).name}), "
        f"max wall {max(r['seconds'] for r in results):.3f} s, "
        f"max peak RSS over baseline {biggest['peak_over_baseline_mib']:.1f} MiB ({Path(biggest['path']).name}); "
        f"by kind: {json.dumps(summary, sort_keys=True)}"
    )
    # Right at the limits, the string array, the number array and the metadata keys are read, not refused.
    assert summary["grown"]["accepted"] >= 3, summary["grown"]
