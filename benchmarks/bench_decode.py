"""Decode benchmark: a synthetic DeepSeek-V4-Flash MoE decoded from an Expert Pack, lever by
lever, against the seed design and against the physical bound, all measured in one run.

    python benchmarks/bench_decode.py --layers 8                 # CUDA machine (~5 min)
    python benchmarks/bench_decode.py --device cpu --small       # smoke test (seconds)

The model: the real V4-Flash MoE geometry (hidden 4096, 256 routed experts, top-6,
moe_ff 2048, MXFP4 experts, the first 3 layers routed by token id through a tid2eid
table). Per layer a decode step runs
  1. a dense stand-in for attention + shared expert with the real weight bytes
     (Q8_0 q_a, q_b, kv, grouped wo_a, wo_b, compressor, indexer, shared gate/up/down:
     about 149 M parameters) through the engine's quant kernels, and a 128-position
     softmax attention over a fixed KV window;
  2. the router matmul on the hidden state (fp32, sqrt(softplus), top-6 + bias);
  3. the acquire of the selected experts from the cache under test;
  4. the SwiGLU of each expert on its real MXFP4 bytes via engine kernels, summed in
     ascending expert order (so every configuration must give bit-identical states).
Routing comes either from the router itself (random gate weights on the evolving
hidden state; the next token is sampled from a stand-in LM head, so it is closed-loop)
or from a replayed skewed trace (`engine.runtime.trace.synthetic_trace`) whose Zipf
exponent is calibrated at start-up (bisection, by replaying the trace through the
cache's own planning code) so that the seed profile's cache hits about 50% at a 14%
budget over the measured tokens.

Profiles (each lever alone on top of the seed, then all together):
  seed   the reference design: per layer route, wait for all reads (read_splits 4,
         12 staging buffers), copy, then compute; no RAM tier, no prefetch.
  a      deep I/O queue: each expert's H2D queued as soon as its read lands, up to
         DEEP_INFLIGHT experts in flight, each read in the number of aligned parts that
         read fastest with 4 experts in flight (a decode layer's misses) in this run's
         start-up probe of the drive (RAW_PROBES).
  b      acquire_streaming: resident experts computed while misses load.
  c      host-RAM tier of --host-fraction of the expert pool (clamped to free RAM),
         exclusive of VRAM: evicted experts move down to it, RAM hits move back up.
  d      exact prefetch of the hash layers' experts as soon as the token is known.
  e      speculative prefetch for layer l+1 from router l+1 on layer l's hidden state
         (trace mode: a noisy oracle with the accuracy measured in router mode).
  all    a + b + c + d + e.
  all-ram  all, but guesses only move experts up from the RAM tier, never read the SSD.
  all-top1, all-top2 (on request): all-ram, but the likeliest 1 or 2 guesses of each
         layer may read the SSD while it idles (router routing: the next router's
         ranking; trace routing: the noisy oracle's guesses are unranked).
  e-tail, all-tail (on request): guesses may also read while the acquire's own reads
         are in flight, into the queue depth those leave free.
Every configuration reports decode tok/s, hit rate, SSD GB/token, effective read
bandwidth and the bound T_bound = max(SSD bytes / raw SSD bandwidth, H2D bytes /
pinned copy bandwidth, D2H bytes / pinned copy bandwidth, all-resident compute time),
with the raw bandwidths and the all-resident compute time measured in the same run.
Prefill: a --prefill-tokens prompt in one chunk through the engine's own
`run_routed_experts` (each needed expert loaded once per chunk), seed vs all, against
the same kind of bound. The pack is read with O_DIRECT
(the page cache is also dropped after writing it).

Writes benchmarks/results/decode-<host>-<date>.json (or --out DIR), rewritten after
every configuration so a run cut short still leaves its numbers.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import hashlib
import json
import math
import os
import shutil
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
for p in (ROOT, HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_runtime import drop_page_cache, machine_info, raw_copy_gbps  # noqa: E402
from engine.experts import QuantTensor  # noqa: E402
from engine.runtime import ExpertCache, ExpertStore  # noqa: E402
from engine.runtime.policy import make_policy, plan_acquire  # noqa: E402
from engine.runtime.staging import aligned_host_buffer  # noqa: E402
from engine.runtime.trace import synthetic_trace  # noqa: E402
from packer.manifest import ALIGNMENT, align_up, experts_file_header  # noqa: E402
from synthetic_pack import bench_layers, bench_manifest, finish_pack  # noqa: E402

GB = 1e9
MIB = 1 << 20
MXFP4_ID, MXFP4_BLOCK, MXFP4_VALUES = 39, 17, 32
Q8_0_ID, Q8_0_BLOCK = 8, 34
PROFILES = ("seed", "a", "b", "c", "d", "e", "all", "all-ram")
LEVERS = {
    "seed": set(), "a": {"deep"}, "b": {"stream"}, "c": {"ram"}, "d": {"exact"}, "e": {"spec"},
    "all": {"deep", "stream", "ram", "exact", "spec"},
    # Guesses only from the RAM tier (speculative="ram"): no drive time spent on them.
    "all-ram": {"deep", "stream", "ram", "exact", "spec", "spec-ram"},
    # all-ram, but the likeliest 1 (2) guesses per layer may also read the SSD while it idles.
    "all-top1": {"deep", "stream", "ram", "exact", "spec", "spec-top1"},
    "all-top2": {"deep", "stream", "ram", "exact", "spec", "spec-top2"},
    # Variants (not run by default): guesses may share the queue with acquire reads.
    "e-tail": {"spec", "tail"}, "all-tail": {"deep", "stream", "ram", "exact", "spec", "tail"},
}
RAW_PROBES = ((4, 1), (4, 4), (4, 8), (16, 1), (32, 8))  # (experts in flight, aligned parts each)
DEEP_INFLIGHT = 32


# Geometry -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Geometry:
    hidden: int = 4096
    experts: int = 256
    top_k: int = 6
    moe_ff: int = 2048
    n_hash: int = 3
    vocab: int = 32768  # stand-in vocabulary (embedding, tid2eid, LM head); the real one is 129280
    q_lora: int = 1024
    heads: int = 64
    head_dim: int = 512
    groups: int = 8
    o_lora: int = 1024
    idx_heads: int = 64
    idx_dim: int = 128
    shared_ff: int = 2048
    window: int = 128
    routed_scaling: float = 1.5
    swiglu_limit: float = 10.0

    @property
    def roles(self) -> list[tuple[str, tuple[int, int]]]:
        return [("gate", (self.moe_ff, self.hidden)), ("up", (self.moe_ff, self.hidden)),
                ("down", (self.hidden, self.moe_ff))]

    def role_nbytes(self, shape: tuple[int, int]) -> int:
        return shape[0] * shape[1] // MXFP4_VALUES * MXFP4_BLOCK

    @property
    def stride(self) -> int:
        end = 0
        for _name, shape in self.roles:
            end = align_up(end + self.role_nbytes(shape))
        return end

    @property
    def dense_shapes(self) -> list[tuple[str, int, int]]:
        """(name, out, in) of the attention + shared-expert stand-in, as in V4-Flash."""
        return [
            ("q_a", self.q_lora, self.hidden),
            ("q_b", self.heads * self.head_dim, self.q_lora),
            ("kv", self.head_dim, self.hidden),
            ("wo_a", self.groups * self.o_lora, self.heads * self.head_dim // self.groups),
            ("wo_b", self.hidden, self.groups * self.o_lora),
            ("compressor", 4 * self.head_dim, self.hidden),
            ("idx_q_b", self.idx_heads * self.idx_dim, self.q_lora),
            ("idx_proj", self.idx_heads, self.hidden),
            ("shared_gate", self.shared_ff, self.hidden),
            ("shared_up", self.shared_ff, self.hidden),
            ("shared_down", self.hidden, self.shared_ff),
        ]


SMALL = Geometry(hidden=256, experts=32, top_k=4, moe_ff=128, n_hash=3, vocab=512, q_lora=64, heads=4,
                 head_dim=64, groups=2, o_lora=64, idx_heads=4, idx_dim=32, shared_ff=128, window=16)


# Expert bytes: one pool, every (layer, expert, role) a slice of it -------------------------------
class ExpertBytes:
    """Valid MXFP4 bytes for every expert, without storing the pool's worth of experts.

    A pool of random MXFP4 blocks (scale bytes 119..120, so weights are O(0.01) and
    activations stay O(1)); role r of expert (layer, e) is the slice starting at a
    pseudo-random block. The pack is written from these slices and the all-resident
    reference reads the same slices on the device, so both hold identical bytes.
    """

    def __init__(self, geo: Geometry, seed: int = 0) -> None:
        self.geo = geo
        self.role_blocks = [geo.role_nbytes(shape) // MXFP4_BLOCK for _n, shape in geo.roles]
        self.pool_blocks = max(self.role_blocks) * 16 + 4099
        rng = np.random.default_rng(seed)
        pool = rng.integers(0, 256, size=(self.pool_blocks, MXFP4_BLOCK), dtype=np.uint8)
        pool[:, 0] = rng.integers(119, 121, size=self.pool_blocks, dtype=np.uint8)
        self.pool = pool.reshape(-1)

    def role_start(self, layer: int, expert: int, role: int) -> int:
        """Byte offset in the pool of this role's slice (a multiple of the block size)."""
        x = (layer * 1_000_003 + expert * 7919 + role * 104_729 + 0x9E3779B9) & 0xFFFFFFFFFFFF
        x = (x * 0x2545F4914F6CDD1D) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 29
        return (x % (self.pool_blocks - self.role_blocks[role] + 1)) * MXFP4_BLOCK

    def role_slice(self, layer: int, expert: int, role: int) -> np.ndarray:
        start = self.role_start(layer, expert, role)
        return self.pool[start : start + self.role_blocks[role] * MXFP4_BLOCK]


