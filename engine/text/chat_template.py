"""Chat prompt rendering (Jinja chat templates and built-in formats) and reasoning splitting.

Templates come from downloaded model files, so they are untrusted code. They are
rendered exactly the way ``transformers``' ``apply_chat_template`` renders them (same
Jinja settings, globals, filters and input clean-up; see
``transformers/utils/chat_template_utils.py``: ``_compile_jinja_template`` and
``render_jinja_template``) inside Jinja's ``ImmutableSandboxedEnvironment``. One
deliberate difference: where the sandbox would quietly render an attribute it refuses
(``''.__class__``) as an empty string, we stop with :class:`ChatTemplateError`, so a
template that reaches for Python internals never produces a prompt.

No template can hang the app either: every render runs under :class:`TemplateLimits`
(time, output size, loop iterations, range length, integer size, the size of any value it
builds, and the total it builds), enforced from hooks inside the sandbox and, for the
time limit, by the caller, which waits for the render on a helper thread and abandons it
at the deadline. Past a limit the render stops with :class:`TemplateLimitError`, naming
the template and the limit ("render limits" below says what bounds what). Output is the
same as without limits; templates that stay within them render as before.

Message text is data, not markup: :func:`render_prompt` also reports where message
text spells a control token (``<｜User｜>``, ``<|im_start|>``), so the tokenizer reads
those as plain text while the template's own markers stay control tokens.

When a model file carries no template, :func:`render_chat` can fall back to a
built-in format (``deepseek-v4``, ``kimi-k3``, ``kimi-k2``), written from the models'
published encoders/templates:

* DeepSeek-V4: ``encoding/encoding_dsv4.py`` shipped with deepseek-ai/DeepSeek-V4-Flash
  (the model has no Jinja template); same layout as DeepSeek-V3.1/V3.2.
* Kimi-K3: the XTML message format of llama.cpp's ``models/templates/Kimi-K3.jinja``.
* Kimi-K2: moonshotai/Kimi-K2-Instruct's template (llama.cpp
  ``models/templates/moonshotai-Kimi-K2.jinja``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import inspect
import itertools
import json
import re
import threading
import time
import types
from collections.abc import (
    Callable,
    Collection,
    Container,
    ItemsView,
    Iterable,
    Iterator,
    KeysView,
    Mapping,
    Sequence,
    ValuesView,
)
from datetime import datetime
from functools import lru_cache, update_wrapper, wraps
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.compiler import CodeGenerator, Frame, operators, optimizeconst
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError, UndefinedError
from jinja2.runtime import LoopContext, Macro
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
from markupsafe import Markup

from .tool_calls import ToolFormatError, encode_tool_calls, render_tools

__all__ = [
    "ChatTemplateError",
    "TemplateLimitError",
    "TemplateLimits",
    "TemplateRenderCancelled",
    "RenderedPrompt",
    "render_chat",
    "render_prompt",
    "render_builtin",
    "BUILTIN_FORMATS",
    "builtin_format_for_vocab",
    "ReasoningSplitter",
    "ReasoningDelta",
    "split_reasoning",
    "reasoning_splitter_for",
]


class ChatTemplateError(ValueError):
    """A chat prompt could not be rendered (bad/unsafe template or unsupported input)."""


class TemplateLimitError(ChatTemplateError):
    """A chat template went past one of its :class:`TemplateLimits` and was stopped.

    ``source`` names the template (``"tokenizer.chat_template of MODEL"``); ``limit`` is the
    limit it hit: ``"time"``, ``"output"``, ``"loop iterations"``, ``"range"``,
    ``"integer size"``, ``"value size"`` or ``"work"``.
    """

    def __init__(self, message: str, source: str, limit: str) -> None:
        super().__init__(message)
        self.source = source
        self.limit = limit


class TemplateRenderCancelled(Exception):
    """The caller's ``should_stop`` said stop while the chat template was rendering."""


@dataclasses.dataclass(frozen=True)
class TemplateLimits:
    """Bounds on one render of a chat template (what bounds what: "render limits" below).

    The limits grow with the conversation, so a long chat is never refused: its *size* is
    the characters of all strings in the messages, tools and variables, plus
    ``message_weight`` per message (a template spends most of its effort on each message's
    markup, not its text).

    time_s: wall time of one render (compiling the template included) of a small
        conversation; one more ``time_s`` per million characters of size.
    loop_iterations: for-loop iterations of one render, all loops together, likewise per
        million characters of size.
    output_chars, output_chars_per_input_char: the prompt may be ``output_chars`` plus this
        many characters per character of size. No single string or list a template builds
        may be longer either, and no value nested more than 256 deep may be compared or
        hashed (both ``value size``).
    work_factor: everything one render builds (strings, list items, text collected by
        macros and ``{% set %}`` blocks) may add up to this many times the output limit;
        this bounds the memory a render holds.
    range_length: the longest ``range()`` (Jinja's sandbox allows 100000 too).
    int_bits: the largest integer a template may compute.
    """

    time_s: float = 1.0
    loop_iterations: int = 1_000_000
    output_chars: int = 1 << 20
    output_chars_per_input_char: int = 4
    message_weight: int = 250
    work_factor: int = 8
    range_length: int = 100_000
    int_bits: int = 1024

    def __post_init__(self) -> None:
        if not self.time_s > 0:
            raise ValueError(f"time_s must be positive, got {self.time_s!r}")
        for name in ("loop_iterations", "output_chars", "output_chars_per_input_char", "message_weight",
                     "work_factor", "range_length", "int_bits"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} cannot be negative, got {getattr(self, name)!r}")


# --------------------------------------------------------------------------- render limits
#
# Jinja cannot be interrupted: a template stops only where it calls back into Python that we
# control. So every way a template can spend time or memory passes through a hook, and each
# hook charges the render's _Budget:
#
# * time: every hook compares the clock with the deadline. Hooks are each loop iteration
#   (every {% for %} iterable is wrapped at compile time, recursive loop() calls too), every
#   call (macros, globals, methods), every filter, the operators + - * / // % **, `~`,
#   slicing, every value written out and every piece of output. A loop or a recursion cannot
#   avoid them, and one operation between two hooks is bounded by the size limits. The
#   caller does not depend on that: it waits for the render on a helper thread and, at the
#   deadline, gives up, stops the render thread at its next bytecode and raises (_run_limited).
# * loop iterations: counted over all loops of the render.
# * range: range() refuses more than range_length items.
# * integer size: ** and integer * are estimated before they run, other integer results after.
# * value size: no string or list may exceed the output limit. Operations that multiply
#   their input (*, % and format widths, ljust/center/zfill, replace, join, indent, wordwrap,
#   sum, lipsum, to_bytes, ...) are estimated *before* they run; those whose result is at most
#   the sum of their inputs (+, ~) are checked after. Before a container is turned into text
#   (written out, ~, |string, |tojson, ...) the size of that text is measured, so nested lists
#   repeating one big string cannot explode into gigabytes.
# * work: every result, every value written out and the template text gathered by macros
#   and {% set %} blocks counts against work_factor x the output limit, so the memory a
#   render holds at once is bounded.
# * output: the prompt is produced piece by piece with Template.generate() and counted.


class _Stop(BaseException):
    # A BaseException, so that no `except Exception` (Jinja's int filter, a template's own
    # helpers) can swallow it; render_prompt turns it into TemplateLimitError.
    def __init__(self, limit: str, detail: str) -> None:
        super().__init__(limit, detail)
        self.limit = limit
        self.detail = detail


class _Interrupt(BaseException):
    """Raised in the render thread by its caller at the deadline (PyThreadState_SetAsyncExc)."""


_state = threading.local()  # .budget: the _Budget of the render running on this thread


def _budget() -> _Budget | None:
    return getattr(_state, "budget", None)


_END = object()
_FLAT = (str, int, float, type(None))  # compared and hashed in time of their own size
_VIEWS = (KeysView, ValuesView, ItemsView)  # d.keys(), d.values(), d.items()
_MAX_DEPTH = 256  # nesting of a value compared or hashed


