"""Sampler filters against a plain reference implementation, seeding, and StopChecker."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.text import GGUFTokenizer, Sampler, SamplingParams, StopChecker, StopReason, StreamDecoder, sampling

# --------------------------------------------------------------------------- parameters


def test_defaults_and_stop_list():
    p = SamplingParams(stop=["###", "\nUser:"])
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens, p.seed) == (
        0.7, 0.95, 40, 0.05, 1.0, 1024, None
    )
    assert p.stop == ("###", "\nUser:") and not p.greedy
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"seed": "42"}, "seed"),
        ({"stop": "STOP"}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_invalid_params_rejected(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kwargs)


# --------------------------------------------------------------------------- reference filters


def reference_distribution(logits, prev, p: SamplingParams) -> np.ndarray:
    """Straightforward HF-order filtering in float64: penalty, temperature, top-k, top-p, min-p."""
    x = np.array(logits, dtype=np.float64)
    for t in set(prev):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    x = x / p.temperature
    keep = np.ones(len(x), dtype=bool)

    def probs_of(mask):
        z = np.where(mask, x, -np.inf)
        e = np.exp(z - z[mask].max())
        return e / e.sum()

    if 0 < p.top_k < len(x):
        kth = sorted(x, reverse=True)[p.top_k - 1]
        keep &= x >= kth
    if p.top_p < 1:
        probs = probs_of(keep)
        order = sorted(np.flatnonzero(keep), key=lambda i: (-probs[i], i))
        mass, kept = 0.0, set()
        for n, i in enumerate(order):
            if n == 0 or mass < p.top_p:
                kept.add(i)
            mass += probs[i]
        keep &= np.isin(np.arange(len(x)), list(kept))
    if p.min_p > 0:
        probs = probs_of(keep)
        keep &= probs >= p.min_p * probs.max()
    return probs_of(keep)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
        SamplingParams(temperature=0.5, top_k=5, top_p=1.0, min_p=0.0),
        SamplingParams(temperature=1.3, top_k=0, top_p=0.6, min_p=0.0),
        SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.2),
        SamplingParams(temperature=0.8, top_k=30, top_p=0.8, min_p=0.02, repetition_penalty=1.3),
        SamplingParams(temperature=2.0, top_k=1000, top_p=0.999, min_p=0.001, repetition_penalty=0.8),
    ],
)
def test_filters_match_reference_on_random_logits(params):
    rng = np.random.default_rng(1234)
    sampler = Sampler(params)
    for _ in range(20):
        logits = rng.normal(0, 3, size=300)
        prev = rng.integers(0, 300, size=25).tolist()
        got = sampler.probabilities(torch.tensor(logits, dtype=torch.float32), prev).numpy()
        want = reference_distribution(torch.tensor(logits, dtype=torch.float32).double().numpy(), prev, params)
        assert np.array_equal(got > 0, want > 0)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_top_k_keeps_ties_and_top_p_keeps_at_least_one():
    logits = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0])
    probs = Sampler(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)).probabilities(logits)
    assert (probs > 0).tolist() == [False, True, True, False, True]  # all three tied at the 2nd value
    probs = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1e-9, min_p=0.0)).probabilities(logits)
    assert (probs > 0).tolist() == [False, True, False, False, False]  # first of the tied best


# --------------------------------------------------------------------------- greedy, penalty, seeding


def test_greedy_is_argmax_with_lowest_id_on_ties():
    rng = np.random.default_rng(7)
    sampler = Sampler(SamplingParams(temperature=0))
    for _ in range(50):
        logits = torch.tensor(rng.normal(size=1000), dtype=torch.float32)
        assert sampler.sample(logits) == int(np.argmax(logits.numpy()))
    tied = torch.tensor([0.0, 5.0, -1.0, 5.0, 5.0])
    assert sampler.sample(tied) == 1
    assert sampler.sample(torch.tensor([-float("inf"), -3.0, -float("inf")])) == 1


def test_repetition_penalty_semantics():
    logits = torch.tensor([2.0, -2.0, 0.5, 3.0, 0.0])
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=2.0)
    probs = Sampler(params).probabilities(logits, [0, 1, 1, 4])
    # positive logits are divided, negative multiplied, each seen token once, unseen untouched
    expected = torch.softmax(torch.tensor([1.0, -4.0, 0.5, 3.0, 0.0], dtype=torch.float64), 0)
    torch.testing.assert_close(probs, expected)
    greedy = Sampler(SamplingParams(temperature=0, repetition_penalty=1.1))
    assert greedy.sample(torch.tensor([3.0, 2.9])) == 0
    assert greedy.sample(torch.tensor([3.0, 2.9]), [0]) == 1  # 3.0 / 1.1 < 2.9


def test_seeded_sampling_is_reproducible():
    rng = np.random.default_rng(3)
    rows = [torch.tensor(rng.normal(0, 2, size=500), dtype=torch.float32) for _ in range(40)]
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    first = Sampler(params).sample(rows[0])
    run1, run2 = Sampler(params), Sampler(params)
    seq1 = [run1.sample(r) for r in rows]
    seq2 = [run2.sample(r) for r in rows]
    assert seq1 == seq2 and first == seq1[0]
    other = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=99))
    assert [other.sample(r) for r in rows] != seq1
    unseeded = [Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)) for _ in range(2)]
    flat = torch.zeros(100_000)
    assert [unseeded[0].sample(flat) for _ in range(5)] != [unseeded[1].sample(flat) for _ in range(5)]


def test_draw_frequencies_follow_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0))
    counts = np.bincount([sampler.sample(logits) for _ in range(4000)], minlength=4) / 4000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_bad_logits_rejected():
    sampler = Sampler(SamplingParams())
    with pytest.raises(ValueError, match="NaN"):
        sampler.sample(torch.tensor([0.0, float("nan")]))
    with pytest.raises(ValueError, match="-inf"):
        sampler.sample(torch.full((3,), -float("inf")))
    with pytest.raises(ValueError, match="previous token"):
        Sampler(SamplingParams(repetition_penalty=1.2)).sample(torch.zeros(3), [5])


# --------------------------------------------------------------------------- stop checking


def test_stop_string_across_token_boundaries():
    checker = StopChecker(["STOP"], max_tokens=100)
    steps = [checker.step(i, t) for i, t in enumerate(["Hel", "lo ST", "OP now"])]
    assert [s.text for s in steps] == ["Hel", "lo ", ""]
    assert steps[-1].reason is StopReason.STOP_STRING and checker.matched_stop == "STOP"
    with pytest.raises(RuntimeError):
        checker.step(9, "x")


def test_partial_prefix_is_released_when_it_does_not_match():
    checker = StopChecker(["STOP", "\nUser:"], max_tokens=100)
    out = [checker.step(i, t).text for i, t in enumerate(["a S", "T", "ART\n", "Use", "d it"])]
    assert out == ["a ", "", "START", "", "\nUsed it"]
    assert checker.reason is None


def test_eos_max_tokens_and_external_stops():
    checker = StopChecker(["STOP"], max_tokens=10, eos_ids={7})
    assert checker.step(1, "x S").text == "x "
    step = checker.step(7, "<eos text never shown>")
    assert (step.text, step.reason) == ("S", StopReason.EOS)

    checker = StopChecker(["STOP"], max_tokens=2)
    assert checker.step(1, "a").reason is None
    step = checker.step(2, "bST")
    assert (step.text, step.reason) == ("bST", StopReason.MAX_TOKENS)

    for reason in ("cancelled", StopReason.CONTEXT_FULL):
        checker = StopChecker(["STOP"], max_tokens=10)
        checker.step(1, "ok ST")
        step = checker.finish(reason)
        assert step.text == "ST" and step.reason == StopReason(reason) and checker.done


@pytest.fixture(scope="module")
def byte_tokenizer() -> GGUFTokenizer:
    """256 single-byte tokens + an EOS control token: every multi-byte character spans tokens."""
    from engine.text.tokenizer import _BYTE_TO_CHAR

    tokens = [_BYTE_TO_CHAR[b] for b in range(256)] + ["<eos>"]
    return GGUFTokenizer.from_metadata(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "gpt-2",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * 256 + [3],
            "tokenizer.ggml.merges": [],
            "tokenizer.ggml.eos_token_id": 256,
        }
    )


@pytest.mark.parametrize(
    "text,stop,shown",
    [
        ("价格€5😀 then more", ["😀"], "价格€5"),
        ("价格€5😀 then more", ["€5😀 t"], "价格"),
        ("naïve café ☕ end", ["☕"], "naïve café "),
        ("no stop here 北京", ["東京"], "no stop here 北京"),
    ],
)
def test_stop_strings_inside_multibyte_characters(byte_tokenizer, text, stop, shown):
    ids = byte_tokenizer.encode(text)
    assert len(ids) == len(text.encode())  # one token per byte
    checker = StopChecker(stop, max_tokens=1000, eos_ids=byte_tokenizer.eos_ids, decoder=StreamDecoder(byte_tokenizer))
    pieces = []
    for i in ids + [256]:
        step = checker.step(i)
        step.text.encode("utf-8")  # always whole characters
        pieces.append(step.text)
        if step.stopped:
            break
    assert "".join(pieces) == shown
    assert checker.reason == (StopReason.STOP_STRING if shown != text else StopReason.EOS)


def test_max_tokens_mid_character_flushes_replacement(byte_tokenizer):
    ids = byte_tokenizer.encode("ab😀")
    checker = StopChecker.for_params(
        SamplingParams(max_tokens=4), eos_ids=byte_tokenizer.eos_ids, decoder=StreamDecoder(byte_tokenizer)
    )
    texts = [checker.step(i).text for i in ids[:4]]
    assert texts == ["a", "b", "", "\ufffd"] and checker.reason is StopReason.MAX_TOKENS


@pytest.mark.parametrize("windows", ["default", "whole vocabulary", "one wide window"])
@pytest.mark.parametrize("shape", ["peaked", "flat", "few near the top", "masked", "ties at the k-th"])
def test_top_k_over_a_real_vocabulary_equals_the_whole_vocabulary_s(shape, windows, monkeypatch):
    """A real vocabulary (163,840 ids): top-k first looks among the ids near the largest logit
    (`_TOP_K_WINDOWS`); the distribution equals the reference over every id, whether a window
    holds the top-k (peaked, flat), too few ids (one logit far above the rest), -inf logits
    (masked) or ties at the k-th value; and so does each way alone: the whole vocabulary's
    search, or one window wide enough for any of these."""
    if windows == "whole vocabulary":
        monkeypatch.setattr(sampling, "_TOP_K_WINDOWS", ())
        monkeypatch.setattr(sampling, "_NUCLEUS_FIRST", 1 << 30)  # top-p sorts everything too
    elif windows == "one wide window":
        monkeypatch.setattr(sampling, "_TOP_K_WINDOWS", (1e3,))
        monkeypatch.setattr(sampling, "_TOP_K_NEAR_MAX", 1 << 30)
    rng = np.random.default_rng(7)
    vocab = 163_840
    logits = rng.normal(0, 1.5, size=vocab)
    if shape == "peaked":
        logits[rng.choice(vocab, 60, replace=False)] += rng.uniform(8, 14, size=60)
    elif shape == "flat":
        logits = rng.normal(0, 5.0, size=vocab)
    elif shape == "few near the top":
        logits[123] = 60.0  # alone within the window: the whole vocabulary is searched
    elif shape == "masked":
        logits[rng.choice(vocab, vocab // 2, replace=False)] = -np.inf
    else:
        logits[:50] = 9.0
        logits[5000:5010] = 9.5  # the 40th largest is 9.0, tied 50 times
    params = SamplingParams(temperature=0.7, top_k=40, top_p=1.0 if shape == "ties at the k-th" else 0.95, min_p=0.0)
    x = torch.tensor(logits, dtype=torch.float32)
    got = Sampler(params).probabilities(x).numpy()
    want = reference_distribution(x.double().numpy(), [], params)
    assert np.array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    if shape == "ties at the k-th":
        assert (got[:50] > 0).all()  # every tie of the k-th value kept


@pytest.mark.parametrize("shape", ["peaked", "flat"])
def test_top_p_alone_over_a_real_vocabulary_equals_the_reference(shape):
    """top-k off: top-p first sorts the 1,024 most likely ids (`_NUCLEUS_FIRST`), enough when
    they hold top_p (peaked), else the whole vocabulary (flat)."""
    rng = np.random.default_rng(11)
    vocab = 163_840
    logits = rng.normal(0, 1.0 if shape == "peaked" else 0.3, size=vocab)
    if shape == "peaked":
        logits[rng.choice(vocab, 200, replace=False)] += rng.uniform(8, 16, size=200)
    params = SamplingParams(temperature=0.8, top_k=0, top_p=0.9, min_p=0.0)
    x = torch.tensor(logits, dtype=torch.float32)
    got = Sampler(params).probabilities(x).numpy()
    want = reference_distribution(x.double().numpy(), [], params)
    kept = int((want > 0).sum())
    assert (kept < sampling._NUCLEUS_FIRST) == (shape == "peaked")  # each way is taken
    assert np.array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
