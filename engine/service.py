"""EngineService: one chat engine on one worker thread, driven by requests, answering with events.

    service = EngineService(on_event, RuntimeOptions(device="auto"))
    service.load("demo")                      # a pack folder, a GGUF file, or the word demo
    service.set_options(RuntimeOptions(cache_mib=4096))  # the same model again, with a new budget
    rid = service.submit(GenerateRequest(messages=[{"role": "user", "content": "Hi"}]))
    service.cancel(rid)                       # stops within one decode step
    service.snapshot()                        # any thread, never waits for the worker
    service.shutdown()

The model, its tokenizer and the expert runtime live on ONE worker thread (a plain
`threading.Thread` fed by a queue); requests run one at a time in submission order.
Everything the front end learns arrives through `on_event` (see
`engine.service_events` for the events and their order).

THREADING: `on_event` is called on the worker thread. It must return quickly and must
not touch GUI objects: a Qt front end emits a signal (queued connection) and handles
the event on its own thread. `snapshot()` is the polling alternative for counters.

Conversation state: the model's incremental state is kept after a reply. When the
next request's prompt tokens start with exactly the tokens already in the state (the
usual next turn of a chat), only the new tokens are prefilled; otherwise the state is
reset. A failed request always resets it (a forward pass cut short leaves it
inconsistent); a cancelled one keeps what was completed.

Errors never kill the worker: I/O errors reading the pack, out-of-memory, a bad
pack or model file, a prompt larger than the context and bugs arrive as ErrorEvent
(kinds in `service_events.ERROR_KINDS`) and the next request runs normally.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.memory_plan import MemoryPlanError, fit_context, prompt_chunk
from engine.models.protocol import LayerHook
from engine.options import RuntimeOptions
from engine.service_base import Job, QueuedService
from engine.service_events import (
    LOAD_REQUEST_ID,
    DoneEvent,
    ErrorEvent,
    Event,
    ExpertMap,
    GenerateRequest,
    ModelLoadedEvent,
    ReplyStats,
    TokenEvent,
)
from engine.text import (
    ChatTemplateError,
    GGUFTokenizer,
    ReasoningDelta,
    ReasoningSplitter,
    Sampler,
    StopChecker,
    StopReason,
    StreamDecoder,
    TemplateRenderCancelled,
    TokenizerError,
    builtin_format_for_vocab,
    render_prompt,
    reply_splitter,
    skips_special_tokens,
)

log = logging.getLogger(__name__)

# What the memory plan reserves for a reply's KV state beyond the prompt: not max_tokens,
# which clients set to the whole context as a matter of course (a plan for that would fail
# a short chat on a small card, or shrink the expert cache for good). Growth past it comes
# out of the plan's margin (>= 1 GiB; the largest model adds under 30 KB of KV per token).
REPLY_RESERVE_TOKENS = 1024
DEFAULT_CONTEXT = 4096  # when the model file does not say
GB = 1e9
# Within a prompt chunk (which can take seconds to minutes through a pack: it reads each
# layer's experts), the prefill's progress is reported between layers at most this often.
PREFILL_PROGRESS_S = 0.25


class ContextFullError(ValueError):
    """The prompt does not fit the model's context window."""


class NoModelError(RuntimeError):
    """A request arrived before any model was loaded successfully."""


class _PrefillCancelled(Exception):
    """The request was cancelled between two layers of a prompt chunk."""


@dataclass
class _Loaded:
    """Everything that belongs to one loaded model."""

    ref: str
    name: str
    architecture: str
    is_demo: bool
    model: Any
    tokenizer: GGUFTokenizer
    chat_template: str | None
    chat_format: str | None  # built-in format matching the vocabulary (fallback + reasoning tags)
    context_length: int
    device: str
    telemetry: Any  # engine.runtime.Telemetry of a pack's expert cache, None for resident experts
    precision: str = ""  # ModelLoadedEvent.precision

    def close(self) -> None:
        experts = getattr(self.model, "experts", None)
        store = getattr(experts, "store", None)
        for closer in (getattr(experts, "close", None), getattr(store, "close", None)):
            if closer is not None:
                try:
                    closer()
                except Exception:  # closing must never fail the next load
                    log.exception("closing the previous model's expert runtime failed")


@dataclass
class _Conversation:
    """The model state and the exact tokens it has consumed, plus the logits after the last one."""

    state: Any
    tokens: list[int]
    logits: torch.Tensor | None


_COUNTERS = ("cache_hits", "cache_misses", "pack_read_bytes")


