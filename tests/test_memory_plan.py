"""The memory plan: KV bytes per architecture against the models' real state, the split
of device memory, the error with numbers, and the expert cache shrinking in place."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from engine.demo import ensure_demo_pack
from engine.loader import load_model, open_model
from engine.memory_plan import (
    GIB,
    MIB,
    MemoryPlanError,
    activation_bytes,
    fit_context,
    kv_size,
    plan_for_loaded,
    plan_memory,
)
from engine.models.common import state_bytes
from engine.options import RuntimeOptions
from engine.runtime import ExpertCache, ExpertStore
from pack_factory import make_pack, role_spec

KIMI = Path(__file__).parent / "fixtures" / "kimi_k3" / "tiny-f32.gguf"


def grow(model, tokens: int, seed: int = 0):
    """A state after `tokens` random tokens (one prefill chunk)."""
    vocab = model.token_embd.shape[0] if hasattr(model, "token_embd") else 100
    ids = torch.randint(0, min(vocab, 200), (tokens,), generator=torch.Generator().manual_seed(seed))
    state = model.new_state()
    with torch.inference_mode():
        model.forward(ids, state)
    return state


@pytest.fixture(scope="module")
def demo_model(demo_home):
    model, source = open_model(ensure_demo_pack(), RuntimeOptions(device="cpu", cache_mib=1),
                               buffered_fallback=lambda: None)
    yield model
    model.experts.close()
    model.experts.store.close()
    source.close()


@pytest.fixture(scope="module")
def kimi_model():
    return load_model(KIMI)


@pytest.fixture(scope="module")
def kimi_bf16_prefill_model():
    """bf16 chunks, float32 decode steps: the state is kept in float32, the plan must count it so."""
    return load_model(KIMI, RuntimeOptions(device="cpu", dtype="bfloat16", decode_dtype="float32"))


@pytest.mark.parametrize("which", ["demo_model", "kimi_model", "kimi_bf16_prefill_model"])
def test_kv_size_matches_the_state_the_model_really_keeps(which, request):
    model = request.getfixturevalue(which)
    kv = kv_size(model.config, model.decode_dtype)
    short = max(96, getattr(model.config, "sliding_window", 0) + 16)  # past the window's fill-up
    long = short + 128
    used_short = state_bytes(grow(model, short))["used"]
    long_bytes = state_bytes(grow(model, long))
    used_long, allocated_long = long_bytes["used"], long_bytes["allocated"]
    # What grows per token is the model's: compressed entries (DeepSeek-V4) or MLA rows (Kimi-K3).
    per_token = (used_long - used_short) / (long - short)
    assert per_token == pytest.approx(kv.per_token, rel=0.15), (per_token, kv.per_token, kv.detail)
    assert allocated_long <= kv.at(long)  # the plan's budget covers every allocated byte
    assert used_long >= kv.at(long) / (2 * 2 + 1)  # ... and is not wildly above it


def test_kv_detail_names_the_architecture_state(demo_model, kimi_model):
    ds = kv_size(demo_model.config, torch.bfloat16)
    assert ds.architecture == "deepseek4" and "CSA" in ds.detail and "HCA" in ds.detail
    k3 = kv_size(kimi_model.config, torch.bfloat16)
    assert k3.architecture == "kimi-k3" and "KDA" in k3.detail and "MLA" in k3.detail
    assert k3.fixed > 0  # the linear-attention state does not depend on the context
    assert kv_size(demo_model.config, torch.float32).per_token == 2 * ds.per_token


def plan(config, **changes):
    args = dict(config=config, dtype=torch.bfloat16, context_tokens=4096, device="cuda:0", device_total=24 * GIB,
                device_free=20 * GIB, dense_bytes=3 * GIB, expert_bytes=16 * MIB, top_k=6, margin=GIB,
                expert_count=100_000, ram_available=30 * GIB, ram_margin=4 * GIB)
    return plan_memory(**{**args, **changes})


def test_the_expert_cache_gets_what_the_others_leave_in_whole_experts(demo_model):
    p = plan(demo_model.config)
    parts = p.device_parts
    assert list(parts) == ["dense weights", "kv state", "activations", "margin", "expert cache"]
    assert parts["kv state"] == kv_size(demo_model.config, torch.bfloat16).at(4096)
    assert parts["expert cache"] % (16 * MIB) == 0
    assert 0 <= p.device_total - sum(parts.values()) < 16 * MIB
    assert p.reserve_bytes == parts["kv state"] + parts["activations"] + parts["margin"]
    assert p.host_cache_bytes == (26 * GIB * 3 // 4) // (16 * MIB) * (16 * MIB)
    small = plan(demo_model.config, expert_count=10)  # never more than the model's experts
    assert small.expert_cache_bytes == 10 * 16 * MIB
    bars = p.bars().splitlines()
    assert bars[0].startswith("cuda:0 memory") and len(bars) == 1 + 5 + 1 + 2
    cache_line = next(line for line in bars if "expert cache" in line)
    assert cache_line.count("#") >= 20  # most of the card


def test_nothing_fits_is_an_error_with_the_numbers(demo_model):
    with pytest.raises(MemoryPlanError) as err:
        plan(demo_model.config, device_free=GIB + 40 * MIB)
    message = str(err.value)
    assert "dense weights 3.00 GiB" in message and "KV state at 4096 tokens" in message
    assert "one layer's 6 experts 96 MiB" in message and "shorter context" in message


def test_a_growing_context_takes_its_kv_from_the_expert_cache(demo_model):
    p = plan(demo_model.config)
    assert p.for_context(100) is p  # within budget: nothing changes
    grown = p.for_context(4_000_000)
    taken = p.expert_cache_bytes - grown.expert_cache_bytes
    extra = grown.device_parts["kv state"] - p.device_parts["kv state"]
    assert extra <= taken < extra + 16 * MIB and grown.context_tokens == 4_000_000
    with pytest.raises(MemoryPlanError, match="start a new conversation"):
        p.for_context(10**12)


@pytest.fixture
def pack(tmp_path):
    roles = (role_spec("gate", 32, 64), role_spec("up", 32, 64), role_spec("down", 64, 32))
    return make_pack(tmp_path / "shrink.expertpack", blocks=(1, 2, 3), num_experts=8, top_k=2, roles=roles)


def exact(pack, batch, block, expert) -> bool:
    layer = pack.manifest.layer_for_block(block)
    return all(bytes(batch[expert][r.name].raw.numpy()) == pack.role_bytes(block, expert, r.name)
               for r in layer.roles)


def open_cache(pack, slots: int, policy: str = "forecast") -> ExpertCache:
    store = ExpertStore(pack.path, io_threads=2, stage_slots=4)
    return ExpertCache(store, device="cpu", cache_bytes=slots * pack.manifest.expert_stride, reserve_bytes=0,
                       policy=policy)


@pytest.mark.parametrize("policy", ["forecast", "hybrid", "lru"])
def test_shrink_keeps_the_policys_choice_byte_exact_and_releases_slots(pack, policy):
    cache = open_cache(pack, 12, policy)
    stride = pack.manifest.expert_stride
    try:
        for pairs in [[0, 1]] * 4 + [[2, 3], [4, 5], [0, 1]]:  # experts 0 and 1 are the hot ones
            for block in (1, 2, 3):
                with cache.acquire(block, pairs):
                    pass
        assert cache.resident_count() == 12
        before = cache.telemetry.snapshot()
        assert cache.shrink(7 * stride + stride // 2) == 7  # whole slots
        assert cache.slot_count == 7 and cache.buffer.numel() == 7 * stride
        assert cache.resident_count() <= 7 and cache.max_experts_per_acquire == 7
        snap = cache.telemetry.snapshot()
        assert snap["slot_count"] == 7 and snap["cache_bytes"] == 7 * stride
        assert snap["cache_evictions"] - before["cache_evictions"] == 12 - cache.resident_count()
        kept = [(b, e) for b in (1, 2, 3) for e in range(8) if cache.slot_of(b, e) is not None]
        assert all(cache.slot_of(b, e) < 7 for b, e in kept)
        assert {(b, e) for b in (1, 2, 3) for e in (0, 1)} <= set(kept)  # the policy kept the hot ones
        hits = cache.telemetry.get("cache_hits")
        for block, expert in kept:  # their bytes moved with them
            with cache.acquire(block, [expert]) as batch:
                assert exact(pack, batch, block, expert)
        assert cache.telemetry.get("cache_hits") - hits == len(kept)
        for block in (1, 2, 3):  # and the smaller cache keeps working
            for pair in ([6, 7], [0, 5]):
                with cache.acquire(block, pair) as batch:
                    assert all(exact(pack, batch, block, e) for e in pair)
        assert cache.resident_count() <= 7
    finally:
        cache.close()
        cache.store.close()


def test_shrink_refuses_what_it_cannot_do(pack):
    cache = open_cache(pack, 6)
    stride = pack.manifest.expert_stride
    try:
        with cache.acquire(1, [0, 1]):
            with pytest.raises(RuntimeError, match="release them first"):
                cache.shrink(3 * stride)
        assert cache.slot_count == 6
        with pytest.raises(ValueError, match="one MoE layer uses 2 experts"):
            cache.shrink(stride)
        assert cache.shrink(100 * stride) == 6  # never grows
    finally:
        cache.close()
        cache.store.close()


def test_fit_context_shrinks_the_demo_cache_and_the_model_stays_exact(demo_home):
    model, source = open_model(ensure_demo_pack(), RuntimeOptions(device="cpu"), buffered_fallback=lambda: None)
    cache = model.experts
    try:
        loaded = model.memory_plan  # the loader planned the cache (no cache_mib given)
        assert loaded.expert_cache_bytes == cache.slot_count * cache.stride
        ids = torch.tensor([5, 17, 42, 99, 7, 3, 64, 12])
        with torch.inference_mode():
            reference = model.forward(ids, model.new_state())
        kv = kv_size(model.config, model.decode_dtype)
        need = (kv.at(4096) - kv.at(16) + cache.stride - 1) // cache.stride  # experts 4096 tokens take
        slots = need + 8
        # A device so small that the plan at 16 tokens leaves `slots` experts, and 4096 tokens 8.
        free = kv.at(16) + activation_bytes(model.config, 16, model.dtype) + MIB + slots * cache.stride
        forced = plan_memory(config=model.config, dtype=model.dtype, context_tokens=16, device="cpu",
                             device_total=free, device_free=free, dense_bytes=0, expert_bytes=cache.stride,
                             top_k=model.config.n_experts_used, margin=MIB, expert_count=64)
        assert forced.expert_cache_bytes == slots * cache.stride
        model.memory_plan = forced
        cache.shrink(forced.expert_cache_bytes)
        plan_now = fit_context(model, 4096)
        assert cache.slot_count == slots - need == 8 and plan_now.context_tokens == 4096
        assert model.memory_plan is plan_now
        with torch.inference_mode():
            assert torch.equal(model.forward(ids, model.new_state()), reference)
        with pytest.raises(MemoryPlanError, match="start a new conversation"):
            fit_context(model, 10**9)
    finally:
        cache.close()
        cache.store.close()
        source.close()


def test_plan_for_loaded_measures_this_machine(demo_model):
    p = plan_for_loaded(demo_model, 1 << 20, 2, 64, torch.device("cpu"), context_tokens=512)
    assert p.device == "cpu" and p.context_tokens == 512 and p.expert_cache_bytes <= 64 << 20
    assert p.device_parts["dense weights"] > 0  # this process's memory, the dense weights among it


def test_the_service_fits_the_context_before_each_reply(demo_home, monkeypatch):
    import engine.service as service_module
    from engine.service import EngineService
    from engine.service_events import DoneEvent, GenerateRequest
    from engine.text.sampling import SamplingParams

    calls = []
    monkeypatch.setattr(service_module, "fit_context", lambda model, tokens: calls.append(tokens))
    events = []
    service = EngineService(events.append, RuntimeOptions(device="cpu"))
    try:
        service.load("demo")
        assert service.wait_idle(120)
        service.submit(GenerateRequest([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3)))
        assert service.wait_idle(120)
    finally:
        service.shutdown()
    done = [e for e in events if isinstance(e, DoneEvent)]
    assert done and len(calls) == 1
    assert calls[0] == done[0].stats.prompt_tokens + 3


def test_check_shows_the_plan_as_bars(demo_home, tmp_path, capsys):
    from app.cli import main
    from engine.demo import GGUF_NAME

    gguf = ensure_demo_pack().parent / GGUF_NAME
    assert gguf.is_file()
    main(["check", str(tmp_path / "packs"), "--source", str(gguf)])
    text = capsys.readouterr().out
    assert "memory plan" in text
    bars = [line for line in text.splitlines() if line.strip().startswith(("dense weights", "KV @", "expert cache"))]
    assert len(bars) == 3 and all("[" in line and "]" in line for line in bars)
    main(["check", str(tmp_path / "packs"), "--source", str(gguf), "--json"])
    data = json.loads(capsys.readouterr().out)
    parts = data["memory_plan"]["device_parts"]
    assert set(parts) == {"dense weights", "kv state", "activations", "margin", "expert cache"}
    model = data["measurements"]["model"]
    assert parts["dense weights"] == model["dense_bytes"]
    assert parts["expert cache"] == model["moe_layers"] * model["num_experts"] * model["expert_block_bytes"]
    assert data["memory_plan"]["kv"]["architecture"] == "deepseek4"


def test_grouped_decode_reads_the_shrunk_pool(demo_home, monkeypatch):
    """The GPU's grouped decode path (run here on the CPU) keeps views of the slot pool;
    after a shrink it must read the new pool: the same logits, step by step, as before."""
    import engine.experts
    import engine.runtime.routed

    monkeypatch.setattr(engine.experts, "GROUPED_DEVICES", ("cuda", "cpu"))
    calls = []
    grouped = engine.runtime.routed.grouped_expert_mlp
    monkeypatch.setattr(engine.runtime.routed, "grouped_expert_mlp",
                        lambda *a, **k: calls.append(a[3].table.data_ptr()) or grouped(*a, **k))
    model, source = open_model(ensure_demo_pack(), RuntimeOptions(device="cpu"), buffered_fallback=lambda: None)
    cache = model.experts
    ids = [5, 17, 42, 99, 7, 3, 64, 12]

    def decode() -> list[torch.Tensor]:
        state = model.new_state()
        with torch.inference_mode():
            return [model.forward(torch.tensor([t]), state) for t in ids]

    try:
        reference = decode()
        before = cache.buffer.data_ptr()
        cache.shrink((cache.slot_count // 2) * cache.stride)
        calls.clear()
        again = decode()
        assert cache.buffer.data_ptr() != before and calls and set(calls) == {cache.buffer.data_ptr()}
        assert all(torch.equal(a, b) for a, b in zip(again, reference))
        # ... and no view of the old pool stays behind to keep its memory alive.
        todo, stale = [vars(cache)], []
        while todo:
            obj = todo.pop()
            if isinstance(obj, torch.Tensor):
                stale += [obj] if obj.untyped_storage().data_ptr() == before else []
            elif isinstance(obj, dict):
                todo.extend(obj.values())
            elif isinstance(obj, (list, tuple)):
                todo.extend(obj)
            elif dataclasses.is_dataclass(obj):
                todo.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
        assert not stale
    finally:
        cache.close()
        cache.store.close()
        source.close()


def test_shrink_drops_the_grouped_paths_views_of_the_old_pool(pack):
    """shrink() releases the old pool at once, not at the next grouped decode: a prefill
    (too many pairs to run grouped) must not run with both pools held."""
    stride = pack.manifest.expert_stride
    cache = ExpertCache(ExpertStore(pack.path, io_threads=2, stage_slots=4), device="cpu",
                        cache_bytes=12 * stride, reserve_bytes=0)
    try:
        cache._slot_rows(1)  # what the grouped decode path builds on its first call
        old = cache.buffer.untyped_storage().data_ptr()
        cache.shrink(6 * stride)
        alive = [rows.table.untyped_storage().data_ptr()
                 for table in cache.__dict__.get("_slot_tables", {}).values() if table
                 for rows in table.values()]
        assert cache.buffer.untyped_storage().data_ptr() != old and old not in alive
    finally:
        cache.close()
        cache.store.close()


def test_a_large_max_tokens_does_not_fail_a_short_reply_on_a_tight_plan(demo_home):
    """Clients send max_tokens = the whole context as a matter of course: the plan reserves
    a reply's worth of KV (REPLY_RESERVE_TOKENS), not max_tokens, so "hi" still answers."""
    from engine.service import EngineService
    from engine.service_events import DoneEvent, ErrorEvent, GenerateRequest
    from engine.text.sampling import SamplingParams

    events: list = []
    service = EngineService(events.append, RuntimeOptions(device="cpu"))
    try:
        service.load("demo")
        assert service.wait_idle(120)
        loaded = service._loaded
        model, cache, ctx = loaded.model, loaded.model.experts, loaded.context_length
        kv = kv_size(model.config, model.decode_dtype)
        k = model.config.n_experts_used
        # 512 tokens of context leave a 4k-expert cache; the whole window would not fit.
        free = kv.at(512) + activation_bytes(model.config, 512, model.dtype) + MIB + 4 * k * cache.stride
        assert kv.at(ctx) - kv.at(512) > 3 * k * cache.stride
        model.memory_plan = plan_memory(config=model.config, dtype=model.dtype, context_tokens=512, device="cpu",
                                        device_total=free, device_free=free, dense_bytes=0,
                                        expert_bytes=cache.stride, top_k=k, margin=MIB, expert_count=10**6)
        cache.shrink(model.memory_plan.expert_cache_bytes)
        events.clear()
        service.submit(GenerateRequest([{"role": "user", "content": "hi"}],
                                       SamplingParams(max_tokens=ctx, stop=[" "], seed=0)))
        assert service.wait_idle(120)
    finally:
        service.shutdown()
    errors = [e for e in events if isinstance(e, ErrorEvent)]
    assert not errors, errors[0].message
    assert any(isinstance(e, DoneEvent) for e in events)