def _measure(value: Any, limit: int) -> tuple[int, int, int]:
    """About how many characters ``str(value)`` has, with its node count and nesting depth.

    Stops counting once past ``limit``. Walks the containers with a stack of iterators, so a
    huge list costs no copy and a deep one no recursion.
    """
    size = nodes = depth = 0
    stack: list[Iterator[Any]] = [iter((value,))]
    while stack and size <= limit:
        obj = next(stack[-1], _END)
        if obj is _END:
            stack.pop()
            continue
        nodes += 1
        depth = max(depth, len(stack))
        if isinstance(obj, (str, bytes)):
            size += len(obj) + 2
        elif obj is None or isinstance(obj, bool):
            size += 5
        elif isinstance(obj, int):
            size += obj.bit_length() * 3 // 10 + 2
        elif isinstance(obj, float):
            size += 24
        elif isinstance(obj, dict):
            size += 2 + 4 * len(obj)
            stack.append(itertools.chain.from_iterable(obj.items()))
        elif isinstance(obj, (list, tuple, set, frozenset, *_VIEWS)):  # views: d.items() prints its items
            size += 2 + 2 * len(obj)
            stack.append(iter(obj))
        elif isinstance(obj, jinja2.utils.Namespace):
            size += 12
            stack.append(iter((object.__getattribute__(obj, "_Namespace__attrs"),)))
        elif not isinstance(obj, jinja2.Undefined):
            size += 64
    return size, nodes, depth


def _number(digits: str) -> int:
    return int(digits) if len(digits) < 19 else 1 << 62


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")
_DIGITS = re.compile(r"\d+")


def _spec_size(spec: str) -> int:
    """Characters a format spec (``>10``, ``.3f``) can add: its widths and precisions."""
    return sum(_number(d) for d in _DIGITS.findall(spec)) + (330 if spec[-1:] in ("f", "F", "%") else 0)


def _replace_size(text: str | bytes, old: Any, new: Any, count: Any) -> int:
    if not (isinstance(old, type(text)) and isinstance(new, type(text))):
        return len(text)  # replace() raises TypeError itself
    hits = text.count(old) if old else len(text) + 1  # type: ignore[arg-type]
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(len(new) - len(old), 0)


