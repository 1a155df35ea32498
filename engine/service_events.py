"""The events and requests that flow between a front end and the EngineService.

Everything here is a frozen dataclass of plain values (str, int, float, bool, lists of
dicts), so an event can be handed to another thread, logged or serialised without
copying. The front end builds a ``GenerateRequest`` and hands it to
``EngineService.submit``; the service answers through its ``on_event`` callback with,
for each reply, in order:

1. ``PhaseEvent(phase='loading'|'prefill', ...)`` — prefill reports ``done``/``total``
   prompt tokens after every chunk;
2. ``PhaseEvent(phase='decoding', ...)`` then any number of ``TokenEvent`` (text deltas,
   each a valid UTF-8 ``str``; ``reasoning=True`` for the model's thinking);
3. exactly one of ``DoneEvent`` (with ``ReplyStats``) or ``ErrorEvent``;
4. ``PhaseEvent(phase='idle', ...)``.

A load is answered by ``PhaseEvent(LOAD_REQUEST_ID, 'loading', ...)`` progress, then
``ModelLoadedEvent`` (which carries no request_id) or an ``ErrorEvent`` with
``request_id == LOAD_REQUEST_ID``, then ``PhaseEvent(LOAD_REQUEST_ID, 'idle')``. Every
submitted request gets exactly one DoneEvent or ErrorEvent, even when it was cancelled
while still queued.

NOTE: ``on_event`` is called on the engine's worker thread. A GUI must hop to its own
thread (e.g. a queued Qt signal) before touching widgets.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal

from engine.text.sampling import SamplingParams

Phase = Literal["loading", "prefill", "decoding", "idle"]

#: ``ErrorEvent.kind`` values. io: the Expert Pack could not be read (disk, file
#: changed); out_of_memory: the GPU/host ran out of memory; bad_pack: the pack or GGUF is
#: invalid or unsupported; context_full: the prompt does not fit the context window;
#: bad_request: the model's chat format cannot render this request (tools it has no
#: syntax for, a template that refused the conversation or ran past its limits);
#: internal: a bug — please report it. Cancelling is never an error: a cancelled reply
#: ends with a DoneEvent whose stop_reason is "cancelled".
ERROR_KINDS = ("io", "out_of_memory", "bad_pack", "context_full", "bad_request", "internal")

#: ``ReplyStats.stop_reason`` values (the values of ``engine.text.StopReason``): "eos"
#: (the model ended its turn), "stop_string" (a stop string appeared; it is not shown),
#: "max_tokens" (the reply reached max_tokens), "context_full" (the context window filled
#: up while generating), "cancelled" (cancel() was called).
STOP_REASONS = ("eos", "stop_string", "max_tokens", "context_full", "cancelled")

#: request_id used for events that answer ``EngineService.load`` rather than a request.
LOAD_REQUEST_ID = "load"


def new_request_id() -> str:
    """A fresh, unique request id (a uuid4 hex string)."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class PhaseEvent:
    """The engine moved to (or progressed within) a phase of a request.

    ``done``/``total`` count prompt tokens during prefill, generated tokens during
    decoding (total = max_tokens), and are 0/0 for loading and idle. ``detail`` is a
    short human-readable note (e.g. "reusing 120 cached tokens").
    """

    request_id: str
    phase: Phase
    done: int = 0
    total: int = 0
    detail: str = ""


@dataclass(frozen=True)
class TokenEvent:
    """New text of the reply: a delta to append, always complete UTF-8 characters.

    ``reasoning`` is True for text inside the model's thinking block (to be shown apart
    from the answer), False for the answer itself.
    """

    request_id: str
    text: str
    reasoning: bool = False