def test_close_drops_the_grouped_paths_views_of_the_pool(pack):
    """close() releases the device tier: no view of it may keep the memory alive."""
    stride = pack.manifest.expert_stride
    cache = ExpertCache(ExpertStore(pack.path, io_threads=2, stage_slots=4), device="cpu",
                        cache_bytes=12 * stride, reserve_bytes=0)
    try:
        cache._slot_rows(1)
        old = cache.buffer.untyped_storage().data_ptr()
        cache.close()
        alive = [rows.table.untyped_storage().data_ptr()
                 for table in cache.__dict__.get("_slot_tables", {}).values() if table for rows in table.values()]
        assert old not in alive
    finally:
        cache.store.close()


# -- prompt chunks ---------------------------------------------------------------------------


def real_widths(config):
    """The demo's config at DeepSeek-V4-Flash's real widths (what a chunk's rows scale with)."""
    return dataclasses.replace(config, hidden_size=4096, hc_mult=4, n_heads=64, n_experts_used=6, expert_ffn=2048)


def test_the_plan_gives_long_prompt_chunks_at_most_a_quarter_of_the_cache(demo_model):
    config = real_widths(demo_model.config)
    act = {c: activation_bytes(config, 4096, torch.bfloat16, c) for c in (512, 1024, 2048)}
    cost = {c: act[c] - act[512] for c in (1024, 2048)}
    assert 0 < cost[1024] < cost[2048] < 2 * cost[1024] + act[512]
    kv = kv_size(config, torch.bfloat16).at(4096)

    def with_cache(cache_512: int):
        """The plan when chunks of 512 would leave `cache_512` bytes to the cache (1 MiB experts)."""
        return plan(config, device_free=kv + act[512] + GIB + cache_512, expert_bytes=MIB)

    for cache_512, chunk in [(4 * cost[2048] + 8 * MIB, 2048), (4 * cost[2048] - 8 * MIB, 1024),
                             (4 * cost[1024] + 8 * MIB, 1024), (4 * cost[1024] - 8 * MIB, 512)]:
        p = with_cache(cache_512)
        assert p.prompt_chunk == chunk, (cache_512, chunk)
        assert p.device_parts["activations"] == act[chunk]
        assert p.expert_cache_bytes >= cache_512 * 3 // 4 - MIB  # decode keeps 3/4 of its cache
        assert f"prompt chunks of {chunk} tokens" in p.bars().splitlines()[0]
        assert p.to_dict()["prompt_chunk"] == chunk
    assert with_cache(4 * cost[2048] + 8 * MIB).for_context(8192).prompt_chunk == 2048  # a longer context keeps it


def test_a_model_without_a_plan_takes_the_chunk_a_quarter_of_its_free_memory_holds(demo_model, monkeypatch):
    import engine.memory as memory
    from engine.memory_plan import DEFAULT_CONTEXT_TOKENS, prompt_chunk

    act = {c: activation_bytes(demo_model.config, DEFAULT_CONTEXT_TOKENS, demo_model.dtype, c)
           for c in (512, 1024, 2048)}
    assert getattr(demo_model, "memory_plan", None) is None  # the demo's cache has a given size
    for free, chunk in [(4 * act[2048], 2048), (4 * act[2048] - 4, 1024), (4 * act[1024] - 4, 512), (0, 512)]:
        monkeypatch.setattr(memory, "free_device_memory", lambda device, free=free: free)
        assert prompt_chunk(demo_model) == chunk
    monkeypatch.setattr(demo_model, "memory_plan", dataclasses.replace(plan(demo_model.config), prompt_chunk=1024),
                        raising=False)
    assert prompt_chunk(demo_model) == 1024  # a plan's choice stands

