"""Helpers shared by the model tests (test_deepseek4.py, test_kimi_k3.py): chunked runs
through one state, and an expert provider that proves experts come only through acquire."""

from __future__ import annotations

import random

import torch

from engine.experts import AcquiringProvider, QuantTensor


def load_dense_quantized(path, monkeypatch):
    """The model at `path` with its dense weights kept in their GGUF types, as the loader
    keeps them on a GPU where engine.kernels.quant_gemv reads them (here on the CPU: the
    per-use dequantization, or the kernels under Triton's interpreter)."""
    import engine.loader

    monkeypatch.setattr(engine.loader, "_dense_dtype", lambda *args: None)
    model = engine.loader.load_model(path)
    assert not model.weights.materialized_matrices()
    return model


def run_chunks(model, tokens: torch.Tensor, sizes) -> torch.Tensor:
    """Feed `tokens` through one fresh state in chunks of the given sizes (cycled)."""
    state = model.new_state()
    out, i, sizes = [], 0, list(sizes)
    while i < tokens.numel():
        size = sizes[len(out) % len(sizes)]
        out.append(model.forward(tokens[i : i + size], state))
        i += size
    assert state.position == tokens.numel()
    return torch.cat(out)


def run_prompt_then_rest(model, tokens: torch.Tensor, chunk: int, prompt: int) -> tuple[torch.Tensor, list[int]]:
    """The first `prompt` tokens in chunks of `chunk` with only each chunk's last logits
    (as the engine service feeds a prompt), then the rest in one chunk with all of them.
    Returns those logits, [chunks + rest, vocab], and the position of each row."""
    state = model.new_state()
    out, where = [], []
    for i in range(0, prompt, chunk):
        part = tokens[i : min(i + chunk, prompt)]
        logits = model.forward(part, state, only_last=True)
        assert logits.shape == (1, model.config.vocab_size)
        out.append(logits)
        where.append(i + part.numel() - 1)
    out.append(model.forward(tokens[prompt:], state))
    where += list(range(prompt, tokens.numel()))
    return torch.cat(out), where


class RecordingExperts(AcquiringProvider):
    """Delivers experts only through acquire, as fresh copies that are revoked on exit.

    Each batch hands out its experts in a shuffled order and keeps no reference to
    the stacked tensors, so the model cannot depend on either. Records every acquire.
    """

    def __init__(self, resident, seed: int = 0) -> None:
        self._resident = resident
        self._rng = random.Random(seed)
        self.calls: list[tuple[int, list[int]]] = []
        self.events: list[tuple[str, int, list[int]]] = []  # ("acquire" | "exact" | "guess", block, ids)

    def acquire(self, block, expert_ids):
        ids = [int(e) for e in expert_ids]
        self.calls.append((block, ids))
        self.events.append(("acquire", block, ids))
        with self._resident.acquire(block, ids) as source:
            order = list(dict.fromkeys(ids))
            self._rng.shuffle(order)
            copies = {e: {role: QuantTensor(t.raw.clone(), t.ggml_type, t.shape) for role, t in source[e].items()}
                      for e in order}
        return _RevocableBatch(copies)

    def hint(self, block, expert_ids):
        """Recorded only: hints must never change what an acquire delivers."""
        self.events.append(("exact", block, sorted({int(e) for e in expert_ids.flatten().tolist()})))

    def plan_guess(self, next_layer):
        """Recorded (when the provider would prefetch it: after this layer's acquire) only."""
        guess = torch.topk(next_layer.scores(), next_layer.k, dim=-1, sorted=True).indices
        return lambda: self.events.append(("guess", next_layer.block, [int(e) for e in guess.flatten().tolist()]))


def guessed_blocks_of_fixed_shape_steps(model, recording: RecordingExperts, tokens: torch.Tensor,
                                        prompt: int) -> list[int]:
    """Run `tokens` (a `prompt`-token chunk, then one decode step each) through the
    fixed-shape step around `recording` (eager on the CPU, one graph per stretch on a
    GPU), and check what each step hands the provider for its guess: the scores the
    stretch computed are those the eager path computes on the same input, bit for bit,
    and the provider's guess is their top-k. Returns the guessed blocks in order."""
    model.static_decode = True
    eager_next_layer = model._next_layer
    handed = []

    def spy(layer, x, scores=None):
        if scores is not None:  # the step's own call, with the stretch's scores
            handed.append((layer.index + 1, scores.clone(), eager_next_layer(layer, x.clone()).scores()))
        return eager_next_layer(layer, x, scores)

    model._next_layer = spy
    state = model.new_state()
    model.forward(tokens[:prompt], state)
    recording.events.clear()
    for token in tokens[prompt:]:
        model.forward(token.reshape(1), state)
    for _block, scores, eager in handed:
        assert torch.equal(scores, eager)
    guesses = [(b, ids) for kind, b, ids in recording.events if kind == "guess"]
    assert guesses == [(b, torch.topk(s, model.config.n_experts_used, dim=-1).indices.flatten().tolist())
                       for b, s, _e in handed]
    return [block for block, _s, _e in handed]


class _RevocableBatch:
    def __init__(self, experts) -> None:
        self._experts = experts
        self._open = False

    def __enter__(self):
        self._open = True
        return self

    def __exit__(self, *exc):
        self._open = False
        self._experts = None

    def __getitem__(self, expert):
        if not self._open:
            raise RuntimeError("expert used outside its acquire block")
        return self._experts[expert]


def count_calls(monkeypatch, owner, name: str) -> list:
    """Wrap `owner.name` (a function or method) so every call is recorded; the list of
    the calls' arguments is returned and grows as the code under test runs."""
    calls: list = []
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)
    return calls


def record_graph_buffers(monkeypatch, graphs) -> list:
    """Make `graphs` (a StepGraphs) record, per key, the addresses of the buffers its
    function updates (`mutates`) when that key is first run after a reset: what a real
    CUDA graph would have baked in. Returns the list of keys later run on other
    addresses: a graph replayed on freed buffers, on a GPU."""
    baked: dict = {}
    stale: list = []
    run, reset = graphs.run, graphs.reset

    def recording_run(key, fn, *args, mutates=()):
        ptrs = tuple(t.data_ptr() for t in mutates)
        if baked.setdefault(key, ptrs) != ptrs:
            stale.append(key)
        return run(key, fn, *args, mutates=mutates)

    def recording_reset():
        baked.clear()
        reset()

    monkeypatch.setattr(graphs, "run", recording_run)
    monkeypatch.setattr(graphs, "reset", recording_reset)
    return stale