class _Budget:
    """What one render may still spend (see TemplateLimits and "render limits" above)."""

    def __init__(self, limits: TemplateLimits, size: int, marker: str | None) -> None:
        # size: of the conversation, as TemplateLimits counts it
        scale = 1 + size / 1_000_000
        self.limits = limits
        self.time_s = limits.time_s * scale
        self.max_iterations = int(limits.loop_iterations * scale)
        self.max_chars = limits.output_chars + limits.output_chars_per_input_char * size
        self.max_work = limits.work_factor * self.max_chars
        self.deadline = time.monotonic() + self.time_s
        self.marker = marker  # see _protect: the character that marks control tokens of message text
        self.work = 0
        self.iterations = 0
        self.stopped: str | None = None  # "time" or "cancelled": set by the waiting caller

    # --- the checks
    def tick(self) -> None:
        if self.stopped is not None or time.monotonic() > self.deadline:
            raise self.stop(self.stopped or "time")

    def stop(self, reason: str) -> _Stop:
        """The _Stop for the deadline ("time") or a cancel ("cancelled")."""
        if reason == "time":
            return _Stop("time", f"it ran past the time limit of {self.time_s:.3g} s")
        return _Stop(reason, "it was cancelled")

    def iteration_stop(self) -> _Stop:
        """The _Stop for a loop iteration that went past a limit (see _Counted)."""
        if self.iterations > self.max_iterations:
            return _Stop("loop iterations", f"its loops ran past the limit of {self.max_iterations:,} loop iterations")
        return self.stop(self.stopped or "time")

    def check_size(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise _Stop("value size", f"{what} would be about {size:,} characters or items, past the value size "
                        f"limit of {self.max_chars:,}")

    def check_bits(self, bits: int) -> None:
        if bits > self.limits.int_bits:
            raise _Stop("integer size", f"it computed an integer of about {bits:,} bits, past the integer size "
                        f"limit of {self.limits.int_bits:,} bits")

    def charge(self, amount: int) -> None:
        self.work += amount
        if self.work > self.max_work:
            raise _Stop("work", f"it built more than {self.max_work:,} characters and items in all, past the "
                        "work limit")

    def measure(self, value: Any) -> int:
        """About how many characters ``str(value)`` has (exactly, for a string)."""
        if isinstance(value, str):
            return len(value)
        if isinstance(value, int):
            return value.bit_length() * 3 // 10 + 2
        if isinstance(value, float):
            return 24
        if value is None or isinstance(value, jinja2.Undefined):
            return 4  # "None"; an undefined value prints as ""
        return _measure(value, self.max_chars)[0]

    def produced(self, result: Any, deep: bool = True) -> Any:
        """Check and charge a value an operation just built (``deep``: its strings are new too)."""
        if isinstance(result, (str, bytes)):
            size = len(result)
            self.check_size(size, "a value it built")
        elif isinstance(result, (list, tuple, dict)):
            size = len(result)
            self.check_size(size, "a list it built")
            if deep:
                items = result.values() if isinstance(result, dict) else result
                size += sum(len(x) for x in items if isinstance(x, (str, bytes, list, tuple, dict)))
        else:
            if isinstance(result, int) and not isinstance(result, bool):
                self.check_bits(result.bit_length())
            return result
        self.charge(size)
        return result

    def operand(self, value: Any) -> Any:
        """A value about to be compared or hashed: == and hash() of a container walk all of it
        in one C call, so a list repeating itself (built by doubling) must be sized first, and
        hash() recurses in C without a depth check, so deep nesting is refused too."""
        if isinstance(value, (list, tuple, dict, *_VIEWS)) and not (
                len(value) <= 32 and all(isinstance(x, _FLAT) for x in value)):  # literals like ['a', 'b']
            size, _, depth = _measure(value, self.max_chars)
            self.check_size(size, "a value compared or hashed")
            if depth > _MAX_DEPTH:
                raise _Stop("value size", f"a value compared or hashed is nested {depth:,} deep, past the limit "
                            f"of {_MAX_DEPTH}")
        return value

    def take(self, iterable: Any) -> list:
        """An iterable as a list (to size it before it is used), at most the value size limit long."""
        items = []
        for item in iterable:
            items.append(item)
            if len(items) & 4095 == 0:
                self.check_size(len(items), "an iterable it consumed")
                self.tick()
        return items

    # --- estimates made before an operation runs
    def check_binop(self, operator: str, left: Any, right: Any) -> None:
        if operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                self.check_bits((abs(left).bit_length() - 1) * right + 1)
        elif operator == "*":
            if isinstance(left, int) and isinstance(right, int):
                self.check_bits(abs(left).bit_length() + abs(right).bit_length())
            else:
                seq, times = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(times, int) and isinstance(seq, (str, bytes, list, tuple)) and times > 0:
                    self.check_size(self.measure(seq) * times, "a repeated string or list")
        elif operator == "%" and isinstance(left, str):
            self.check_size(self.percent_size(left, right), "the result of %-formatting")

    def percent_size(self, fmt: str, args: Any) -> int:
        values = args if isinstance(args, tuple) else (args,)
        size = len(fmt) + self.measure(values)
        star = False
        for width, precision, conversion in _PERCENT_SPEC.findall(fmt):
            for part in (width, precision):
                if part == "*":
                    star = True
                elif part:
                    size += _number(part)
            size += 330 if conversion in ("f", "F") else 0
        if star:
            size += sum(abs(v) for v in values if isinstance(v, int))
        return size

    def check_call(self, obj: Any, args: tuple, kwargs: dict[str, Any]) -> tuple:
        """Estimate what a call builds before it runs; returns the arguments to call with."""
        if isinstance(obj, LoopContext) and args:  # a recursive loop(): its items are iterations too
            return (_Counted(args[0], self), *args[1:])
        if not isinstance(obj, Macro):  # Python code may compare, hash or print what it is given
            for arg in itertools.chain(args, kwargs.values()):
                self.operand(arg)
        owner = getattr(obj, "__self__", None)
        name = getattr(obj, "__name__", "")
        if isinstance(owner, (str, bytes)):
            what = f"the result of {name}()"
            if name in ("ljust", "rjust", "center", "zfill") and args and isinstance(args[0], int):
                self.check_size(max(len(owner), args[0]), what)
            elif name == "expandtabs":
                tab = args[0] if args else kwargs.get("tabsize", 8)
                if isinstance(tab, int):
                    tabs = owner.count("\t") if isinstance(owner, str) else owner.count(b"\t")
                    self.check_size(len(owner) + tabs * tab, what)
            elif name == "replace" and len(args) >= 2:
                count = args[2] if len(args) > 2 else kwargs.get("count", -1)
                self.check_size(_replace_size(owner, args[0], args[1], count), what)
            elif name == "join" and args:
                items = args[0] if isinstance(args[0], (list, tuple)) else self.take(args[0])
                self.check_size(self.measure(items) + len(items) * len(owner), what)
                return (items, *args[1:])
            elif name == "translate" and args and isinstance(args[0], dict):
                longest = max((len(v) for v in args[0].values() if isinstance(v, (str, bytes))), default=1)
                self.check_size(len(owner) * max(longest, 1), what)
        elif isinstance(owner, int) and name == "to_bytes":
            length = args[0] if args else kwargs.get("length", 1)
            if isinstance(length, int):
                self.check_size(length, "the result of to_bytes()")
        elif obj is jinja2.utils.generate_lorem_ipsum:
            bound = _bind(_LIPSUM_SIGNATURE, args, kwargs)
            if bound is not None:
                n, longest = bound.get("n", 5), max(bound.get("min", 20), bound.get("max", 100))
                if isinstance(n, int) and isinstance(longest, int):
                    self.check_size(n * longest * 12, "the result of lipsum()")
        return args

    def check_filter(self, name: str, value: Any, arguments: dict[str, Any]) -> None:
        """Estimate what a filter builds before it runs (``arguments``: bound by name)."""
        check = _FILTER_CHECKS.get(name)
        if check is not None:
            size = check(self, arguments)
            if size:
                self.check_size(size, f"the result of the {name!r} filter")
        elif name in _STRINGIFYING_FILTERS:
            self.check_size(self.measure(value), f"the text of the value given to the {name!r} filter")


def _bind(signature: inspect.Signature, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    try:
        return dict(signature.bind(*args, **kwargs).arguments)
    except TypeError:
        return None  # the call itself raises the TypeError


_LIPSUM_SIGNATURE = inspect.signature(jinja2.utils.generate_lorem_ipsum)


def _join_size(budget: _Budget, a: dict[str, Any]) -> int:
    value, sep = a.get("value"), a.get("d", "")
    if isinstance(value, str):
        return len(value) * (1 + budget.measure(sep))
    n = len(value) if isinstance(value, (list, tuple, dict)) else 0
    return budget.measure(value) + n * budget.measure(sep)


def _sum_size(budget: _Budget, a: dict[str, Any]) -> int:
    items, start = a.get("iterable"), a.get("start", 0)
    if not isinstance(items, (list, tuple)):
        return 0
    if a.get("attribute") is not None:
        return budget.measure(items)
    sizes = [len(x) for x in items if isinstance(x, (list, tuple, str))]
    total = sum(sizes) + (len(start) if isinstance(start, (list, tuple)) else 0)
    budget.check_size(total, "the result of the 'sum' filter")
    budget.charge(len(sizes) * total // 2)  # sum() copies the growing list once per item
    return total


def _indent_size(budget: _Budget, a: dict[str, Any]) -> int:
    text, width = a.get("s"), a.get("width", 4)
    pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    lines = text.count("\n") + 1 if isinstance(text, str) else 1
    return budget.measure(text) + lines * max(pad, 0)


def _wordwrap_size(budget: _Budget, a: dict[str, Any]) -> int:
    text, width, wrap = a.get("s"), a.get("width", 79), a.get("wrapstring")
    if not isinstance(text, str) or not isinstance(width, int):
        return budget.measure(text)
    lines = len(text) // max(width, 1) + text.count("\n") + 1
    return len(text) + lines * (len(wrap) if isinstance(wrap, str) else 1)


def _replace_filter_size(budget: _Budget, a: dict[str, Any]) -> int:
    text, old, new, count = a.get("s"), a.get("old"), a.get("new"), a.get("count")
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        return _replace_size(text, old, new, -1 if count is None else count)
    size = budget.measure(text)
    return size + (size + 1) * (len(new) if isinstance(new, str) else 0)


def _center_size(budget: _Budget, a: dict[str, Any]) -> int:
    width = a.get("width", 80)
    return max(budget.measure(a.get("value")), width if isinstance(width, int) else 0)


def _format_size(budget: _Budget, a: dict[str, Any]) -> int:
    value = a.get("value")
    if not isinstance(value, str):
        return budget.measure(value)
    return budget.percent_size(value, a.get("kwargs") or a.get("args", ()))


def _tojson_size(budget: _Budget, a: dict[str, Any]) -> int:
    size, nodes, depth = _measure(a.get("x"), budget.max_chars)
    indent, separators = a.get("indent"), a.get("separators")
    pad = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    seps = sum(len(s) for s in separators if isinstance(s, str)) if isinstance(separators, (list, tuple)) else 3
    return size + nodes * (max(pad, 0) * depth + 1 + seps)


def _pprint_size(budget: _Budget, a: dict[str, Any]) -> int:
    size, nodes, depth = _measure(a.get("value"), budget.max_chars)
    return size + nodes * (depth + 2)


def _count_size(key: str) -> Callable[[_Budget, dict[str, Any]], int]:
    def size(budget: _Budget, a: dict[str, Any]) -> int:  # batch/slice build that many lists
        n = a.get(key)
        return n if isinstance(n, int) else 0

    return size


_FILTER_CHECKS: dict[str, Callable[[_Budget, dict[str, Any]], int]] = {
    "join": _join_size,
    "sum": _sum_size,
    "indent": _indent_size,
    "wordwrap": _wordwrap_size,
    "replace": _replace_filter_size,
    "center": _center_size,
    "format": _format_size,
    "tojson": _tojson_size,
    "pprint": _pprint_size,
    "batch": _count_size("linecount"),
    "slice": _count_size("slices"),
}
# Filters that turn their value into text (str()), or compare or hash all of it, first.
_STRINGIFYING_FILTERS = frozenset({
    "string", "e", "escape", "forceescape", "safe", "trim", "upper", "lower", "capitalize", "title", "striptags",
    "urlize", "urlencode", "wordcount", "xmlattr", "truncate", "sort", "unique", "dictsort", "groupby", "min", "max",
})
# Tests that compare (or hash) their arguments.
_COMPARING_TESTS = frozenset({
    "in", "eq", "equalto", "==", "ne", "!=", "lt", "lessthan", "<", "le", "<=", "gt", "greaterthan", ">", "ge", ">=",
})


def _guarded_test(func: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if budget is not None:
            for arg in itertools.chain(args, kwargs.values()):
                budget.operand(arg)
        return func(*args, **kwargs)

    return guarded


# Filters whose value is consumed first: a generator (|map, |select) is made a list to be sized.
_MATERIALIZED_FILTERS = {"join": "value", "sum": "iterable"}


def _binder(signature: inspect.Signature) -> Callable[[tuple, dict[str, Any]], dict[str, Any] | None]:
    """A fast ``signature.bind(...).arguments`` with defaults filled in (a filter runs often)."""
    params = list(signature.parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return lambda args, kwargs: _bind(signature, args, kwargs)
    names = [p.name for p in params if p.kind != p.KEYWORD_ONLY]
    defaults = {p.name: p.default for p in params if p.default is not p.empty}

    def bind(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        if len(args) > len(names):
            return None  # the call itself raises the TypeError
        bound = dict(defaults)
        bound.update(zip(names, args))
        bound.update(kwargs)
        return bound

    return bind


def _guarded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` (a Jinja filter) with the budget's checks around it; Jinja's pass_* marks kept."""
    signature = inspect.signature(func)  # of the function it wraps, for Jinja's async variants
    inner = getattr(inspect.unwrap(func), "jinja_pass_arg", None)  # set by @pass_context & co.
    # Jinja passes the context/environment first; an async variant whose inner function does
    # not take it drops it itself (|list, |slice), so it is not part of the signature.
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None and inner is None else 0
    names = list(signature.parameters)
    value_name = names[1 if inner is not None else 0] if len(names) > (1 if inner is not None else 0) else None
    bind = _binder(signature)
    checked = name in _FILTER_CHECKS or name in _STRINGIFYING_FILTERS
    materialized = _MATERIALIZED_FILTERS.get(name)
    materialized_at = names.index(materialized) if materialized in names else -1

    @wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if budget is None:
            return func(*args, **kwargs)
        budget.tick()
        if checked:
            bound = bind(args[skip:], kwargs)
            if bound is not None:
                if materialized is not None and not isinstance(
                        bound.get(materialized), (str, list, tuple, dict, type(None))):
                    bound[materialized] = items = budget.take(bound[materialized])
                    if materialized in kwargs:
                        kwargs = {**kwargs, materialized: items}
                    else:
                        at = skip + materialized_at
                        args = (*args[:at], items, *args[at + 1:])
                budget.check_filter(name, bound.get(value_name) if value_name else None, bound)
        return budget.produced(func(*args, **kwargs))

    return guarded


class _Counted:
    """A for-loop's iterable whose items are counted as loop iterations of the render."""

    __slots__ = ("_iterable", "_budget")

    def __init__(self, iterable: Any, budget: _Budget) -> None:
        self._iterable = iterable
        self._budget = budget

    def __iter__(self) -> Iterator[Any]:
        budget = self._budget
        limit = budget.max_iterations
        clock = time.monotonic
        for item in self._iterable:  # inlined: this runs once per iteration of every loop
            budget.iterations += 1
            if budget.iterations > limit or budget.stopped is not None or clock() > budget.deadline:
                raise budget.iteration_stop()
            yield item

    def __len__(self) -> int:  # LoopContext.length; TypeError for an unsized iterable, as before
        return len(self._iterable)


_LOOP_GUARD = "expertdesk_loop_guard"


@jinja2.pass_context  # never folded into a constant at compile time
def _loop_guard(context: Any, iterable: Any) -> Any:
    budget = _budget()
    return iterable if budget is None else _Counted(iterable, budget)


def _range(*args: Any) -> range:
    """``range`` for templates: at most TemplateLimits.range_length items (Jinja's MAX_RANGE without a budget)."""
    rng = range(*args)
    budget = _budget()
    limit = budget.limits.range_length if budget is not None else MAX_RANGE
    length = max(0, -((rng.start - rng.stop) // rng.step))  # len() overflows for huge ranges
    if length > limit:
        if budget is None:
            raise OverflowError(f"range of {length} items is larger than {limit}")
        raise _Stop("range", f"it asked for a range() of {length:,} items, past the range limit of {limit:,}")
    return rng


def _finalize(value: Any) -> Any:
    """Every ``{{ value }}`` passes here before it becomes text: its text is sized first."""
    budget = _budget()
    if budget is not None:
        size = budget.measure(value)
        if size > budget.max_chars:
            budget.check_size(size, "a value written to the prompt")
        budget.charge(size)
    return value


class _GuardedCodeGenerator(CodeGenerator):
    """Jinja's code generator plus the hooks the render limits need (see "render limits")."""

    def visit_Template(self, node: jinja2.nodes.Template, frame: Frame | None = None) -> None:
        # Every loop iterates through the loop guard filter: each item is one counted iteration.
        for loop in list(node.find_all(jinja2.nodes.For)):
            guard = jinja2.nodes.Filter(loop.iter, _LOOP_GUARD, [], [], None, None, lineno=loop.iter.lineno)
            loop.iter = guard.set_environment(self.environment)
        super().visit_Template(node, frame)

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        # As Jinja's, with the parts sized (and charged) before they are joined.
        if frame.eval_ctx.volatile:
            func_name = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            func_name = "markup_join"
        else:
            func_name = "str_join"
        self.write(f"{func_name}(environment.guard_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(")))")

    @optimizeconst
    def visit_Compare(self, node: jinja2.nodes.Compare, frame: Frame) -> None:
        # As Jinja's, with every operand sized first (== of two containers can take forever).
        self.write("(environment.guard_operand(")
        self.visit(node.expr, frame)
        self.write(")")
        for op in node.ops:
            self.visit(op, frame)
        self.write(")")

    def visit_Operand(self, node: jinja2.nodes.Operand, frame: Frame) -> None:
        self.write(f" {operators[node.op]} environment.guard_operand(")
        self.visit(node.expr, frame)
        self.write(")")

    def visit_Dict(self, node: jinja2.nodes.Dict, frame: Frame) -> None:
        # As Jinja's, with the keys sized before they are hashed.
        self.write("{")
        for idx, item in enumerate(node.items):
            if idx:
                self.write(", ")
            self.write("environment.guard_operand(")
            self.visit(item.key, frame)
            self.write("): ")
            self.visit(item.value, frame)
        self.write("}")

    def visit_Getitem(self, node: jinja2.nodes.Getitem, frame: Frame) -> None:
        # Jinja writes slices as plain Python (they bypass environment.getitem); a slice is a copy.
        if isinstance(node.arg, jinja2.nodes.Slice):
            self.write("environment.guard_slice(")
            super().visit_Getitem(node, frame)
            self.write(")")
        else:
            super().visit_Getitem(node, frame)

    def visit_Output(self, node: jinja2.nodes.Output, frame: Frame) -> None:
        super().visit_Output(node, frame)
        if frame.buffer is not None:
            # Template text collected by a macro or a {% set %} block is work too (the
            # top-level output is counted by the render loop).
            size = sum(len(child.data) for child in node.nodes if isinstance(child, jinja2.nodes.TemplateData))
            if size:
                self.writeline(f"environment.guard_charge({size})")


class _LimitedFormatter(SandboxedFormatter):
    """str.format() of the sandbox, with each field's width and text sized first."""

    def format_field(self, value: Any, format_spec: str) -> Any:
        budget = _budget()
        if budget is None:
            return super().format_field(value, format_spec)
        budget.tick()
        budget.check_size(budget.measure(value) + _spec_size(format_spec), "a str.format() field")
        return budget.produced(super().format_field(value, format_spec))


class _LimitedEscapeFormatter(_LimitedFormatter, SandboxedEscapeFormatter):
    pass


def _interrupt(thread: threading.Thread) -> None:
    """Raise _Interrupt in ``thread`` at its next bytecode (CPython's PyThreadState_SetAsyncExc)."""
    if thread.ident is None:
        return
    try:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Interrupt))
    except (AttributeError, OSError, ValueError):
        pass  # not CPython: the render stops at its next hook


_POLL_S = 0.05  # how often a waiting caller asks should_stop()
_GRACE_S = 0.2  # how long a caller waits for an interrupted render thread to end


def _run_limited(work: Callable[[], str], budget: _Budget, should_stop: Callable[[], bool] | None) -> str:
    """Run ``work`` (a render) on a helper thread under ``budget``; raise _Stop at the deadline.

    The render thread stops by itself at its next hook once the deadline passed. The caller
    does not rely on it: at the deadline (or when ``should_stop()`` says so) it marks the
    budget stopped, raises _Interrupt in the render thread and, after a short grace period,
    gives up on it. A thread stuck in one long C call is then left behind (a daemon) and ends
    at its next hook; the size limits keep such calls short.
    """
    box: dict[str, Any] = {}
    finished = threading.Event()

    def target() -> None:
        try:
            _state.budget = budget
            try:
                box["result"] = work()
            except BaseException as exc:  # handed over to the caller
                box["error"] = exc
            finally:
                _state.budget = None
                finished.set()
        except _Interrupt:  # the caller's interrupt arrived as the render ended: nothing to report
            pass

    thread = threading.Thread(target=target, name="expertdesk-chat-template", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # no thread to be had: render here, stopped by the hooks alone
        target()
    while not finished.is_set():
        left = budget.deadline - time.monotonic()
        if should_stop is not None and should_stop():
            reason = "cancelled"
        elif left <= 0:
            reason = "time"
        else:
            finished.wait(min(left, _POLL_S) if should_stop is not None else left)
            continue
        budget.stopped = reason
        _interrupt(thread)
        if not finished.wait(_GRACE_S):
            raise budget.stop(reason)
    error = box.get("error")
    if isinstance(error, _Interrupt):
        raise budget.stop(budget.stopped or "time")
    if error is not None:
        raise error
    return box["result"]


# --------------------------------------------------------------------------- Jinja setup


class _Sandbox(ImmutableSandboxedEnvironment):
    """The transformers sandbox, but refused attribute access raises at once.

    Jinja's default returns an Undefined that prints as "" for e.g. ``''.__class__``;
    a template that tries that is hostile or broken, and must not yield a prompt.
    """

    code_generator_class = _GuardedCodeGenerator
    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    # The hooks of the render limits ("render limits" above); without a budget (outside
    # render_prompt) they behave as Jinja's.
    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        if budget is None:
            return super().call_binop(context, operator, left, right)
        budget.tick()
        budget.check_binop(operator, left, right)
        return budget.produced(self.binop_table[operator](left, right), deep=False)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if budget is None:
            return super().call(context, obj, *args, **kwargs)
        budget.tick()
        args = budget.check_call(obj, args, kwargs)
        return budget.produced(super().call(context, obj, *args, **kwargs))

    def guard_operand(self, value: Any) -> Any:
        """Called by the generated code with each operand of a comparison and each dict key."""
        budget = _budget()
        return value if budget is None else budget.operand(value)

    def getitem(self, obj: Any, argument: Any) -> Any:
        budget = _budget()
        if budget is not None:
            budget.operand(argument)  # a key is hashed
        return super().getitem(obj, argument)

    def guard_slice(self, value: Any) -> Any:
        """Called by the generated code with the result of ``x[a:b]`` (a copy)."""
        budget = _budget()
        if budget is not None:
            budget.tick()
            return budget.produced(value, deep=False)
        return value

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        # Jinja's, with formatters that size every field before formatting it.
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) or value.__name__ not in (
                "format", "format_map"):
            return None
        f_self: Any = value.__self__
        if not isinstance(f_self, str):
            return None
        str_type: type[str] = type(f_self)
        is_format_map = value.__name__ == "format_map"
        formatter: SandboxedFormatter
        if isinstance(f_self, Markup):
            formatter = _LimitedEscapeFormatter(self, escape=f_self.escape)
        else:
            formatter = _LimitedFormatter(self)
        vformat = formatter.vformat

        def wrapper(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs:
                    raise TypeError("format_map() takes no keyword arguments")
                if len(args) != 1:
                    raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
                kwargs = args[0]
                args = ()
            return str_type(vformat(f_self, args, kwargs))

        return update_wrapper(wrapper, value)

    def guard_concat(self, parts: tuple) -> tuple:
        """Called by the generated code of ``a ~ b``: sizes the parts before they are joined."""
        budget = _budget()
        if budget is not None:
            budget.tick()
            size = sum(budget.measure(part) for part in parts)
            budget.check_size(size, "a string joined with ~")
            budget.charge(size)
        return parts

    def guard_charge(self, size: int) -> None:
        """Called by the generated code of macros and {% set %} blocks for the template text they gather."""
        budget = _budget()
        if budget is not None:
            budget.charge(size)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant spans with it.

    We never need the spans, so the body is rendered as is (what transformers does when
    it is not asked for an assistant mask).
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: Any) -> None:
    raise TemplateError(_short(message))


def _short(value: Any, limit: int = 2000) -> str:
    """Text for an error message, never long, and never a repr() that could take forever."""
    if not isinstance(value, str):
        size = _measure(value, limit)[0]
        value = repr(value) if size <= limit else f"<a {type(value).__name__} of about {size:,}+ characters>"
    return value if len(value) <= limit else value[:limit] + "..."


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers replaces Jinja's tojson (which HTML-escapes) with plain json.dumps.
    out = json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    budget = _budget()
    marker = budget.marker if budget is not None else None
    if ensure_ascii and marker is not None and marker not in out:
        # ensure_ascii wrote the marker of control tokens in message text as \uXXXX escapes: put it back.
        escaped = json.dumps(marker)[1:-1]
        out = re.sub(r"(?<!\\)((?:\\\\)*)" + re.escape(escaped), lambda m: m.group(1) + marker, out)
    return out


def _strftime_now(format: str) -> str:  # noqa: A002 - name used by templates
    return datetime.now().strftime(format)


class _TemplateDict:
    # A limited dict() so templates cannot reach dict's class through the global.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Namespaces refuse underscore names so they cannot be used to reach internals.
    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError("chat templates cannot store underscore-prefixed attributes on a namespace, "
                                f"but got {name!r}")


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols],
                   finalize=_finalize)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    env.globals["range"] = _range
    for name, func in list(env.filters.items()):
        env.filters[name] = _guarded_filter(name, func)
    for name in _COMPARING_TESTS & set(env.tests):
        env.tests[name] = _guarded_test(env.tests[name])  # type: ignore[arg-type]
    env.filters[_LOOP_GUARD] = _loop_guard
    return env.from_string(template)


# --------------------------------------------------------------------------- input clean-up
# Mirrors transformers: drop None-valued message keys, rebuild everything the template
# sees from plain JSON types (no foreign objects with callable methods reach the
# sandbox), and copy reasoning under the names templates read.

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _plain(value: Any) -> Any:
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", None) == 0:
        return _plain(value.item())  # numpy / torch scalars
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or len(messages) == 0:
        raise ChatTemplateError("cannot render an empty conversation: pass a non-empty list of message dicts")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"message {i} is a {type(message).__name__}, not a dict with 'role' and 'content'")
        out.append({k: v for k, v in message.items() if v is not None})
    out = _plain(out)
    aliased = []
    for message in out:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


# --------------------------------------------------------------------------- control tokens in message text
# Message text (contents, reasoning, names, tool declarations) is data, never markup: a
# control token's text typed into it (``<｜User｜>``, ``<|im_start|>``) must be tokenized as
# plain text, while the template's own markers (and bos/eos) stay control tokens. Before the
# render, every such occurrence in the data is preceded by a marker character; the template
# transforms the text as it likes (trim, split, tojson, ...) and the marker travels with it;
# after the render the markers are taken out and their offsets handed to the tokenizer
# (RenderedPrompt.literal_at). The prompt text is exactly what it was without markers.

# Printable (repr() keeps them as they are), not whitespace, rare; the first one that occurs
# neither in the data nor in the template is used.
_MARKERS = tuple(chr(c) for c in range(0x1D300, 0x1D357))  # Tai Xuan Jing symbols


def _trie_regex(words: Iterable[str]) -> str:
    """One regex matching any of ``words``, longest first, in time of the word length (a trie)."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body

    return build(trie)


@lru_cache(maxsize=8)
def _token_pattern(tokens: tuple[str, ...]) -> re.Pattern[str] | None:
    words = [t for t in tokens if t]
    return re.compile(_trie_regex(words)) if words else None


def _strings(value: Any) -> Iterator[str]:
    """Every string inside plain data (dict keys and values, list and tuple items)."""
    stack: list[Iterator[Any]] = [iter((value,))]
    while stack:
        obj = next(stack[-1], _END)
        if obj is _END:
            stack.pop()
        elif isinstance(obj, str):
            yield obj
        elif isinstance(obj, dict):
            stack.append(itertools.chain.from_iterable(obj.items()))
        elif isinstance(obj, (list, tuple)):
            stack.append(iter(obj))


def _protect(value: Any, pattern: re.Pattern[str], marker: str) -> Any:
    if isinstance(value, str):
        return pattern.sub(lambda m: marker + m.group(0), value)
    if isinstance(value, dict):
        return {_protect(k, pattern, marker): _protect(v, pattern, marker) for k, v in value.items()}
    if isinstance(value, list):
        return [_protect(v, pattern, marker) for v in value]
    if isinstance(value, tuple):
        return tuple(_protect(v, pattern, marker) for v in value)
    return value


def _unmark(text: str, marker: str | None) -> RenderedPrompt:
    if marker is None or marker not in text:
        return RenderedPrompt(text)
    parts = text.split(marker)
    offsets = list(itertools.accumulate(len(p) for p in parts[:-1]))
    return RenderedPrompt("".join(parts), tuple(sorted(set(offsets))))


@dataclasses.dataclass(frozen=True)
class RenderedPrompt:
    """A rendered prompt, and where its message text spells control tokens.

    text: the prompt, exactly what :func:`render_chat` returns.
    literal_at: offsets in ``text`` where the text of a control token comes from message data
        (messages or tools), not from the template: encode those as plain text, with
        ``GGUFTokenizer.encode(text, literal_at=...)``. Empty for almost every chat.
    """

    text: str
    literal_at: tuple[int, ...] = ()


# --------------------------------------------------------------------------- public entry


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    enable_thinking: bool | None = None,
    fallback: str | None = None,
    template_source: str | None = None,
    template_limits: TemplateLimits | None = None,
    should_stop: Callable[[], bool] | None = None,
    **extra: Any,
) -> str:
    """Render ``messages`` into the prompt text the model expects.

    ``template`` is the GGUF ``tokenizer.chat_template`` (a Jinja template), rendered
    like ``transformers``' ``apply_chat_template(..., tokenize=False)``. ``bos_token``
    / ``eos_token`` are passed to the template as the tokenizer's special tokens.
    ``enable_thinking`` (when not None) is passed both as ``enable_thinking`` and as
    ``thinking`` (DeepSeek and Kimi templates read the latter); ``extra`` keys are
    passed through unchanged and win over both.

    When ``template`` is None or blank, the built-in format named by ``fallback``
    (one of :data:`BUILTIN_FORMATS`) is used. Raises :class:`ChatTemplateError` for a
    broken or unsafe template, or input a format cannot express.

    The template runs under ``template_limits`` (default :class:`TemplateLimits`); past one
    it stops with :class:`TemplateLimitError`. Errors name the template by
    ``template_source`` (default ``"tokenizer.chat_template"``). ``should_stop`` is polled
    while the template renders; when it returns True the render ends with
    :class:`TemplateRenderCancelled`.
    """
    return render_prompt(
        template, messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token,
        tools=tools, enable_thinking=enable_thinking, fallback=fallback, template_source=template_source,
        template_limits=template_limits, should_stop=should_stop, **extra,
    ).text


def render_prompt(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    enable_thinking: bool | None = None,
    fallback: str | None = None,
    template_source: str | None = None,
    template_limits: TemplateLimits | None = None,
    should_stop: Callable[[], bool] | None = None,
    control_tokens: Collection[str] = (),
    **extra: Any,
) -> RenderedPrompt:
    """:func:`render_chat`, plus where message text spells one of ``control_tokens``.

    ``control_tokens``: the texts the tokenizer reads as control tokens when special parsing
    is on (``GGUFTokenizer.special_token_texts``). Occurrences that come from message data
    are listed in :attr:`RenderedPrompt.literal_at`; the template's markup and bos/eos never are.
    """
    source = template_source or "tokenizer.chat_template"
    limits = template_limits or TemplateLimits()
    use_builtin = template is None or not template.strip()
    if use_builtin and fallback is None:
        raise ChatTemplateError(
            "the model file has no chat template and no built-in format was chosen; pass "
            f"fallback= one of {', '.join(BUILTIN_FORMATS)} (see builtin_format_for_vocab)"
        )
    if use_builtin and fallback not in BUILTIN_FORMATS:
        render_builtin(str(fallback), messages)  # raises: unknown format
    chat: Any = _prepare_messages(messages)
    if tools is not None and not use_builtin:
        for tool in tools:
            if not isinstance(tool, Mapping):
                raise ChatTemplateError(f"tools must be JSON-schema dicts, got a {type(tool).__name__}")
    plain_tools = _plain(list(tools)) if tools is not None else None

    kwargs: dict[str, Any] = {}
    if not use_builtin:
        if bos_token is not None:
            kwargs["bos_token"] = bos_token
        if eos_token is not None:
            kwargs["eos_token"] = eos_token
        if enable_thinking is not None:
            kwargs["enable_thinking"] = bool(enable_thinking)
            kwargs["thinking"] = bool(enable_thinking)
        kwargs.update(extra)
        for reserved in ("messages", "tools", "documents", "add_generation_prompt"):
            if reserved in kwargs:
                raise ChatTemplateError(
                    f"{reserved!r} is set by render_chat itself and cannot be passed as an extra variable")
        kwargs = _plain(kwargs)

    marker = None
    pattern = _token_pattern(tuple(control_tokens)) if control_tokens else None
    if pattern is not None and any(pattern.search(s) for s in _strings([chat, plain_tools])):
        others = [template or "", bos_token or "", eos_token or "", *_strings([kwargs, _plain(extra)])]
        marker = next((m for m in _MARKERS if not any(m in s for s in _strings([chat, plain_tools, others]))), None)
        if marker is None:
            raise ChatTemplateError("the conversation and the template use every character ExpertDesk could mark "
                                    "message text with; cannot tell message text from template markup")
        chat, plain_tools = _protect(chat, pattern, marker), _protect(plain_tools, pattern, marker)

    if use_builtin:
        assert fallback is not None
        text = render_builtin(
            fallback, chat, add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token,
            tools=plain_tools, enable_thinking=enable_thinking, **extra,
        )
        return _unmark(text, marker)

    assert template is not None
    variables = {"messages": chat, "tools": plain_tools, "documents": None,
                 "add_generation_prompt": bool(add_generation_prompt), **kwargs}
    size = sum(len(s) for s in _strings([chat, plain_tools, kwargs])) + limits.message_weight * len(chat)
    return _unmark(_render_template(template, source, variables, _Budget(limits, size, marker), should_stop), marker)


def _render_template(template: str, source: str, variables: dict[str, Any], budget: _Budget,
                     should_stop: Callable[[], bool] | None) -> str:
    label = f"the chat template ({source})"

    def work() -> str:
        compiled = _compile(template)
        pieces = []
        written = 0
        for piece in compiled.generate(**variables):
            written += len(piece)
            if written > budget.max_chars:
                raise _Stop("output", f"its output ran past the output limit of {budget.max_chars:,} characters")
            budget.tick()
            pieces.append(piece)
        return "".join(pieces)

    try:
        return _run_limited(work, budget, should_stop)
    except _Stop as stop:
        if stop.limit == "cancelled":
            raise TemplateRenderCancelled(f"rendering {label} was cancelled") from None
        raise TemplateLimitError(
            f"{label} was stopped: {stop.detail} ({stop.limit}). A chat template this costly is broken or "
            "hostile; it was not used (use a trusted template, or none to fall back to a built-in format)",
            source, stop.limit,
        ) from None
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"{label} has a Jinja syntax error at line {exc.lineno}: {exc.message}; "
            "the model file's template is broken (pass a fixed template, or none to use a built-in format)"
        ) from exc
    except SecurityError as exc:
        raise ChatTemplateError(
            f"{label} tried to reach Python internals and was stopped ({exc}); this template "
            "is unsafe or broken and was not run - use a trusted template or a built-in format"
        ) from exc
    except TemplateError as exc:
        if isinstance(exc, UndefinedError):
            raise ChatTemplateError(f"{label} failed on the given messages: {exc}") from exc
        raise ChatTemplateError(f"{label} refused the conversation: {exc}") from exc
    except RecursionError as exc:
        raise ChatTemplateError(f"{label} recursed too deeply and was stopped") from exc
    except Exception as exc:  # TypeError, KeyError, ... raised by template expressions
        detail = ", ".join(_short(arg, 500) for arg in exc.args)
        raise ChatTemplateError(f"{label} failed on the given messages ({type(exc).__name__}: {detail})") from exc


# --------------------------------------------------------------------------- built-in formats

BUILTIN_FORMATS: tuple[str, ...] = ("deepseek-v4", "kimi-k3", "kimi-k2")

_DS_BOS = "<｜begin▁of▁sentence｜>"
_DS_EOS = "<｜end▁of▁sentence｜>"
_DS_USER = "<｜User｜>"
_DS_ASSISTANT = "<｜Assistant｜>"
_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"

_K2_SYSTEM = "<|im_system|>"
_K2_USER = "<|im_user|>"
_K2_ASSISTANT = "<|im_assistant|>"
_K2_MIDDLE = "<|im_middle|>"
_K2_END = "<|im_end|>"
_K2_DEFAULT_SYSTEM = "You are a helpful assistant"

_K3_OPEN = "<|open|>"
_K3_SEP = "<|sep|>"
_K3_CLOSE = "<|close|>"
_K3_END_OF_MSG = "<|end_of_msg|>"
_K3_EFFORTS = ("low", "medium", "high", "max")


def builtin_format_for_vocab(tokens: Container[str]) -> str | None:
    """Name of the built-in format whose control tokens are all in ``tokens``, or None.

    ``tokens`` is any container of vocabulary entries (a set, or a ``GGUFTokenizer``). Kimi-K3
    is checked before Kimi-K2 because its vocabulary may keep the older ``<|im_*|>`` markers.
    """
    if all(t in tokens for t in (_DS_USER, _DS_ASSISTANT, _DS_EOS)):
        return "deepseek-v4"
    if all(t in tokens for t in (_K3_OPEN, _K3_SEP, _K3_CLOSE, _K3_END_OF_MSG)):
        return "kimi-k3"
    if all(t in tokens for t in (_K2_USER, _K2_ASSISTANT, _K2_MIDDLE, _K2_END)):
        return "kimi-k2"
    return None


def message_text(content: Any, where: str = "the message") -> str:
    """One chat message's ``content`` as text, in the shapes the OpenAI API allows: a
    string as is, None as "", or a list of ``{"type": "text", "text": ...}`` parts joined.

    ``where`` names the message in errors ("message 2", "messages[2].content"). Raises
    :class:`ChatTemplateError` for other parts (images, audio) or another type. The chat
    formats and the OpenAI-compatible server both read content through this function.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ChatTemplateError(
                    f"{where} has a {kind!r} content part; only text parts are supported "
                    '({"type": "text", "text": ...})'
                )
        return "".join(parts)
    raise ChatTemplateError(
        f"{where}: content is a {type(content).__name__}; expected a string or a list of text parts")


def _text_content(fmt: str, index: int, content: Any) -> str:
    return message_text(content, f"message {index} (built-in {fmt} format)")


def _reject_unsupported(fmt: str, messages: list[dict], tools: Any, extra: Mapping[str, Any],
                        allowed_extra: Iterable[str]) -> None:
    if tools:
        raise ChatTemplateError(
            f"the built-in {fmt} format does not render tool declarations; tool use needs the model "
            "file's own chat template"
        )
    unknown = set(extra) - set(allowed_extra)
    if unknown:
        raise ChatTemplateError(f"the built-in {fmt} format does not take {', '.join(sorted(unknown))}")
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            raise ChatTemplateError(f"message {i} has tool_calls; the built-in {fmt} format does not render tool calls")


def render_builtin(
    fmt: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    enable_thinking: bool | None = None,
    **extra: Any,
) -> str:
    """Render with a built-in format (see :data:`BUILTIN_FORMATS`); no tools or images."""
    if fmt not in BUILTIN_FORMATS:
        raise ChatTemplateError(f"unknown built-in chat format {fmt!r}; available: {', '.join(BUILTIN_FORMATS)}")
    chat = _prepare_messages(messages)
    if fmt == "deepseek-v4":  # renders tools and tool calls in DeepSeek-V4's own DSML (engine.text.tool_calls)
        _reject_unsupported(fmt, [], None, extra, ())
        try:
            return _render_deepseek_v4(chat, add_generation_prompt, bool(enable_thinking),
                                       bos_token or _DS_BOS, eos_token or _DS_EOS, tools)
        except ToolFormatError as exc:
            raise ChatTemplateError(str(exc)) from None
    if fmt == "kimi-k3":
        _reject_unsupported(fmt, chat, tools, extra, ("thinking_effort",))
        thinking = True if enable_thinking is None else bool(enable_thinking)
        effort = extra.get("thinking_effort", "max")
        if thinking and effort is not None and effort not in _K3_EFFORTS:
            raise ChatTemplateError(f"thinking_effort={effort!r} is not supported; use one of {', '.join(_K3_EFFORTS)}")
        return _render_kimi_k3(chat, add_generation_prompt, thinking, effort)
    _reject_unsupported(fmt, chat, tools, extra, ())
    if enable_thinking:
        raise ChatTemplateError(
            "the Kimi-K2 (Instruct) format has no reasoning channel; use enable_thinking=False/None")
    return _render_kimi_k2(chat, add_generation_prompt)


def _render_deepseek_v4(chat: list[dict], add_generation_prompt: bool, thinking: bool, bos: str, eos: str,
                        tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    # Layout of encoding_dsv4.encode_messages (drop_thinking=True, no context):
    #   BOS, system text as is, "<｜User｜>"+text, then after a user turn that is followed by
    #   an assistant turn (or ends the chat) "<｜Assistant｜>" + "<think>" (thinking mode,
    #   last user turn) or "</think>"; an assistant turn is [reasoning "</think>"] text EOS,
    #   with reasoning kept only after the last user turn. Tool results are user turns
    #   made of <tool_result> blocks. With tools, the "## Tools" section ends the system
    #   prompt, earlier calls follow their message's text, and reasoning is never dropped.
    keep_thinking = bool(tools)
    if tools:
        section = render_tools(tools)
        if chat and chat[0].get("role") == "system":
            chat = [{**chat[0], "content": _text_content("deepseek-v4", 0, chat[0].get("content")) + "\n\n" + section},
                    *chat[1:]]
        else:
            chat = [{"role": "system", "content": "\n\n" + section}, *chat]
    merged: list[dict] = []
    for i, m in enumerate(chat):
        role = m.get("role")
        if role == "tool":
            block = "<tool_result>" + _text_content("deepseek-v4", i, m.get("content")) + "</tool_result>"
            if merged and merged[-1]["role"] == "user" and merged[-1].get("_blocks") is not None:
                merged[-1]["_blocks"].append(block)
            else:
                merged.append({"role": "user", "_blocks": [block]})
        elif role == "user":
            text = _text_content("deepseek-v4", i, m.get("content"))
            if merged and merged[-1]["role"] == "user" and merged[-1].get("_blocks") is not None:
                merged[-1]["_blocks"].append(text)
            else:
                merged.append({"role": "user", "_blocks": [text]})
        elif role in ("system", "assistant"):
            merged.append({**m, "content": _text_content("deepseek-v4", i, m.get("content"))})
        else:
            raise ChatTemplateError(
                f"message {i} has role {role!r}; the built-in deepseek-v4 format knows system, user, assistant and tool"
            )
    last_user = max((i for i, m in enumerate(merged) if m["role"] == "user"), default=-1)

    out = [bos]
    for i, m in enumerate(merged):
        role = m["role"]
        if role == "system":
            out.append(m["content"])
        elif role == "user":
            out.append(_DS_USER + "\n\n".join(m["_blocks"]))
        else:  # assistant
            if thinking and (i > last_user or keep_thinking):
                out.append((m.get("reasoning_content") or "") + _THINK_CLOSE)
            out.append(m["content"] + (encode_tool_calls(m["tool_calls"]) if m.get("tool_calls") else "") + eos)
        nxt = merged[i + 1]["role"] if i + 1 < len(merged) else None
        if role == "user" and (nxt == "assistant" or (nxt is None and add_generation_prompt)):
            opens = thinking and (i >= last_user or keep_thinking)
            out.append(_DS_ASSISTANT + (_THINK_OPEN if opens else _THINK_CLOSE))
    return "".join(out)


def _k3_open(tag: str, attrs: Sequence[tuple[str, Any]] = ()) -> str:
    body = "".join(
        f' {key}="' + str(value).replace("&", "&amp;").replace('"', "&quot;") + '"' for key, value in attrs
    )
    return _K3_OPEN + tag + body + _K3_SEP


def _k3_close(tag: str) -> str:
    return _K3_CLOSE + tag + _K3_SEP


def _render_kimi_k3(chat: list[dict], add_generation_prompt: bool, thinking: bool, effort: str | None) -> str:
    # XTML layout of Kimi-K3.jinja: every message is <|open|>message role="..."<|sep|>
    # ... <|close|>message<|sep|><|end_of_msg|>; an assistant message holds a think
    # block (when thinking) and a response block; thinking mode announces the effort in
    # an internal system message first.
    out = []
    if thinking and effort in _K3_EFFORTS:
        body = (
            "`thinking_effort` guides on how much to think in your thinking channel (not including the "
            "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
            f"Now the system is invoked with `thinking_effort={effort}`."
        )
        out.append(_k3_open("message", [("role", "system"), ("type", "thinking-effort")]) + body.strip())
        out.append(_k3_close("message") + _K3_END_OF_MSG)
    for i, m in enumerate(chat):
        role = m.get("role")
        attrs: list[tuple[str, Any]] = [("role", role)]
        if m.get("name"):
            attrs.append(("name", m["name"]))
        if role in ("user", "system"):
            out.append(_k3_open("message", attrs) + _text_content("kimi-k3", i, m.get("content")))
        elif role == "assistant":
            out.append(_k3_open("message", attrs))
            if thinking:
                reasoning = m.get("reasoning_content") or m.get("reasoning")
                out.append(_k3_open("think"))
                if reasoning is not None and str(reasoning).strip():
                    out.append(str(reasoning))
                out.append(_k3_close("think"))
            out.append(_k3_open("response") + _text_content("kimi-k3", i, m.get("content")) + _k3_close("response"))
        else:
            raise ChatTemplateError(
                f"message {i} has role {role!r}; the built-in kimi-k3 format renders system, user and assistant "
                "(tool results need the model file's own template)"
            )
        out.append(_k3_close("message") + _K3_END_OF_MSG)
    if add_generation_prompt:
        out.append(_k3_open("message", [("role", "assistant")]) + _k3_open("think" if thinking else "response"))
    return "".join(out)


def _render_kimi_k2(chat: list[dict], add_generation_prompt: bool) -> str:
    # Kimi-K2-Instruct: default system turn when the chat does not start with one,
    # "<|im_X|>role<|im_middle|>content<|im_end|>" per message, tool results under im_system.
    markers = {"system": _K2_SYSTEM, "user": _K2_USER, "assistant": _K2_ASSISTANT, "tool": _K2_SYSTEM}
    out = []
    if chat[0].get("role") != "system":
        out.append(f"{_K2_SYSTEM}system{_K2_MIDDLE}{_K2_DEFAULT_SYSTEM}{_K2_END}")
    for i, m in enumerate(chat):
        role = m.get("role")
        if role not in markers:
            raise ChatTemplateError(
                f"message {i} has role {role!r}; the built-in kimi-k2 format knows {', '.join(markers)}")
        out.append(f"{markers[role]}{role}{_K2_MIDDLE}{_text_content('kimi-k2', i, m.get('content'))}{_K2_END}")
    if add_generation_prompt:
        out.append(f"{_K2_ASSISTANT}assistant{_K2_MIDDLE}")
    return "".join(out)


# --------------------------------------------------------------------------- reasoning split


@dataclasses.dataclass(frozen=True)
class ReasoningDelta:
    """Text newly assigned to the reasoning channel and to the answer channel."""

    reasoning: str = ""
    answer: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.answer)


class ReasoningSplitter:
    """Streams model output into reasoning and answer text, tag by tag.

    ``open_tag``/``close_tag`` delimit reasoning (``<think>``/``</think>`` by default).
    Use ``start_in_reasoning=True`` when the prompt already opened the block (DeepSeek
    thinking mode ends the prompt with ``<think>``). Otherwise an ``open_tag`` counts
    only at the very start of the output (after optional whitespace), so an answer that
    merely mentions the tag is not swallowed. ``answer_drop`` lists markup removed from
    the answer (Kimi-K3's response block tags). Tags split across deltas are handled:
    text that could be the start of a tag is held back until it is decided.
    """

    def __init__(
        self,
        *,
        start_in_reasoning: bool = False,
        open_tag: str = _THINK_OPEN,
        close_tag: str = _THINK_CLOSE,
        answer_drop: Sequence[str] = (),
    ) -> None:
        if not open_tag or not close_tag:
            raise ValueError("open_tag and close_tag must be non-empty strings")
        self._open = open_tag
        self._close = close_tag
        self._drop = tuple(d for d in answer_drop if d)
        self._state = "reasoning" if start_in_reasoning else "start"
        self._buf = ""

    @property
    def in_reasoning(self) -> bool:
        """True while the output is inside the reasoning block."""
        return self._state == "reasoning"

    def feed(self, delta: str) -> ReasoningDelta:
        """Add a chunk of model output; returns what can be assigned so far."""
        self._buf += delta
        reasoning: list[str] = []
        answer: list[str] = []
        while True:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(self._open):
                    self._buf = stripped[len(self._open) :]
                    self._state = "reasoning"
                    continue
                if stripped == "" or self._open.startswith(stripped):
                    break  # still undecided: wait for more text
                self._state = "answer"
                continue
            if self._state == "reasoning":
                at = self._buf.find(self._close)
                if at >= 0:
                    reasoning.append(self._buf[:at])
                    self._buf = self._buf[at + len(self._close) :]
                    self._state = "answer"
                    continue
                keep = _partial_suffix(self._buf, (self._close,))
                reasoning.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            # answer
            if self._drop:
                hits = [(self._buf.find(d), d) for d in self._drop]
                hits = [(at, d) for at, d in hits if at >= 0]
                if hits:
                    at, d = min(hits)
                    answer.append(self._buf[:at])
                    self._buf = self._buf[at + len(d) :]
                    continue
                keep = _partial_suffix(self._buf, self._drop)
            else:
                keep = 0
            answer.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            break
        return ReasoningDelta("".join(reasoning), "".join(answer))

    def flush(self) -> ReasoningDelta:
        """End of output: held-back text goes to the channel it was in."""
        rest, self._buf = self._buf, ""
        if self._state == "reasoning":
            return ReasoningDelta(reasoning=rest)
        return ReasoningDelta(answer=rest)


def _partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def split_reasoning(text: str, **kwargs: Any) -> tuple[str, str]:
    """Split a complete output into ``(reasoning, answer)``; same options as :class:`ReasoningSplitter`."""
    splitter = ReasoningSplitter(**kwargs)
    a = splitter.feed(text)
    b = splitter.flush()
    return a.reasoning + b.reasoning, a.answer + b.answer


def reasoning_splitter_for(fmt: str, *, thinking: bool) -> ReasoningSplitter:
    """Splitter matching a built-in format's generation prompt.

    ``deepseek-v4``: thinking prompts end with ``<think>`` so output starts in the
    reasoning block. ``kimi-k3``: thinking prompts end inside the think block; the
    response block's tags are removed from the answer (decode with control tokens
    kept so the tags are visible). ``kimi-k2``: no prompt-opened block.
    """
    if fmt == "deepseek-v4":
        return ReasoningSplitter(start_in_reasoning=thinking)
    if fmt == "kimi-k3":
        return ReasoningSplitter(
            start_in_reasoning=thinking,
            open_tag=_k3_open("think"),
            close_tag=_k3_close("think"),
            answer_drop=(_k3_open("response"), _k3_close("response"), _k3_close("message"), _K3_END_OF_MSG),
        )
    if fmt == "kimi-k2":
        return ReasoningSplitter(start_in_reasoning=False)
    raise ValueError(f"unknown built-in chat format {fmt!r}; available: {', '.join(BUILTIN_FORMATS)}")