class EngineService(QueuedService):
    """The chat engine behind the GUI and the CLI (see module docstring).

    on_event: called ON THE WORKER THREAD with every event. options: how models run
    (`engine.options.RuntimeOptions`: device, activation dtype, expert-cache budgets,
    direct I/O, guess reads), handed to the loader unchanged; the demo gets a
    deliberately small cache (`engine.demo.DEMO_CACHE_MIB`) unless `cache_mib` is set,
    so its experts really stream, and falls back to buffered reads where its filesystem
    has no O_DIRECT (and says so) unless `direct_io` is set. prefill_chunk: prompt tokens
    per forward pass (one progress event each); by default the model's memory plan chooses
    (`engine.memory_plan.prompt_chunk`: 512 to 2048). context_limit: cap the context
    below the model's (saves memory; tests). An unknown or absent device or dtype raises
    ValueError here, before any thread starts. The request API and its bookkeeping are
    `engine.service_base.QueuedService`'s.
    """

    _what = "engine service"

    def __init__(
        self,
        on_event: Callable[[Event], None],
        options: RuntimeOptions = RuntimeOptions(),
        *,
        prefill_chunk: int | None = None,
        context_limit: int | None = None,
    ) -> None:
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1 token, got {prefill_chunk}")
        checked, self._device, self._dtype = _checked(options)
        super().__init__(on_event, checked)
        self._prefill_chunk = prefill_chunk
        self._context_limit = context_limit

        self._queue: queue.Queue[Job] = queue.Queue()
        self._loaded: _Loaded | None = None
        self._conversation: _Conversation | None = None
        self._thread = threading.Thread(target=self._run, name="expertdesk-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API

    def load(self, model_ref: str | Path, options: RuntimeOptions | None = None) -> None:
        """Queue loading `model_ref`: an Expert Pack folder, a GGUF file, or the word "demo".

        Answered by ModelLoadedEvent, or ErrorEvent(request_id=LOAD_REQUEST_ID). Requests
        submitted afterwards run on the new model; the previous model is released first.
        `options`, when given, replace the service's from this load on (checked here:
        ValueError for an unknown device or dtype).
        """
        checked = _checked(options) if options is not None else None
        self._put(Job("load", (str(model_ref), checked)))

    def set_options(self, options: RuntimeOptions) -> None:
        """Use `options` from now on; if a model is loaded, reload it with them.

        Runs on the worker thread like a load (after the jobs queued before it) and is
        answered like one, when a model was loaded: PhaseEvent("loading") progress,
        ModelLoadedEvent or ErrorEvent(LOAD_REQUEST_ID), PhaseEvent(LOAD_REQUEST_ID, "idle").
        With no model loaded it only stores them (no events). ValueError at once for an
        unknown device or dtype.
        """
        self._put(Job("options", _checked(options)))

    def snapshot(self) -> dict[str, Any]:
        """Current state, as a plain dict; safe from any thread and never waits for the worker.

        Keys: phase ("loading" | "prefill" | "decoding" | "idle"), request_id, done/total
        (phase progress), detail, phase_elapsed_s, prompt_tokens, completion_tokens
        (tokens of the current reply so far), queued (requests waiting), model (name,
        architecture, is_demo, context_length, device; None before a load), context_used
        (tokens in the conversation state) and runtime (the expert runtime's counters:
        cache_hits, cache_misses, hit_rate, pack_read_bytes, h2d_bytes, io_errors,
        slot_count, slots_used, ...; {} when the model holds all experts in memory).
        """
        now = time.time()
        data = self._status_snapshot(now)
        loaded = self._loaded
        data["model"] = None if loaded is None else {
            "name": loaded.name, "architecture": loaded.architecture, "is_demo": loaded.is_demo,
            "context_length": loaded.context_length, "device": loaded.device, "ref": loaded.ref,
        }
        conversation = self._conversation
        data["context_used"] = len(conversation.tokens) if conversation is not None else 0
        data["runtime"] = loaded.telemetry.snapshot() if loaded is not None and loaded.telemetry is not None else {}
        data["time"] = now
        return data

    def expert_map(self) -> ExpertMap | None:
        """Where the loaded pack's experts sit and how much each was used lately (the heat map);
        None without a pack (resident experts) or while the engine holds the cache's lock."""
        loaded = self._loaded
        if loaded is None or loaded.telemetry is None:
            return None
        return loaded.model.experts.expert_map()

    @property
    def device(self) -> str:
        """The torch device models are loaded onto ("cpu", "cuda:0")."""
        return str(self._device)

    # ------------------------------------------------------------------ plumbing

    def _enqueue(self, job: Job) -> None:
        self._queue.put(job)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job.kind == "stop":
                    break
                if job.kind == "load":
                    ref, checked = job.payload
                    if checked is not None:
                        self._options, self._device, self._dtype = checked
                    self._do_load(ref)
                elif job.kind == "options":
                    self._options, self._device, self._dtype = job.payload
                    if self._loaded is not None:
                        self._do_load(self._loaded.ref)
                else:
                    self._do_generate(job)
            except BaseException:  # the worker must survive anything; report it as internal
                log.exception("engine worker failed on a %s job", job.kind)
            finally:
                if job.kind != "stop":
                    self._job_finished()
        self._release_model()
        self._worker_stopped()

    def _release_model(self) -> None:
        loaded, self._loaded, self._conversation = self._loaded, None, None
        if loaded is not None:
            loaded.close()

    # ------------------------------------------------------------------ loading

    def _do_load(self, ref: str) -> None:
        from engine.demo import DEMO_MODEL_NAME, DemoModelError, ensure_demo_pack, is_demo_ref
        from engine.loader import UnsupportedModelError
        from engine.models.protocol import ModelConfigError
        from engine.runtime.errors import ExpertReadError, RuntimeStartError
        from expertpack import PackError
        from packer.gguf_source import GGUFFormatError

        rid = LOAD_REQUEST_ID
        self._release_model()
        is_demo = is_demo_ref(ref)
        self._set_phase(rid, "loading", detail=f"loading {'the demo model' if is_demo else ref}")
        try:
            if is_demo:
                path = ensure_demo_pack(progress=lambda d, t, what: self._set_phase(rid, "loading", d, t, what))
            else:
                path = Path(ref).expanduser()
                if not path.exists():
                    raise FileNotFoundError(
                        f"{path} does not exist: give an Expert Pack folder, a .gguf file or the word demo")
            loaded = self._open_model(path, ref, is_demo)
            if is_demo:
                loaded.name = DEMO_MODEL_NAME
        except (PackError, RuntimeStartError, UnsupportedModelError, ModelConfigError, TokenizerError,
                GGUFFormatError, DemoModelError, FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            self._fail(rid, "bad_pack", f"cannot load {ref}: {exc}")
        except (ExpertReadError, OSError) as exc:
            self._fail(rid, "io", f"cannot read {ref}: {exc}. Check that the drive is connected and healthy")
        except (torch.OutOfMemoryError, MemoryError) as exc:
            self._free_memory()
            self._fail(rid, "out_of_memory", f"not enough memory to load {ref} on {self._device}: {exc}. "
                       "Lower --cache-mib / --host-cache-mib, close other programs, or use a smaller model")
        except Exception as exc:
            log.exception("loading %s failed", ref)
            self._fail(rid, "internal", f"loading {ref} failed unexpectedly ({type(exc).__name__}: {exc}); "
                       "this is a bug, please report it with the log")
        else:
            self._loaded = loaded
            self._emit(ModelLoadedEvent(loaded.name, loaded.architecture, loaded.is_demo, loaded.context_length,
                                        loaded.device, loaded.chat_format, loaded.precision))
        finally:
            self._to_idle(rid)

    def _open_model(self, path: Path, ref: str, is_demo: bool) -> _Loaded:
        from engine.demo import DEMO_CACHE_MIB
        from engine.loader import open_model
        from engine.runtime import ExpertCache

        # The loader gets the device and dtype this service resolved (and reports).
        options = self._options.with_(device=str(self._device), dtype=self._dtype)
        if is_demo and options.cache_mib is None:
            options = options.with_(cache_mib=DEMO_CACHE_MIB)

        def buffered() -> None:
            # The demo lives in the user cache dir, which may be on tmpfs: read it
            # through the page cache, and say so (never silently).
            self._set_phase(LOAD_REQUEST_ID, "loading", detail="demo: this filesystem has no O_DIRECT, "
                            "reading the pack through the page cache")

        model, source = open_model(path, options, buffered_fallback=buffered if is_demo else None)
        tokenizer = GGUFTokenizer.from_metadata(source.metadata)
        telemetry = model.experts.telemetry if isinstance(model.experts, ExpertCache) else None  # packs only
        metadata = source.metadata
        arch = str(metadata.get("general.architecture", "unknown"))
        context = int(metadata.get(f"{arch}.context_length", DEFAULT_CONTEXT) or DEFAULT_CONTEXT)
        if self._context_limit is not None:
            context = min(context, int(self._context_limit))
        name = metadata.get("general.name") or Path(ref).name
        return _Loaded(
            ref=ref, name=str(name), architecture=arch, is_demo=is_demo, model=model, tokenizer=tokenizer,
            chat_template=tokenizer.chat_template, chat_format=builtin_format_for_vocab(tokenizer),
            context_length=context, device=str(self._device), telemetry=telemetry,
            precision=precision_label(model.dtype, model.decode_dtype),
        )

    # ------------------------------------------------------------------ generation

    def _fail(self, request_id: str, kind: str, message: str) -> None:
        self._emit(ErrorEvent(request_id, kind, message))

    def _free_memory(self) -> None:
        self._conversation = None
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def _counters(self) -> dict[str, float]:
        telemetry = self._loaded.telemetry if self._loaded is not None else None
        if telemetry is None:
            return dict.fromkeys(_COUNTERS, 0)
        return {name: telemetry.get(name) for name in _COUNTERS}

    def _do_generate(self, job: Job) -> None:
        from engine.runtime.errors import ExpertReadError, RuntimeStartError
        from expertpack import PackError

        request: GenerateRequest = job.payload
        rid = request.request_id
        self._start_request(rid)
        try:
            if self._is_cancelled(rid):
                self._emit(DoneEvent(rid, _empty_stats(StopReason.CANCELLED.value, job.submitted)))
                return
            self._generate(request, job.submitted)
        except ContextFullError as exc:
            self._fail(rid, "context_full", str(exc))
        except TemplateRenderCancelled:  # cancelled while the chat template rendered: nothing ran yet
            self._emit(DoneEvent(rid, _empty_stats(StopReason.CANCELLED.value, job.submitted)))
        except NoModelError as exc:
            self._fail(rid, "bad_pack", str(exc))
        except ExpertReadError as exc:
            self._conversation = None
            self._fail(rid, "io", f"reading experts from the pack failed: {exc}. The reply was stopped; check the "
                       "drive (is it connected? `expertdesk verify PACK` checks the pack) and send again")
        except (torch.OutOfMemoryError, MemoryError) as exc:
            self._free_memory()
            self._fail(rid, "out_of_memory", f"ran out of memory on {self._device} while generating: {exc}. "
                       "Start a new conversation (shorter context), or lower the expert cache size")
        except ChatTemplateError as exc:  # this request, not the model: another one may well work
            self._conversation = None
            self._fail(rid, "bad_request", f"the model's chat format cannot render this request: {exc}")
        except (PackError, RuntimeStartError, TokenizerError) as exc:
            self._conversation = None
            self._fail(rid, "bad_pack", f"the model cannot serve this request: {exc}")
        except OSError as exc:
            self._conversation = None
            self._fail(rid, "io", f"I/O error while generating: {exc}. Check the drive holding the model")
        except Exception as exc:
            self._conversation = None
            log.error("request %s failed:\n%s", rid, traceback.format_exc())
            self._fail(rid, "internal", f"generation failed unexpectedly ({type(exc).__name__}: {exc}); this is "
                       "a bug, please report it with the log. The engine is still usable")
        finally:
            self._end_request(rid)

    def _prompt_ids(self, loaded: _Loaded, request: GenerateRequest) -> tuple[list[int], ReasoningSplitter, bool]:
        """Token ids of the rendered prompt, the reasoning splitter for the reply, skip_special."""
        tok = loaded.tokenizer
        if request.prompt is not None:  # a text completion: the text as it is (typed control tokens stay text)
            ids = tok.encode(request.prompt, add_special=True, parse_special=False)
            return ids, _PlainText(), True
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else None
        eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else None
        fmt = loaded.chat_format
        # The model's template runs under limits (a hostile one ends in ChatTemplateError) and
        # stops when the request is cancelled. Message text is data: a control token typed
        # into it stays text (prompt.literal_at), the template's own markup is special.
        prompt = render_prompt(loaded.chat_template, request.messages, add_generation_prompt=True, bos_token=bos,
                               eos_token=eos, enable_thinking=request.thinking, fallback=fmt,
                               template_source=f"tokenizer.chat_template of {loaded.name}",
                               should_stop=lambda: self._is_cancelled(request.request_id),
                               control_tokens=tok.special_token_texts, tools=request.tools)
        add_bos = not (bos is not None and prompt.text.startswith(bos) and 0 not in prompt.literal_at)
        ids = tok.encode(prompt.text, add_special=add_bos, parse_special=True, literal_at=prompt.literal_at)
        splitter = reply_splitter(fmt, prompt.text, own_template=loaded.chat_template is not None,
                                  thinking=request.thinking)
        # With tools the reply may hold tool-call markup made of control tokens: keep them in
        # the text for the front end's tool-call parser (engine.text.tool_calls).
        return ids, splitter, skips_special_tokens(fmt) and not request.tools

    def _generate(self, request: GenerateRequest, submitted: float) -> None:
        loaded = self._loaded
        if loaded is None:
            raise NoModelError("no model is loaded: load an Expert Pack, a GGUF file or the demo first "
                               "(the last load failed, or none was requested)")
        rid = request.request_id
        model, tok = loaded.model, loaded.tokenizer
        params = request.sampling
        ctx = loaded.context_length
        counters_start = self._counters()

        ids, splitter, skip_special = self._prompt_ids(loaded, request)
        if len(ids) >= ctx:
            raise ContextFullError(
                f"the conversation is {len(ids)} tokens but {loaded.name} holds {ctx} tokens of context, "
                "leaving no room for a reply; start a new conversation or remove earlier messages")
        # The memory plan: the expert cache yields what this reply's KV state will need.
        try:
            fit_context(model, min(ctx, len(ids) + min(params.max_tokens, REPLY_RESERVE_TOKENS)))
        except MemoryPlanError as exc:  # the conversation, not the pack: a context_full error
            raise ContextFullError(str(exc)) from None

        # Prefix reuse: continue the kept state when it consumed exactly the start of this prompt.
        conv = self._conversation
        self._conversation = None  # until this request leaves a consistent state behind
        reused = 0
        if conv is not None and len(conv.tokens) <= len(ids) and ids[: len(conv.tokens)] == conv.tokens \
                and (len(conv.tokens) < len(ids) or conv.logits is not None):
            reused = len(conv.tokens)
        else:
            conv = _Conversation(model.new_state(), [], None)
        feed = ids[reused:]
        self._update_status(prompt_tokens=len(ids), completion_tokens=0)
        detail = f"reusing {reused} cached tokens" if reused else ""
        self._set_phase(rid, "prefill", 0, len(feed), detail)

        t_prefill = time.perf_counter()
        logits = conv.logits
        cancelled = abandoned = False  # abandoned: stopped between a chunk's layers, the state half-advanced
        chunk_size = self._prefill_chunk or prompt_chunk(model)
        for start in range(0, len(feed), chunk_size):
            if self._is_cancelled(rid):
                cancelled = True
                break
            chunk = feed[start : start + chunk_size]
            try:
                out = model.forward(torch.tensor(chunk, dtype=torch.long), conv.state, only_last=True,
                                    on_layer=self._between_layers(rid, start, len(chunk), len(feed), detail))
            except _PrefillCancelled:
                cancelled = abandoned = True
                break
            logits = out[-1].detach().to("cpu", torch.float32)
            conv.tokens.extend(chunk)
            conv.logits = logits
            self._set_phase(rid, "prefill", start + len(chunk), len(feed), detail)
        t_prefill_end = time.perf_counter()
        prefilled = len(conv.tokens) - reused

        decoder = StreamDecoder(tok, skip_special=skip_special)
        stopper = StopChecker.for_params(params, eos_ids=tok.eos_ids, decoder=decoder)
        sampler = Sampler(params)
        generated: list[int] = []
        answer: list[str] = []
        reasoning: list[str] = []
        t_first = t_last = None

        def emit_text(text: str, final: bool = False) -> None:
            delta = splitter.feed(text) if text else None
            parts = [delta] if delta else []
            if final:
                parts.append(splitter.flush())
            for part in parts:
                if part.reasoning:
                    reasoning.append(part.reasoning)
                    self._emit(TokenEvent(rid, part.reasoning, True))
                if part.answer:
                    answer.append(part.answer)
                    self._emit(TokenEvent(rid, part.answer, False))

        if cancelled:
            reason = StopReason.CANCELLED
        else:
            self._set_phase(rid, "decoding", 0, params.max_tokens)
            while True:
                if self._is_cancelled(rid):
                    emit_text(stopper.finish(StopReason.CANCELLED).text)
                    break
                if conv.state.position >= ctx:
                    emit_text(stopper.finish(StopReason.CONTEXT_FULL).text)
                    break
                token = sampler.sample(logits, itertools.chain(ids, generated) if params.repetition_penalty != 1
                                       else ())
                generated.append(token)
                t_last = time.perf_counter()
                if t_first is None:
                    t_first = t_last
                step = stopper.step(token)
                emit_text(step.text)
                self._update_status(completion_tokens=len(generated), done=len(generated))
                if step.stopped:
                    break
                out = model.forward(torch.tensor([token], dtype=torch.long), conv.state)
                logits = out[-1].detach().to("cpu", torch.float32)
                conv.tokens.append(token)
                conv.logits = logits
            reason = stopper.reason or StopReason.CANCELLED
        emit_text("", final=True)
        self._conversation = None if abandoned else conv  # a half-advanced state is never reused
        finished = time.perf_counter()

        counters_end = self._counters()
        # Like the seed benchmark: counters cover the whole reply (prefill and decode) and
        # SSD traffic is normalised by generated tokens, not by decode steps.
        whole = {k: counters_end[k] - counters_start[k] for k in _COUNTERS}
        looked_up = whole["cache_hits"] + whole["cache_misses"]
        decode_s = t_last - t_first if t_first is not None and t_last is not None else 0.0
        stats = ReplyStats(
            prompt_tokens=len(ids),
            completion_tokens=len(generated),
            ttft_s=(t_first - submitted) if t_first is not None else 0.0,
            prefill_tok_s=prefilled / (t_prefill_end - t_prefill) if prefilled else 0.0,
            decode_tok_s=(len(generated) - 1) / decode_s if len(generated) > 1 and decode_s > 0 else 0.0,
            hit_rate=whole["cache_hits"] / looked_up if looked_up else 1.0,
            ssd_gb_per_token=whole["pack_read_bytes"] / GB / len(generated) if generated else 0.0,
            stop_reason=reason.value,
            cache_hits=int(whole["cache_hits"]),
            cache_misses=int(whole["cache_misses"]),
            pack_read_bytes=int(whole["pack_read_bytes"]),
            elapsed_s=finished - submitted,
        )
        self._emit(DoneEvent(rid, stats, "".join(answer), "".join(reasoning)))

    def _between_layers(self, rid: str, start: int, n: int, total: int, detail: str) -> LayerHook:
        """The layer hook of the prompt chunk of `n` tokens at `start` (of `total`): a
        cancelled request stops it (`_PrefillCancelled`), and every PREFILL_PROGRESS_S the
        prefill's progress counts the chunk's tokens in proportion to its layers done."""
        last = [time.perf_counter()]

        def on_layer(done: int, layers: int) -> None:
            if self._is_cancelled(rid):
                raise _PrefillCancelled
            now = time.perf_counter()
            if done < layers and now - last[0] >= PREFILL_PROGRESS_S:
                last[0] = now
                self._set_phase(rid, "prefill", start + n * done // layers, total, detail)

        return on_layer


class _PlainText(ReasoningSplitter):
    """The splitter of a text completion: everything is answer, nothing is held back."""

    def feed(self, delta: str) -> ReasoningDelta:
        return ReasoningDelta(answer=delta)

    def flush(self) -> ReasoningDelta:
        return ReasoningDelta()


def precision_label(dtype: torch.dtype, decode_dtype: torch.dtype) -> str:
    """"float32", "bf16", or "bf16 prompts, float32 replies" (prompt chunks in one dtype,
    decode steps in another)."""
    names = {torch.float32: "float32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "float64"}
    chunk, step = (names.get(d, str(d).removeprefix("torch.")) for d in (dtype, decode_dtype))
    return chunk if chunk == step else f"{chunk} prompts, {step} replies"


def _checked(options: RuntimeOptions) -> tuple[RuntimeOptions, torch.device, torch.dtype]:
    """`options` with the device and activation dtype they resolve to; ValueError for an
    unknown device or dtype, or a CUDA device this machine does not have."""
    if not isinstance(options, RuntimeOptions):
        raise TypeError(f"options must be an engine.options.RuntimeOptions, not {type(options).__name__}")
    device = options.resolved_device()
    options.resolved_decode_dtype(device)  # checked here too: a bad name fails before any thread starts
    return options, device, options.resolved_dtype(device)


def _empty_stats(stop_reason: str, submitted: float) -> ReplyStats:
    return ReplyStats(prompt_tokens=0, completion_tokens=0, ttft_s=0.0, prefill_tok_s=0.0, decode_tok_s=0.0,
                      hit_rate=1.0, ssd_gb_per_token=0.0, stop_reason=stop_reason,
                      elapsed_s=time.perf_counter() - submitted)