@dataclass(frozen=True)
class ReplyStats:
    """Numbers describing one finished reply (rates are per second of wall time).

    ttft_s: submit-to-first-generated-token; prefill_tok_s: prompt tokens run per
    second (only the tokens actually run, not a reused prefix); decode_tok_s:
    generated tokens per second after the first; hit_rate: expert-cache hits /
    (hits + misses) over the whole reply, counted per unique (layer, expert) key of
    each acquire (1.0 when nothing was looked up, e.g. all experts in memory);
    ssd_gb_per_token: decimal GB read from the Expert Pack during the whole reply
    (prefill and decode) per generated token. These are the definitions of the
    reference benchmark (`expertdesk bench --suite seed10`, `engine.bench_suites`).
    stop_reason: one of STOP_REASONS; cache_hits/cache_misses/pack_read_bytes: the raw
    counters behind those rates; elapsed_s: submit-to-done wall time.
    """

    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float
    hit_rate: float
    ssd_gb_per_token: float
    stop_reason: str
    cache_hits: int = 0
    cache_misses: int = 0
    pack_read_bytes: int = 0
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class DoneEvent:
    """A reply finished (normally, by a stop condition, or by cancel()).

    ``text`` is the whole answer and ``reasoning`` the whole thinking text, i.e. the
    concatenation of the TokenEvents with reasoning False / True respectively.
    """

    request_id: str
    stats: ReplyStats
    text: str = ""
    reasoning: str = ""


@dataclass(frozen=True)
class ErrorEvent:
    """A request (or a load) failed; the service stays usable for the next one.

    ``kind`` is one of ERROR_KINDS; ``message`` says what happened, why, and what to do.
    """

    request_id: str
    kind: str
    message: str


@dataclass(frozen=True)
class ModelLoadedEvent:
    """A model finished loading and the service accepts requests.

    ``is_demo`` is True for the built-in tiny demo model (not a real model: its output is
    only meant to exercise the app). ``device`` is the torch device string ("cpu",
    "cuda:0"). ``precision``: the activation dtypes, "float32", "bf16", or "bf16 prompts,
    float32 replies" (`RuntimeOptions.decode_dtype`); "" where unknown (a remote endpoint).
    ``chat_format``: the built-in chat format matching the vocabulary
    (``engine.text.BUILTIN_FORMATS``; None when none does), which fixes the reply's
    markup, e.g. the tool-call syntax.
    """

    model_name: str
    architecture: str
    is_demo: bool
    context_length: int
    device: str
    chat_format: str | None = None
    precision: str = ""

    @property
    def runs_on(self) -> str:
        """Where and how it computes, for one line of status: "cuda:0, bf16"."""
        return f"{self.device}, {self.precision}" if self.precision else self.device


Event = PhaseEvent | TokenEvent | DoneEvent | ErrorEvent | ModelLoadedEvent


@dataclass(frozen=True)
class GenerateRequest:
    """One chat turn to generate.

    ``messages`` are chat messages ``{"role": "system"|"user"|"assistant", "content":
    str}`` — the whole conversation so far, ending with the user's turn (the service
    reuses cached model state when the conversation extends the previous one).
    ``thinking``: True/False to switch the model's reasoning on/off, None for the
    model's default. ``request_id`` defaults to a fresh uuid. ``tools``: OpenAI-style
    tool declarations for the chat format to render (``engine.text.tool_calls``).
    ``prompt``: raw text to continue instead of a chat (a text completion: no chat
    template, no reasoning split; ``messages`` is then ignored and may be empty).
    """

    messages: list[dict]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    thinking: bool | None = None
    request_id: str = field(default_factory=new_request_id)
    tools: list[dict] | None = None
    prompt: str | None = None


#: ``ExpertMap.places`` values: where one expert sits.
PLACE_SSD, PLACE_RAM, PLACE_DEVICE = 0, 1, 2


@dataclass(frozen=True)
class ExpertMap:
    """Where every routed expert of the loaded pack sits, and how much each was used lately.

    The data of the GUI's heat map (``EngineService.expert_map``): one row per MoE layer
    (model block ``blocks[i]``), one column per expert. ``places`` holds one byte per
    expert, row after row: ``PLACE_DEVICE`` (the device tier: VRAM on a GPU),
    ``PLACE_RAM`` (the host-RAM tier) or ``PLACE_SSD`` (only in the pack). ``uses``, in
    the same order, is the cache's own recent-use measure, the decayed access count it
    ranks experts by (each use adds 1; counts halve every ``halflife`` accesses; all 0
    under the "lru" policy, which keeps no counts). ``device`` is the device tier's
    torch device ("cuda:0", "cpu").
    """

    blocks: tuple[int, ...]
    num_experts: int
    places: bytes
    uses: tuple[float, ...]
    device: str
