"""The errors the expert runtime raises. Each message says what happened, why, and what to do."""

from __future__ import annotations


class RuntimeStartError(RuntimeError):
    """The expert runtime refuses to start: a setting, the pack or the machine does not fit.

    Raised at start-up only, never mid-generation, so a misconfiguration is caught
    before the first token instead of as a slow or wrong answer later.
    """


class DirectIOUnsupportedError(RuntimeStartError):
    """The pack's filesystem (or the operating system) cannot do O_DIRECT reads, and
    direct I/O was asked for. Reading through the page cache (`direct_io=False`) works there."""


class ExpertReadError(RuntimeError):
    """An expert could not be read from the pack (I/O error, short read, vanished drive,
    checksum mismatch). The runtime never hands out weights it could not read in full.

    `block`/`layer_index`/`expert` name the expert; `cause` is the underlying exception.
    """

    def __init__(self, message: str, *, block: int | None = None, layer_index: int | None = None,
                 expert: int | None = None, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.block = block
        self.layer_index = layer_index
        self.expert = expert
        self.cause = cause


class CacheCapacityError(RuntimeError):
    """One acquire asked for more distinct experts than the free (unprotected) slots.

    `max_experts` is how many it could have delivered at that moment. Callers with
    larger requests (prefill chunks) use `ExpertCache.acquire_chunks`, which splits
    the request into batches that fit.
    """

    def __init__(self, message: str, *, requested: int, max_experts: int) -> None:
        super().__init__(message)
        self.requested = requested
        self.max_experts = max_experts
