"""Token sampling (greedy / temperature, top-k, top-p, min-p, repetition penalty) and stop rules.

The filters follow Hugging Face ``transformers``' logits processors (the same
semantics llama.cpp uses): repetition penalty over previously seen tokens, then
temperature, top-k (ties at the k-th value are kept), top-p (smallest set of most
likely tokens whose mass reaches ``top_p``), min-p (drop tokens below ``min_p`` times
the top probability), then one draw from a ``torch.Generator``. Everything is done in
float64 on the CPU: it costs little for one row of logits and makes the result
independent of the device the model ran on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from .tokenizer import StreamDecoder

__all__ = ["SamplingParams", "Sampler", "StopChecker", "StopReason", "StopStep"]

# How far below the most likely token (in tempered logits, nats) top-k looks, in turn, for more
# than k ids (e**-8 is one chance in 3,000), before it searches the whole vocabulary; and the
# most ids a window may hold (beyond, the search of the whole costs less).
_TOP_K_WINDOWS = (8.0, 16.0, 32.0)
_TOP_K_NEAR_MAX = 16384
# The most likely ids top-p sorts first, before it sorts the whole vocabulary.
_NUCLEUS_FIRST = 1024


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token and when to stop.

    ``temperature == 0`` means greedy (argmax). ``top_k == 0``, ``top_p == 1`` and
    ``min_p == 0`` switch those filters off; ``repetition_penalty == 1`` is no penalty.
    ``seed`` makes sampling reproducible (None: a fresh random seed). ``stop`` is a list
    of strings that end generation when they appear in the output (kept as a tuple).
    """

    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    max_tokens: int = 1024
    seed: int | None = None
    stop: Sequence[str] = ()

    def __post_init__(self) -> None:
        problems = []
        if not _is_real(self.temperature) or self.temperature < 0:
            problems.append(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            problems.append(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            problems.append(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            problems.append(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            problems.append(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        stop = self.stop
        if isinstance(stop, str):
            problems.append("stop must be a list of strings, not a single string")
        else:
            try:
                stop = tuple(stop)
            except TypeError:
                problems.append(f"stop must be a list of strings, got {type(self.stop).__name__}")
            else:
                if not all(isinstance(s, str) and s for s in stop):
                    problems.append(f"stop strings must be non-empty strings, got {list(stop)!r}")
                object.__setattr__(self, "stop", stop)
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        """True when the most likely token is always taken."""
        return self.temperature == 0


class Sampler:
    """Picks one token id from a row of logits according to :class:`SamplingParams`.

    One sampler serves one generation: its random generator advances with every draw,
    so the same seed, prompt and logits give the same tokens again.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._generator = torch.Generator(device="cpu")
        if params.seed is None:
            self._generator.seed()  # non-deterministic seed from the OS
        else:
            self._generator.manual_seed(params.seed)

    def _prepare(self, logits: Any, previous_tokens: Iterable[int]) -> torch.Tensor:
        x = torch.as_tensor(logits).detach().to(device="cpu", dtype=torch.float64, copy=True).reshape(-1)
        if x.numel() == 0:
            raise ValueError("cannot sample from empty logits")
        if torch.isnan(x.max()):  # max propagates NaN: one pass, no mask
            raise ValueError("the logits contain NaN; the forward pass produced invalid numbers")
        penalty = self.params.repetition_penalty
        if penalty != 1.0:
            seen = sorted(set(int(t) for t in previous_tokens))
            if seen:
                if seen[0] < 0 or seen[-1] >= x.numel():
                    raise ValueError(f"previous token ids must lie in [0, {x.numel()}), got {seen[0]}..{seen[-1]}")
                idx = torch.tensor(seen, dtype=torch.long)
                vals = x[idx]
                # HF / llama.cpp: shrink a positive logit, push a negative one further down.
                x[idx] = torch.where(vals > 0, vals / penalty, vals * penalty)
        return x

    def _candidates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids that survive temperature/top-k/top-p/min-p, with their tempered logits."""
        p = self.params
        top = x.max()
        if top == -math.inf:
            raise ValueError("every logit is -inf; there is no token to sample")
        ids = vals = None
        if p.top_k > 0:
            # Top-k among the vocabulary's likely ids first: the logits at least `edge`, within
            # a window of tempered nats below the largest (the only passes over the whole
            # vocabulary are comparisons). When more than k lie there and every logit
            # under `edge` tempers to less than the k-th (x < edge gives x / T <= edge / T,
            # rounding being monotonic), the set is the whole vocabulary's top-k, its ties
            # included; else a wider window, then the whole vocabulary (bench_sampling.py).
            for window in _TOP_K_WINDOWS:
                edge = float(top) - window * p.temperature
                inside = x >= edge
                count = int(torch.count_nonzero(inside))
                if count <= p.top_k:
                    continue
                if count > _TOP_K_NEAR_MAX:  # most of the vocabulary: the whole search costs less
                    break
                near = torch.nonzero(inside).flatten()
                tempered = x[near] / p.temperature
                kth = torch.topk(tempered, p.top_k).values[-1]
                if edge / p.temperature < kth:
                    keep = tempered >= kth  # ties with the k-th value stay, as in transformers
                    ids, vals = near[keep], tempered[keep]
                break
        if ids is None or vals is None:
            full = x / p.temperature
            cut = torch.topk(full, p.top_k).values[-1] if 0 < p.top_k < full.numel() else None
            if cut is not None and cut > -math.inf:  # k finite logits or more: `keep` drops every -inf
                ids = torch.nonzero(full >= cut).flatten()
            else:
                ids = torch.nonzero(full > -math.inf).flatten()
            vals = full[ids]
        if p.top_p < 1.0:
            probs = torch.softmax(vals, dim=0)
            order = _most_likely_first(probs, p.top_p)
            sorted_probs = probs[order]
            # mass of the strictly more likely tokens (exclusive running sum, no subtraction
            # so the boundary does not move with rounding)
            before = torch.cat([sorted_probs.new_zeros(1), torch.cumsum(sorted_probs, dim=0)[:-1]])
            keep_sorted = before < p.top_p
            keep_sorted[0] = True  # never empty
            kept = order[keep_sorted]
            kept = kept.sort().values  # back to id order
            ids, vals = ids[kept], vals[kept]
        if p.min_p > 0.0:
            probs = torch.softmax(vals, dim=0)
            keep = probs >= p.min_p * probs.max()
            ids, vals = ids[keep], vals[keep]
        return ids, vals

    def probabilities(self, logits: Any, previous_tokens: Iterable[int] = ()) -> torch.Tensor:
        """The distribution :meth:`sample` draws from, over the whole vocabulary (float64).

        For greedy parameters it is one-hot on the argmax.
        """
        x = self._prepare(logits, previous_tokens)
        out = torch.zeros_like(x)
        if self.params.greedy:
            out[int(torch.argmax(x))] = 1.0
            return out
        ids, vals = self._candidates(x)
        out[ids] = torch.softmax(vals, dim=0)
        return out

    def sample(self, logits: Any, previous_tokens: Iterable[int] = ()) -> int:
        """Next token id for one row of ``logits`` (shape ``[vocab]``).

        ``previous_tokens`` are the ids the repetition penalty looks at (prompt and/or
        generated text, as the caller chooses). Greedy ties go to the lowest id.
        """
        x = self._prepare(logits, previous_tokens)
        if self.params.greedy:
            return int(torch.argmax(x))  # first maximum = lowest id
        ids, vals = self._candidates(x)
        if ids.numel() == 1:
            return int(ids[0])
        probs = torch.softmax(vals, dim=0)
        choice = torch.multinomial(probs, 1, generator=self._generator)
        return int(ids[choice])


def _most_likely_first(probs: torch.Tensor, mass: float) -> torch.Tensor:
    """Indices of `probs` by descending probability, ties by index (a stable sort), at least as
    far as a running sum reaching `mass`: a prefix of the whole order, which is all top-p
    reads (every token past it has as much mass before it). The 1,024 most likely ids and
    their ties are such a prefix when they hold `mass`; else the whole vocabulary is sorted
    (15-20 ms a token for 129,280-163,840 ids on two cores, bench_sampling.py)."""
    if probs.numel() > _NUCLEUS_FIRST:
        cut = torch.topk(probs, _NUCLEUS_FIRST).values[-1]
        near = torch.nonzero(probs >= cut).flatten()  # every id as likely as the 1,024th: a prefix
        order = near[torch.sort(probs[near], descending=True, stable=True).indices]
        if torch.cumsum(probs[order], dim=0)[-1] >= mass:
            return order
    return torch.sort(probs, descending=True, stable=True).indices


class StopReason(str, Enum):
    """Why generation ended."""

    EOS = "eos"
    STOP_STRING = "stop_string"
    MAX_TOKENS = "max_tokens"
    CANCELLED = "cancelled"
    CONTEXT_FULL = "context_full"


@dataclass(frozen=True)
class StopStep:
    """Result of one :meth:`StopChecker.step`: text safe to show now, and the stop reason if any."""

    text: str
    reason: StopReason | None = None

    @property
    def stopped(self) -> bool:
        return self.reason is not None


class StopChecker:
    """Decides when generation ends and which text may be shown so far.

    Feed every generated token to :meth:`step`. Text is decoded with a
    :class:`StreamDecoder` (or passed in already decoded), so it never contains half a
    UTF-8 character. Text that could be the beginning of a stop string is held back
    until it is clear; a matched stop string and everything after it are never shown.
    End-of-generation tokens stop without showing their text.
    """

    def __init__(
        self,
        stop: Sequence[str] = (),
        *,
        max_tokens: int,
        eos_ids: Iterable[int] = (),
        decoder: StreamDecoder | None = None,
    ) -> None:
        if isinstance(stop, str):
            raise TypeError("stop must be a list of strings, not a single string")
        self._stops = tuple(s for s in stop if s)
        if not _is_int(max_tokens) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        self._max_tokens = max_tokens
        self._eos = frozenset(int(i) for i in eos_ids)
        self._decoder = decoder
        self._held = ""
        self.generated = 0
        self.reason: StopReason | None = None
        self.matched_stop: str | None = None

    @classmethod
    def for_params(cls, params: SamplingParams, *, eos_ids: Iterable[int] = (),
                   decoder: StreamDecoder | None = None) -> StopChecker:
        """Checker for ``params.stop`` and ``params.max_tokens``."""
        return cls(params.stop, max_tokens=params.max_tokens, eos_ids=eos_ids, decoder=decoder)

    @property
    def done(self) -> bool:
        return self.reason is not None

    def _flush_decoder(self) -> str:
        return self._decoder.flush() if self._decoder is not None else ""

    def step(self, token_id: int, text: str | None = None) -> StopStep:
        """Account for one generated token; ``text`` is its decoded delta if no decoder was given."""
        if self.reason is not None:  # done
            raise RuntimeError(f"generation already stopped ({self.reason.value}); start a new StopChecker")
        self.generated += 1
        if int(token_id) in self._eos:
            out = self._held + self._flush_decoder()
            self._held = ""
            self.reason = StopReason.EOS
            return StopStep(out, self.reason)
        if text is None:
            if self._decoder is None:
                raise ValueError("StopChecker.step needs the token's text when no decoder was given")
            text = self._decoder.feed(token_id)
        buf = self._held + text
        hit = min(((buf.find(s), s) for s in self._stops if s in buf), default=None)
        if hit is not None:
            at, s = hit
            self._held = ""
            self.reason = StopReason.STOP_STRING
            self.matched_stop = s
            return StopStep(buf[:at], self.reason)
        keep = _partial_stop_suffix(buf, self._stops)
        out, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        if self.generated >= self._max_tokens:
            out += self._held + self._flush_decoder()
            self._held = ""
            self.reason = StopReason.MAX_TOKENS
        return StopStep(out, self.reason)

    def finish(self, reason: StopReason | str) -> StopStep:
        """Stop from outside (``cancelled``, ``context_full``); returns the held-back text."""
        reason = StopReason(reason)
        if self.done:
            return StopStep("", self.reason)
        out = self._held + self._flush_decoder()
        self._held = ""
        self.reason = reason
        return StopStep(out, reason)


def _partial_stop_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that a stop string starts with."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