def write_pack(directory: Path, geo: Geometry, layers: int, data: ExpertBytes, threads: int = 16) -> float:
    """A complete, valid pack (experts.bin, expert_hashes.bin, manifest) from `data`; seconds taken.

    Written by `threads` workers with pwritev straight from the pool slices (no copy),
    SHA-256 of every role computed on the way (hashlib releases the GIL).
    """
    start = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    layer_entries = bench_layers(range(layers), [(name, MXFP4_ID, "MXFP4", shape, geo.role_nbytes(shape))
                                                  for name, shape in geo.roles])
    entries = layer_entries[0].roles
    pack = dict(num_experts=geo.experts, top_k=geo.top_k, tool="expertdesk bench_decode")
    header_manifest = bench_manifest(layer_entries, **pack)
    data_start, stride, size = header_manifest.data_start, header_manifest.expert_stride, \
        header_manifest.experts_file_size

    roles = len(entries)
    digests = bytearray(layers * geo.experts * roles * 32)
    fd = os.open(directory / "experts.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, experts_file_header(header_manifest), 0)
        os.ftruncate(fd, size)

        def write(index: int) -> None:
            li, e = divmod(index, geo.experts)
            iov, at = [], 0
            for r, role in enumerate(entries):
                if role.offset > at:
                    iov.append(bytes(role.offset - at))
                piece = data.role_slice(li, e, r)
                iov.append(memoryview(piece))
                k = (index * roles + r) * 32
                digests[k : k + 32] = hashlib.sha256(memoryview(piece)).digest()
                at = role.end
            if stride > at:
                iov.append(bytes(stride - at))
            want, done, off = stride, 0, data_start + index * stride
            while done < want:  # pwritev may write less than asked
                n = os.pwritev(fd, iov, off + done)
                done += n
                if done < want:
                    flat = b"".join(bytes(v) for v in iov)[done:]
                    iov = [flat]

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(write, range(layers * geo.experts)))
        os.fsync(fd)
    finally:
        os.close(fd)
    finish_pack(directory, layer_entries, bytes(digests), **pack)
    return time.perf_counter() - start


# The synthetic model ------------------------------------------------------------------------------
def q8_0_random(out_f: int, in_f: int, device: torch.device, gen: torch.Generator) -> QuantTensor:
    """Random valid Q8_0 weights with output std about 1 for unit-rms inputs."""
    blocks = out_f * in_f // 32
    raw = torch.randint(0, 256, (blocks, Q8_0_BLOCK), dtype=torch.uint8, generator=gen, device=device)
    d = torch.tensor([1.0 / (74.0 * math.sqrt(in_f))], dtype=torch.float16).view(torch.uint8).tolist()
    raw[:, 0], raw[:, 1] = d[0], d[1]
    return QuantTensor(raw.reshape(-1), Q8_0_ID, (out_f, in_f))


def rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class SyntheticV4:
    """The decode-step model of the module docstring (dense stand-in, router, MoE)."""

    def __init__(self, geo: Geometry, layers: int, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 residual_scale: float = 0.5) -> None:
        self.geo, self.layers, self.device, self.dtype = geo, layers, device, dtype
        self.alpha = residual_scale
        gen = torch.Generator(device=device).manual_seed(seed)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device=device)

        self.dense = [{name: q8_0_random(o, i, device, gen) for name, o, i in geo.dense_shapes} for _ in range(layers)]
        self.kv_window = [randn(geo.window - 1, geo.head_dim).to(dtype) for _ in range(layers)]
        self.router = [randn(geo.experts, geo.hidden) / math.sqrt(geo.hidden) for _ in range(layers)]
        self.bias = [0.1 * randn(geo.experts) for _ in range(layers)]
        self.tid2eid = torch.rand(geo.vocab, geo.experts, generator=gen, device=device).argsort(1)[:, : geo.top_k].tolist()
        self.embed = randn(geo.vocab, geo.hidden).to(dtype)
        self.head = randn(geo.vocab, geo.hidden)  # untied, as in V4: a tied head would keep re-picking the input

    def dense_bytes(self) -> int:
        return sum(t.raw.numel() for layer in self.dense for t in layer.values())

    def attention(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        g, w = self.geo, self.dense[layer]
        qa = w["q_a"].linear(x)
        q = w["q_b"].linear(rms(qa)).view(g.heads, g.head_dim)
        kv = rms(w["kv"].linear(x))
        keys = torch.cat([self.kv_window[layer], kv], 0)
        p = torch.softmax((q @ keys.T) * g.head_dim ** -0.5, -1)
        o = (p @ keys).reshape(g.groups, -1)
        oa = w["wo_a"].linear(o).view(g.groups, g.groups, g.o_lora)
        oa = torch.diagonal(oa, dim1=0, dim2=1).T.reshape(1, -1)  # group j through its own wo_a block
        out = w["wo_b"].linear(oa)
        w["compressor"].linear(x)  # compressor, indexer: their bytes and FLOPs, outputs unused here
        w["idx_q_b"].linear(qa)
        w["idx_proj"].linear(x)
        return out

    def attention_chunk(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """`attention` for a prompt chunk x [T, hidden]: causal over the window and the chunk."""
        g, w, t = self.geo, self.dense[layer], x.shape[0]
        qa = w["q_a"].linear(x)
        q = w["q_b"].linear(rms(qa)).view(t, g.heads, g.head_dim)
        kv = rms(w["kv"].linear(x))
        keys = torch.cat([self.kv_window[layer], kv], 0)  # [W - 1 + T, head_dim]
        logits = torch.einsum("thd,kd->thk", q, keys) * g.head_dim ** -0.5
        past = self.kv_window[layer].shape[0]
        future = torch.arange(keys.shape[0], device=x.device)[None, :] > (past + torch.arange(t, device=x.device))[:, None]
        p = torch.softmax(logits.masked_fill(future[:, None, :], float("-inf")), -1)
        o = torch.einsum("thk,kd->thd", p, keys).reshape(t, g.groups, -1)
        oa = w["wo_a"].linear(o.reshape(t * g.groups, -1)).view(t, g.groups, g.groups, g.o_lora)
        oa = torch.diagonal(oa, dim1=1, dim2=2).permute(0, 2, 1).reshape(t, -1)
        out = w["wo_b"].linear(oa)
        w["compressor"].linear(x)
        w["idx_q_b"].linear(qa)
        w["idx_proj"].linear(x)
        return out

    def swiglu(self, gate: QuantTensor, up: QuantTensor, down: QuantTensor, x: torch.Tensor) -> torch.Tensor:
        lim = self.geo.swiglu_limit
        g = gate.linear(x).clamp(max=lim)
        u = up.linear(x).clamp(min=-lim, max=lim)
        return down.linear(F.silu(g) * u)

    def shared(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        w = self.dense[layer]
        return self.swiglu(w["shared_gate"], w["shared_up"], w["shared_down"], x)

    def expert(self, weights, x: torch.Tensor) -> torch.Tensor:
        return self.swiglu(weights["gate"], weights["up"], weights["down"], x)

    def scores(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(x.float() @ self.router[layer].T).sqrt()[0]

    def select(self, layer: int, scores: torch.Tensor) -> list[int]:
        return torch.topk(scores + self.bias[layer], self.geo.top_k).indices.tolist()

    def next_token(self, h: torch.Tensor, noise: torch.Tensor) -> int:
        logits = (rms(h).float() @ self.head.T)[0] / math.sqrt(self.geo.hidden)
        return int(torch.argmax(logits + noise))


class ResidentExperts:
    """All experts resident on the device (the reference): aligned copies of the pool slices."""

    def __init__(self, data: ExpertBytes, device: torch.device) -> None:
        self.data, self.device = data, device
        self.pool = torch.from_numpy(data.pool).to(device)
        self._experts: dict[tuple[int, int], dict[str, QuantTensor]] = {}

    def get(self, layer: int, expert: int) -> dict[str, QuantTensor]:
        key = (layer, expert)
        weights = self._experts.get(key)
        if weights is None:
            weights = {}
            for r, (name, shape) in enumerate(self.data.geo.roles):
                start = self.data.role_start(layer, expert, r)
                n = self.data.role_blocks[r] * MXFP4_BLOCK
                weights[name] = QuantTensor(self.pool[start : start + n].clone(), MXFP4_ID, shape)
            self._experts[key] = weights
        return weights


# Routing sources ----------------------------------------------------------------------------------
def make_trace(geo: Geometry, layers: int, tokens: int, zipf: float, seed: int) -> list[list[list[int]]]:
    trace = synthetic_trace(layers=layers, experts=geo.experts, top_k=geo.top_k, tokens=tokens, zipf=zipf,
                            segment_tokens=max(128, tokens), seed=seed)
    rows: list[list[list[int]]] = [[[] for _ in range(layers)] for _ in range(tokens)]
    for step, layer, experts in trace.acquires():
        rows[step][layer] = list(experts)
    return rows


def simulated_hit_rate(rows, layers: int, capacity: int, warm: int) -> float:
    """The seed cache's hit rate on `rows` after `warm` tokens: the cache's own planning code."""
    policy, resident = make_policy("hybrid", capacity), set()
    hits = accesses = 0
    for t, row in enumerate(rows):
        for layer in range(layers):
            keys = [(layer, e) for e in row[layer]]
            current = set(keys)
            plan = plan_acquire(policy, keys, resident.__contains__, capacity - len(resident), current.__contains__)
            resident.difference_update(plan.victims)
            resident.update(plan.misses)
            if t >= warm:
                hits += len(plan.hits)
                accesses += len(keys)
    return hits / accesses if accesses else 0.0


def calibrate_zipf(geo: Geometry, layers: int, tokens: int, warm: int, capacity: int, target: float,
                   seed: int) -> tuple[float, float, list]:
    """Bisection on the trace's Zipf exponent for a seed hit rate of `target` (monotone in zipf)."""
    lo, hi = 0.0, 2.5
    best = None
    for _ in range(14):
        mid = (lo + hi) / 2
        rows = make_trace(geo, layers, tokens, mid, seed)
        rate = simulated_hit_rate(rows, layers, capacity, warm)
        if best is None or abs(rate - target) < abs(best[1] - target):
            best = (mid, rate, rows)
        if abs(rate - target) < 0.005:
            break
        lo, hi = (mid, hi) if rate < target else (lo, mid)
    return best


def noisy_guess(true: list[int], accuracy: float, experts: int, rng: np.random.Generator) -> list[int]:
    """A speculative guess that contains each true expert with probability `accuracy`."""
    guess = [e for e in true if rng.random() < accuracy]
    others = [e for e in rng.permutation(experts).tolist() if e not in true]
    return guess + others[: len(true) - len(guess)]


# Raw bandwidths ------------------------------------------------------------------------------------
def raw_ssd_gbps(pack: Path, stride: int, count: int, nbytes: int, *, depth: int, splits: int, seconds: float,
                 seed: int) -> dict:
    """O_DIRECT preadv of whole experts, `depth` in flight, `splits` aligned parts each; random order."""
    fd = os.open(pack / "experts.bin", os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    part = align_up(-(-nbytes // splits))
    order = np.random.default_rng(seed).permutation(count).tolist()
    buffers = [aligned_host_buffer(nbytes) for _ in range(depth)]
    done_bytes = 0
    start = time.perf_counter()

    def read(i: int) -> int:
        view = memoryview(buffers[i % depth].numpy())
        offset = ALIGNMENT + order[i] * stride
        total = 0
        for a in range(0, nbytes, part):
            n = min(part, nbytes - a)
            got = 0
            while got < n:
                got += os.preadv(fd, [view[a + got : a + n]], offset + a + got)
            total += n
        return total

    try:
        with ThreadPoolExecutor(depth) as pool:
            i = 0
            while i < len(order) and time.perf_counter() - start < seconds:
                batch = list(range(i, min(len(order), i + depth)))
                done_bytes += sum(pool.map(read, batch))
                i += len(batch)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - start
    return {"gbps": done_bytes / elapsed / GB, "bytes": done_bytes, "seconds": elapsed, "depth": depth,
            "splits": splits}


# Decoding ---------------------------------------------------------------------------------------------
class Run:
    """One decode configuration over the shared token sequence."""

    def __init__(self, model: SyntheticV4, cache: ExpertCache | None, resident: ResidentExperts | None,
                 levers: set[str], routing: str, rows, noise: torch.Tensor, spec_accuracy: float,
                 first_token: int, seed: int) -> None:
        self.m, self.cache, self.resident, self.levers = model, cache, resident, levers
        self.routing, self.rows, self.noise = routing, rows, noise
        self.spec_accuracy = spec_accuracy
        self.token = first_token
        self.rng = np.random.default_rng(seed)
        self.tokens: list[int] = []
        self.digests: list[str] = []
        self.spec_total = self.spec_right = 0
        self.spec_rank_right = [0] * model.geo.top_k  # how often the guess ranked r was right
        sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
        self.sync = sync

    def experts_for(self, t: int, layer: int, x: torch.Tensor, scores: torch.Tensor) -> list[int]:
        if self.routing == "trace":
            return list(self.rows[t][layer])
        if layer < self.m.geo.n_hash:
            return list(self.m.tid2eid[self.token])
        return self.m.select(layer, scores)

    def step(self, t: int) -> None:
        m, g, cache = self.m, self.m.geo, self.cache
        if "exact" in self.levers and cache is not None:
            for layer in range(min(g.n_hash, m.layers)):  # tid2eid is known once the token is sampled
                ids = self.rows[t][layer] if self.routing == "trace" else m.tid2eid[self.token]
                cache.prefetch(layer, ids, exact=True)
        h = m.embed[self.token : self.token + 1]
        guess: list[int] | None = None
        for layer in range(m.layers):
            h = h + m.alpha * m.attention(layer, rms(h))
            x = rms(h)
            scores = m.scores(layer, x)
            ids = sorted(self.experts_for(t, layer, x, scores))
            if guess is not None:
                self.spec_total += len(ids)
                self.spec_right += len(set(ids) & set(guess))
                for r, e in enumerate(guess):
                    self.spec_rank_right[r] += e in ids
                guess = None
            nxt = layer + 1
            if "spec" in self.levers and g.n_hash <= nxt < m.layers:
                if self.routing == "trace":
                    guess = noisy_guess(self.rows[t][nxt], self.spec_accuracy, g.experts, self.rng)
                else:  # the next layer's router on this layer's hidden state
                    guess = m.select(nxt, m.scores(nxt, x))
            sel = scores[ids]
            weights = sel / sel.sum() * g.routed_scaling
            spec = (lambda: cache.prefetch(nxt, guess, exact=False)) if guess is not None and cache else None
            y = self.moe(layer, x, ids, weights, spec)
            h = h + m.alpha * (y + m.shared(layer, x))
        if self.routing == "router":
            self.token = m.next_token(h, self.noise[t])
        self.sync()
        self.tokens.append(self.token)
        self.digests.append(hashlib.sha256(h.float().cpu().numpy().tobytes()).hexdigest()[:16])

    def moe(self, layer: int, x: torch.Tensor, ids: list[int], weights: torch.Tensor, spec=None) -> torch.Tensor:
        """Routed experts; `spec` (the next layer's guesses) is issued once this acquire is
        planned, so its reads wait until this layer's own reads have been issued."""
        m = self.m
        outs: dict[int, torch.Tensor] = {}
        if self.cache is None:
            for e in ids:
                outs[e] = m.expert(self.resident.get(layer, e), x)
        elif "stream" in self.levers:
            with self.cache.acquire_streaming(layer, ids) as batch:
                if spec is not None:
                    spec()
                for e, w in batch:  # resident first, each miss as soon as its copy is queued
                    outs[e] = m.expert(w, x)
        else:
            with self.cache.acquire(layer, ids) as batch:
                if spec is not None:
                    spec()
                for e in ids:
                    outs[e] = m.expert(batch[e], x)
        y = torch.zeros_like(x)
        for k, e in enumerate(ids):  # FIXED order (ascending id): bit-identical for every provider
            y = y + weights[k].to(x.dtype) * outs[e]
        return y


def open_cache(pack: Path, profile_levers: set[str], cache_bytes: int, host_bytes: int, device: str,
               direct_io: bool, queue: tuple[int, int]) -> ExpertCache:
    """The cache under test. Seed: 12 experts in flight in 4 parts each, copies after all
    reads of a layer; "deep": `queue` = (experts in flight, parts) from the probe."""
    depth, splits = queue if "deep" in profile_levers else (12, 4)
    store = ExpertStore(pack, direct_io=direct_io, read_splits=splits, io_threads=min(64, max(16, depth * splits)),
                        stage_slots=max(depth, 12))
    speculative = "ram" if "spec-ram" in profile_levers else "tail" if "tail" in profile_levers else "idle"
    top = next((int(lever[-1]) for lever in profile_levers if lever.startswith("spec-top")), None)
    return ExpertCache(store, device=device, cache_bytes=cache_bytes, reserve_bytes=0,
                       host_cache_bytes=host_bytes if "ram" in profile_levers else 0,
                       pipeline_h2d="deep" in profile_levers, max_inflight=depth, speculative=speculative,
                       speculative_reads=top)


class Config:
    """One configuration decoding the shared token sequence, in windows (see `run_group`)."""

    def __init__(self, name: str, *, model, data, pack, rows, noise, levers, routing, budget, host_bytes, args,
                 raw, first_token, spec_accuracy) -> None:
        self.name, self.model, self.data, self.levers, self.routing, self.budget = name, model, data, levers, \
            routing, budget
        self.cache = None
        self.resident = None
        if budget is None:
            self.resident = ResidentExperts(data, model.device)
        else:
            pool_bytes = model.layers * model.geo.experts * model.geo.stride
            self.cache = open_cache(pack, levers, int(budget * pool_bytes), host_bytes, str(model.device),
                                    not args.buffered, raw["queue"])
        self.run = Run(model, self.cache, self.resident, levers, routing, rows, noise, spec_accuracy, first_token,
                       seed=args.seed + 7)
        self.t = 0
        self.measured: list[int] = []  # token indices inside timed windows
        self.elapsed = 0.0
        self.counters = {k: 0 for k in COUNTERS}

    def advance(self, n: int, *, timed: bool) -> None:
        """Decode the next `n` tokens; a timed window adds its seconds and counters. Prefetches
        still in flight at its end are waited for (untimed), so windows never overlap."""
        cache, run = self.cache, self.run
        run.sync()
        before = cache.telemetry.snapshot() if cache is not None and timed else None
        t0 = time.perf_counter()
        for _ in range(n):
            run.step(self.t)
            if timed:
                self.measured.append(self.t)
            self.t += 1
        if timed:
            self.elapsed += time.perf_counter() - t0
        if cache is not None:
            cache.drain_prefetches(timeout=60)
            if before is not None:
                for k, v in counter_delta(before, cache.telemetry.snapshot()).items():
                    self.counters[k] += v

    def finish(self, *, reference: dict | None, t_compute: float, ssd_gbps: float, pinned_gbps: float) -> dict:
        m, cache, run = self.model, self.cache, self.run
        try:
            verified = verify_cache(cache, self.resident or ResidentExperts(self.data, m.device)) if cache else 0
        finally:
            if cache is not None:
                cache.close()
                cache.store.close()
        n, elapsed = len(self.measured), self.elapsed
        out: dict = {"name": self.name, "routing": self.routing, "budget": self.budget, "levers": sorted(self.levers),
                     "tokens": n, "seconds": elapsed, "tok_s": n / elapsed, "ms_per_token": 1e3 * elapsed / n,
                     "tokens_out": [run.tokens[t] for t in self.measured],
                     "state_digests": [run.digests[t] for t in self.measured]}
        if run.spec_total:
            out["spec_accuracy"] = run.spec_right / run.spec_total
            guesses = run.spec_total / len(run.spec_rank_right)  # one guess per rank per guessed layer
            out["spec_accuracy_by_rank"] = [right / guesses for right in run.spec_rank_right]
        if cache is not None:
            d = self.counters
            looked = d["cache_hits"] + d["cache_misses"]
            terms = bound_terms(d, n, ssd_gbps, pinned_gbps, t_compute)
            t_bound = max(terms.values())
            out.update({
                "slot_count": cache.slot_count, "host_slots": cache.host.count, "counters": d,
                "cache_settings": {"read_splits": cache.store.read_splits, "io_threads": cache.store.io_threads,
                                   "stage_slots": cache.store.staging.count, "max_inflight": cache.max_inflight,
                                   "pipeline_h2d": cache.pipeline_h2d, "prefetch_depth": cache.prefetch_depth,
                                   "prefetch_limit": cache.prefetch_limit, "speculative": cache.speculative,
                                   "direct_io": cache.store.direct_io},
                "hit_rate": d["cache_hits"] / looked if looked else None,
                "hit_rate_without_prefetch": (d["cache_hits"] - d["prefetch_hits"]) / looked if looked else None,
                "ssd_gb_per_token": d["pack_read_bytes"] / GB / n, "h2d_gb_per_token": d["h2d_bytes"] / GB / n,
                "effective_read_gbps": d["pack_read_bytes"] / elapsed / GB,
                "read_over_raw": d["pack_read_bytes"] / elapsed / GB / ssd_gbps,
                "drive_busy_fraction": d["drive_busy_seconds"] / elapsed,
                "t_bound_ms": 1e3 * t_bound, "bound_terms_ms": {k: 1e3 * v for k, v in terms.items()},
                "bound_tok_s": 1 / t_bound, "over_bound": (n / elapsed) * t_bound, "verified_experts": verified,
            })
        if reference is not None:
            out["identical_to_resident"] = (out["state_digests"] == reference["state_digests"]
                                            and out["tokens_out"] == reference["tokens_out"])
        self.cache = self.resident = self.run = None
        return out


def run_group(names: list[tuple[str, set[str]]], *, common: dict, routing: str, budget: float | None, rows,
              spec_accuracy: float, args, raw_probe) -> tuple[list[Config], list[float]]:
    """Decode every configuration of one (routing, budget) group, INTERLEAVED: all are opened
    and warmed up, then measured in `args.rounds` rounds, each round one window of
    tokens/rounds tokens per configuration and one short raw-bandwidth probe. A drive
    whose speed drifts over minutes (a virtual disk does) then slows every configuration
    alike, and the raw bandwidth in the bound is measured across the same minutes.
    Returns the configurations (call `finish`) and the raw GB/s of each round."""
    configs = [Config(name, routing=routing, budget=budget, rows=rows, levers=levers, spec_accuracy=spec_accuracy,
                      **common) for name, levers in names]
    for c in configs:
        c.advance(args.warm, timed=False)
    per_round = max(1, args.tokens // args.rounds)
    raws: list[float] = []
    for _ in range(max(1, args.tokens // per_round)):
        for c in configs:
            c.advance(per_round, timed=True)
        if raw_probe is not None:
            raws.append(raw_probe())
    return configs, raws


COUNTERS = ("cache_hits", "cache_misses", "pack_read_bytes", "h2d_bytes", "d2h_bytes", "reads", "host_hits",
            "host_demotions", "prefetch_issued", "prefetch_hits", "prefetch_wasted", "prefetch_dropped", "io_errors",
            "fallback_count", "drive_busy_seconds")


def bound_terms(d: dict, per: int, ssd_gbps: float, pinned_gbps: float, t_compute: float) -> dict[str, float]:
    """Seconds per unit (token, or the whole prompt with per=1) each physical limit allows:
    SSD bytes at the raw drive bandwidth, copies each way at the pinned PCIe bandwidth,
    and the all-resident compute time. T_bound is their maximum."""
    return {"ssd": d["pack_read_bytes"] / ssd_gbps / GB / per, "h2d": d["h2d_bytes"] / pinned_gbps / GB / per,
            "d2h": d["d2h_bytes"] / pinned_gbps / GB / per, "compute": t_compute}


def counter_delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}


def verify_cache(cache: ExpertCache, resident: ResidentExperts, limit: int = 4) -> int:
    """Compare a few resident slots with the reference bytes: the benchmark moves real bytes."""
    cache.drain_prefetches(timeout=60)
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)  # copies run on the cache's own stream
    checked = 0
    for (li, e), slot in list(cache._where.items())[:limit]:
        if slot.state != "ready":
            continue
        ref = resident.get(li, e)
        layer = cache.manifest.layers[li]
        for role in layer.roles:
            got = cache.buffer[slot.index * cache.stride + role.offset : slot.index * cache.stride + role.end]
            if not torch.equal(got, ref[role.name].raw):
                raise AssertionError(f"cache slot of expert {e} of layer {li} role {role.name} differs from the pack")
        checked += 1
    return checked


def measure_compute_split(model: SyntheticV4, resident: ResidentExperts, repeats: int) -> dict:
    """Time of one expert's SwiGLU vs dequantize alone vs matmul on pre-dequantized weights."""
    x = rms(torch.randn(1, model.geo.hidden, device=model.device, dtype=model.dtype))
    w = resident.get(0, 0)
    deq = {k: v.dequantize(model.dtype) for k, v in w.items()}
    cuda = model.device.type == "cuda"

    def timed(fn) -> float:
        fn()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeats

    full = timed(lambda: model.expert(w, x))
    dq = timed(lambda: [v.dequantize(model.dtype) for v in w.values()])
    mm = timed(lambda: F.silu(x @ deq["gate"].T) * (x @ deq["up"].T) @ deq["down"].T)
    attn = timed(lambda: model.attention(0, x))
    shared = timed(lambda: model.shared(0, x))
    return {"expert_swiglu_ms": 1e3 * full, "dequantize_3_roles_ms": 1e3 * dq, "matmul_predequantized_ms": 1e3 * mm,
            "dequant_share_of_expert": dq / full if full else None, "attention_standin_ms": 1e3 * attn,
            "shared_expert_ms": 1e3 * shared,
            "expert_mxfp4_bytes": sum(v.raw.numel() for v in w.values())}


# Prefill --------------------------------------------------------------------------------------------
class _ResidentBatch(dict):
    def __enter__(self) -> _ResidentBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class ResidentProvider:
    """The all-resident reference as an ExpertProvider (acquire only)."""

    def __init__(self, resident: ResidentExperts) -> None:
        self.resident = resident

    def acquire(self, block: int, expert_ids) -> _ResidentBatch:
        return _ResidentBatch({int(e): self.resident.get(block, int(e)) for e in expert_ids})


class PlainAcquires:
    """A cache seen without `acquire_streaming`: the seed design (wait for a layer's
    reads, then compute)."""

    def __init__(self, cache: ExpertCache) -> None:
        self.acquire, self.acquire_chunks = cache.acquire, cache.acquire_chunks


def prefill_once(model: SyntheticV4, provider, cache: ExpertCache | None, tokens: torch.Tensor,
                 levers: set[str]) -> str:
    """One prompt chunk through every layer, experts through the engine's `run_routed_experts`
    (one acquire of the chunk's distinct experts per layer); the digest of the final state."""
    from engine.models.common import run_routed_experts

    m, g = model, model.geo
    table = torch.tensor(m.tid2eid, device=m.device)
    if "exact" in levers and cache is not None:
        for layer in range(min(g.n_hash, m.layers)):
            cache.prefetch(layer, sorted(set(table[tokens].flatten().tolist())), exact=True)
    h = m.embed[tokens]
    for layer in range(m.layers):
        h = h + m.alpha * m.attention_chunk(layer, rms(h))
        x = rms(h)
        scores = F.softplus(x.float() @ m.router[layer].T).sqrt()
        chosen = table[tokens] if layer < g.n_hash else torch.topk(scores + m.bias[layer], g.top_k).indices
        weights = scores.gather(1, chosen)
        weights = (weights / weights.sum(-1, keepdim=True) * g.routed_scaling).to(x.dtype)
        y = run_routed_experts(provider, layer, x, chosen, weights, m.expert)
        h = h + m.alpha * (y + m.shared(layer, x))
    if m.device.type == "cuda":
        torch.cuda.synchronize(m.device)
    return hashlib.sha256(h.float().cpu().numpy().tobytes()).hexdigest()[:16]


def run_prefill(name: str, *, model, data, pack, levers, budget, host_bytes, args, raw, tokens,
                reference: dict | None) -> dict:
    """Time one --prefill-tokens chunk; bound as for decode, compute = the all-resident run."""
    m = model
    cache = None
    if budget is None:
        provider = ResidentProvider(ResidentExperts(data, m.device))
    else:
        pool_bytes = m.layers * m.geo.experts * m.geo.stride
        cache = open_cache(pack, levers, int(budget * pool_bytes), host_bytes, str(m.device), not args.buffered,
                           raw["queue"])
        provider = cache if "stream" in levers else PlainAcquires(cache)
    try:
        before = cache.telemetry.snapshot() if cache is not None else None
        start = time.perf_counter()
        digest = prefill_once(m, provider, cache, tokens, levers)
        elapsed = time.perf_counter() - start
        after = cache.telemetry.snapshot() if cache is not None else None
    finally:
        if cache is not None:
            cache.close()
            cache.store.close()
    n = tokens.numel()
    out: dict = {"name": name, "budget": budget, "levers": sorted(levers), "prompt_tokens": n, "seconds": elapsed,
                 "tok_s": n / elapsed, "state_digest": digest}
    if cache is not None and reference is not None:
        d = counter_delta(before, after)
        terms = bound_terms(d, 1, raw["ssd_gbps"], raw["pinned_gbps"], reference["seconds"])
        t_bound = max(terms.values())
        out.update({"counters": d, "ssd_gb": d["pack_read_bytes"] / GB,
                    "effective_read_gbps": d["pack_read_bytes"] / elapsed / GB,
                    "t_bound_s": t_bound, "bound_terms_s": terms,
                    "bound_tok_s": n / t_bound, "time_over_bound": elapsed / t_bound,
                    "identical_to_resident": digest == reference["state_digest"]})
    del provider, cache
    gc.collect()
    if m.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# Main ------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=default_device)
    p.add_argument("--small", action="store_true", help="tiny geometry and few tokens: a smoke test")
    p.add_argument("--layers", type=int, default=None,
                   help="MoE layers (default: as many as fit in --max-gb of pack and the disk's free space)")
    p.add_argument("--max-gb", type=float, default=40.0, help="pack size cap for the automatic layer count")
    p.add_argument("--warm", type=int, default=None, help="warm-up tokens per configuration (not measured)")
    p.add_argument("--tokens", type=int, default=None, help="measured tokens per configuration")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved windows per configuration (the measured tokens are split among them)")
    p.add_argument("--budgets", default="0.14,0.05,0.30", help="device-tier budgets as fractions of the pool; "
                   "the first is the reference (every profile), the others run seed and all-ram")
    p.add_argument("--host-fraction", type=float, default=0.11, help="RAM tier size as a fraction of the pool")
    p.add_argument("--target-hit", type=float, default=0.50, help="seed hit rate the trace is calibrated to")
    p.add_argument("--zipf", type=float, default=None, help="trace Zipf exponent (default: calibrated)")
    p.add_argument("--spec-accuracy", type=float, default=None,
                   help="trace-mode guess accuracy (default: what router mode measured)")
    p.add_argument("--routing", default="trace,router", help="routing sources to run")
    p.add_argument("--profiles", default=",".join(PROFILES), help="profiles for the reference budget")
    p.add_argument("--router-profiles", default="seed,e,all,all-ram", help="profiles run with router routing")
    p.add_argument("--residual-scale", type=float, default=0.5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prefill-tokens", type=int, default=None, help="prompt length of the prefill runs (0 = none)")
    p.add_argument("--prefill-profiles", default="seed,all", help="profiles of the prefill runs (reference budget)")
    p.add_argument("--deadline", type=float, default=None, help="skip configurations once this many seconds passed")
    p.add_argument("--raw-seconds", type=float, default=None, help="seconds per raw bandwidth measurement")
    p.add_argument("--buffered", action="store_true", help="read the pack through the page cache (not O_DIRECT)")
    p.add_argument("--no-drop-caches", action="store_true",
                   help="never drop the whole machine's page cache; use posix_fadvise on the pack only")
    p.add_argument("--workdir", type=Path, default=ROOT / "benchmarks" / ".data")
    p.add_argument("--pack", type=Path, help="reuse this pack (written by this script with the same geometry)")
    p.add_argument("--keep-pack", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.warm is None:
        args.warm = 3 if args.small else 20
    if args.tokens is None:
        args.tokens = 3 if args.small else 20
    if args.rounds is None:
        args.rounds = 1 if args.small else 4
    if args.raw_seconds is None:
        args.raw_seconds = 0.3 if args.small else 3.0
    if args.prefill_tokens is None:
        args.prefill_tokens = 24 if args.small else 512
    return args


def choose_layers(args, geo: Geometry, workdir: Path) -> int:
    if args.layers is not None:
        return args.layers
    if args.small:
        return 5
    layer_bytes = geo.experts * geo.stride
    workdir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(workdir).free - 4 * GB
    return max(geo.n_hash + 1, min(int(args.max_gb * GB // layer_bytes), int(free // layer_bytes)))


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype)
    geo = SMALL if args.small else Geometry()
    layers = choose_layers(args, geo, args.workdir)
    data = ExpertBytes(geo, seed=args.seed)
    now = _dt.datetime.now()
    args.out.mkdir(parents=True, exist_ok=True)
    out_path = args.out / f"decode-{socket.gethostname()}-{now:%Y%m%d-%H%M%S}.json"
    result: dict = {"benchmark": "decode", "date": now.isoformat(timespec="seconds"),
                    "command": [sys.executable, *sys.argv] if argv is None else ["bench_decode.py", *argv],
                    "geometry": asdict(geo), "layers": layers, "settings": {
                        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "configs": [], "skipped": []}

    def save() -> None:
        result["elapsed_s"] = time.perf_counter() - started
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, out_path)

    wrote = args.pack is None
    pack = args.pack or (args.workdir / ("decode-small.expertpack" if args.small else "decode.expertpack"))
    if wrote:
        if pack.exists():
            shutil.rmtree(pack)
        secs = write_pack(pack, geo, layers, data)
        result["pack_write"] = {"seconds": secs, "gb": layers * geo.experts * geo.stride / GB,
                                "gbps": layers * geo.experts * geo.stride / GB / secs}
        print(f"wrote {pack}: {layers} layers x {geo.experts} experts x {geo.stride / MIB:.2f} MiB "
              f"({layers * geo.experts * geo.stride / GB:.1f} GB) in {secs:.1f}s", flush=True)
    try:
        result["page_cache_drop_method"] = drop_page_cache(pack / "experts.bin", system_wide=not args.no_drop_caches)
        result["machine"] = machine_info(pack, str(device))
        store = ExpertStore(pack, direct_io=not args.buffered)
        manifest = store.manifest
        store.close()
        if manifest.num_layers != layers or manifest.expert_stride != geo.stride:
            raise SystemExit(f"{pack} does not match this geometry ({manifest.num_layers} layers)")
        stride, nbytes = manifest.expert_stride, manifest.layers[0].read_nbytes
        pool_bytes = layers * geo.experts * stride
        result["pool_bytes"] = pool_bytes

        # Raw bandwidths, same run -------------------------------------------------------------
        count = layers * geo.experts
        raws = [raw_ssd_gbps(pack, stride, count, nbytes, depth=d, splits=s, seconds=args.raw_seconds,
                             seed=args.seed + i) for i, (d, s) in enumerate(RAW_PROBES)]
        pinned = raw_copy_gbps(str(device), nbytes, 8, args.raw_seconds / 2) if device.type == "cuda" else None
        if pinned is None:  # CPU "device": a plain memcpy of the same chunks
            src = torch.empty(8 * nbytes, dtype=torch.uint8)
            dst = torch.empty_like(src)
            t = time.perf_counter()
            for _ in range(4):
                dst.copy_(src)
            pinned = 4 * 8 * nbytes / (time.perf_counter() - t) / GB
        shallow = max((r for r in raws if r["depth"] == 4), key=lambda r: r["gbps"])  # the "deep" lever's splits
        raw = {"ssd_gbps": max(r["gbps"] for r in raws), "ssd_runs": raws, "pinned_gbps": pinned,
               "queue": (DEEP_INFLIGHT, shallow["splits"])}
        result["raw"] = raw
        runs = ", ".join(f"{r['gbps']:.2f}" for r in raws)
        print(f"raw O_DIRECT SSD {raw['ssd_gbps']:.2f} GB/s ({runs}); pinned H2D {pinned:.1f} GB/s", flush=True)
        save()

        # Model, routing sources --------------------------------------------------------------------
        model = SyntheticV4(geo, layers, device, dtype, seed=args.seed, residual_scale=args.residual_scale)
        result["dense_bytes_per_layer"] = model.dense_bytes() / layers
        total = args.warm + args.tokens
        budgets = [float(b) for b in args.budgets.split(",") if b]
        ref_capacity = int(budgets[0] * pool_bytes) // stride
        if args.zipf is None:
            zipf, rate, rows = calibrate_zipf(geo, layers, total, args.warm, ref_capacity, args.target_hit, args.seed)
        else:
            zipf = args.zipf
            rows = make_trace(geo, layers, total, zipf, args.seed)
            rate = simulated_hit_rate(rows, layers, ref_capacity, args.warm)
        sims = {f"{b:.2f}": simulated_hit_rate(rows, layers, max(geo.top_k, int(b * pool_bytes) // stride), args.warm)
                for b in budgets}
        result["trace"] = {"zipf": zipf, "target_seed_hit_rate": args.target_hit, "simulated_seed_hit_rate": rate,
                           "simulated_by_budget": sims, "generator": "engine.runtime.trace.synthetic_trace",
                           "other_params": {"topic_sigma": 1.0, "reuse": 0.3, "segment_tokens": max(128, total)},
                           "method": "bisection on zipf; hit rate of the cache's own plan_acquire over the measured "
                                     "tokens after the warm-up, at the reference budget's slot count"}
        print(f"trace: zipf {zipf:.3f} gives a simulated seed hit rate of {rate:.3f} at {budgets[0]:.0%}", flush=True)
        noise = -torch.log(-torch.log(torch.rand(total, geo.vocab, generator=torch.Generator().manual_seed(
            args.seed + 3)).clamp_min(1e-9))).to(device)
        first_token = 1
        host_bytes = int(args.host_fraction * pool_bytes)
        routings = [r for r in args.routing.split(",") if r]
        common = dict(model=model, data=data, pack=pack, noise=noise, host_bytes=host_bytes, args=args, raw=raw,
                      first_token=first_token)

        # All-resident references: compute time, states, speculative accuracy ---------------------------
        refs: dict[str, dict] = {}
        for routing in routings:
            levers = {"spec"} if routing == "router" else set()
            (cfg,), _ = run_group([(f"resident-{routing}", levers)], common=common, routing=routing, budget=None,
                                  rows=rows, spec_accuracy=0.0, args=args, raw_probe=None)
            ref = cfg.finish(reference=None, t_compute=0.0, ssd_gbps=raw["ssd_gbps"], pinned_gbps=raw["pinned_gbps"])
            refs[routing] = ref
            result.setdefault("resident", {})[routing] = ref
            print(f"all-resident ({routing}): {ref['ms_per_token']:.1f} ms/token"
                  + (f", next-layer router guess accuracy {ref['spec_accuracy']:.2f}" if "spec_accuracy" in ref else ""),
                  flush=True)
            save()
        resident = ResidentExperts(data, device)
        result["compute_split"] = measure_compute_split(model, resident, 5 if args.small else 20)
        del resident
        spec_accuracy = args.spec_accuracy
        if spec_accuracy is None:
            spec_accuracy = refs.get("router", {}).get("spec_accuracy", 0.5)
        result["trace_spec_accuracy"] = spec_accuracy

        # Configurations: groups of one routing and budget, interleaved (see run_group) ----------------------
        groups: dict[tuple[str, float], list[str]] = {}
        ref_profiles = [p for p in args.profiles.split(",") if p]
        if "trace" in routings:
            groups[("trace", budgets[0])] = ref_profiles
        if "router" in routings:
            groups[("router", budgets[0])] = [p for p in args.router_profiles.split(",") if p]
        if "trace" in routings:
            for b in budgets[1:]:
                groups[("trace", b)] = [p for p in ("seed", "all-ram") if p in ref_profiles]
        fastest = max(raws, key=lambda r: r["gbps"])
        probes = iter(range(1000, 10**6))

        def probe() -> float:  # the fastest queue shape, between windows
            return raw_ssd_gbps(pack, stride, count, nbytes, depth=fastest["depth"], splits=fastest["splits"],
                                seconds=args.raw_seconds / 3, seed=args.seed + next(probes))["gbps"]

        for (routing, budget), profiles in groups.items():
            names = [(f"{routing}-{budget:.2f}-{p}", p) for p in profiles]
            if args.deadline is not None and time.perf_counter() - started > args.deadline:
                result["skipped"] += [n for n, _ in names]
                continue
            configs, round_raws = run_group([(n, LEVERS[p]) for n, p in names], common=common, routing=routing,
                                            budget=budget, rows=rows, spec_accuracy=spec_accuracy, args=args,
                                            raw_probe=probe)
            ssd_gbps = sum(round_raws) / len(round_raws)
            result.setdefault("raw_interleaved", {})[f"{routing}-{budget:.2f}"] = round_raws
            for cfg, (name, profile) in zip(configs, names):
                row = cfg.finish(reference=refs[routing], t_compute=refs[routing]["ms_per_token"] / 1e3,
                                 ssd_gbps=ssd_gbps, pinned_gbps=raw["pinned_gbps"])
                row["profile"] = profile
                row["raw_ssd_gbps"] = ssd_gbps
                seed_row = next((c for c in result["configs"] if c["routing"] == routing and c["budget"] == budget
                                 and c["profile"] == "seed"), None)
                if seed_row is not None:
                    row["vs_seed"] = row["tok_s"] / seed_row["tok_s"]
                result["configs"].append(row)
                print(f"[{time.perf_counter() - started:5.0f}s] " + format_row(row), flush=True)
            del configs
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            save()

        # Prefill: one prompt chunk, seed vs all ---------------------------------------------------------
        if args.prefill_tokens:
            prompt = torch.randint(0, geo.vocab, (args.prefill_tokens,), generator=torch.Generator().manual_seed(
                args.seed + 11)).to(device)
            ref = run_prefill("prefill-resident", model=model, data=data, pack=pack, levers=set(), budget=None,
                              host_bytes=host_bytes, args=args, raw=raw, tokens=prompt, reference=None)
            result["prefill_resident"] = ref
            print(f"prefill all-resident: {ref['tok_s']:.1f} tok/s ({ref['seconds']:.2f} s)", flush=True)
            for profile in [p for p in args.prefill_profiles.split(",") if p]:
                name = f"prefill-{budgets[0]:.2f}-{profile}"
                if args.deadline is not None and time.perf_counter() - started > args.deadline:
                    result["skipped"].append(name)
                    continue
                row = run_prefill(name, model=model, data=data, pack=pack, levers=LEVERS[profile],
                                  budget=budgets[0], host_bytes=host_bytes, args=args, raw=raw, tokens=prompt,
                                  reference=ref)
                row["profile"] = profile
                result.setdefault("prefill", []).append(row)
                print(f"[{time.perf_counter() - started:5.0f}s] {name}: {row['tok_s']:.1f} tok/s, SSD "
                      f"{row['ssd_gb']:.1f} GB at {row['effective_read_gbps']:.2f} GB/s, bound "
                      f"{row['bound_tok_s']:.1f} tok/s (time {row['time_over_bound']:.2f}x bound), same bits "
                      f"{row['identical_to_resident']}", flush=True)
                save()
    finally:
        if wrote and not args.keep_pack:
            shutil.rmtree(pack, ignore_errors=True)
    save()
    print_table(result)
    print(f"\nwrote {out_path}")
    return out_path


def format_row(r: dict) -> str:
    return (f"{r['name']:22} {r['tok_s']:7.2f} tok/s  hit {r['hit_rate']:.3f}  SSD {r['ssd_gb_per_token']:.3f} GB/tok  "
            f"read {r['effective_read_gbps']:.2f} GB/s  drive busy {r['drive_busy_fraction']:.0%}  "
            f"bound {r['bound_tok_s']:.2f} tok/s "
            f"({r['over_bound']:.0%})  vs seed {r.get('vs_seed', 1.0):.2f}x  "
            f"same bits {r.get('identical_to_resident')}")


def print_table(result: dict) -> None:
    raw = result.get("raw", {})
    print(f"\nlayers {result['layers']}, raw SSD {raw.get('ssd_gbps', 0):.2f} GB/s, pinned H2D "
          f"{raw.get('pinned_gbps', 0):.1f} GB/s, trace zipf {result.get('trace', {}).get('zipf', 0):.3f}")
    for routing, ref in result.get("resident", {}).items():
        print(f"all-resident compute ({routing}): {ref['ms_per_token']:.1f} ms/token = {ref['tok_s']:.1f} tok/s")
    print(f"{'config':22} {'tok/s':>7} {'hit':>6} {'GB/tok':>7} {'GB/s':>6} {'bound':>7} {'of bnd':>6} {'vs seed':>7} same")
    for r in result["configs"]:
        print(f"{r['name']:22} {r['tok_s']:7.2f} {r['hit_rate']:6.3f} {r['ssd_gb_per_token']:7.3f} "
              f"{r['effective_read_gbps']:6.2f} {r['bound_tok_s']:7.2f} {r['over_bound']:6.0%} "
              f"{r.get('vs_seed', 1.0):7.2f} {r.get('identical_to_resident')}")
    for r in result.get("prefill", []):
        print(f"{r['name']:22} {r['tok_s']:7.1f} tok/s prefill, {r['time_over_bound']:.2f}x its bound "
              f"({r['bound_tok_s']:.1f} tok/s), same bits {r['identical_to_resident']}")
    if result.get("skipped"):
        print("skipped (deadline): " + ", ".join(result["skipped"]))


if __name__ == "__main__":
    main()
