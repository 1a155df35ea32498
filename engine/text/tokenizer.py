"""Byte-level BPE tokenizer built from GGUF metadata, plus a streaming UTF-8 safe decoder.

The vocabulary, merges and token types come from a GGUF file's ``tokenizer.ggml.*``
keys; the splitting rules (the "pre-tokenizer") come from ``tokenizer.ggml.pre`` and
are looked up in a fixed table taken from llama.cpp (``src/llama-vocab.cpp``,
``llm_tokenizer_bpe``), cross-checked against the models' own Hugging Face
``tokenizer.json`` / ``tokenization_kimi.py``. A name that is not in the table is
refused: a wrong split silently changes every prompt's token ids, which degrades the
model without any visible error.

Encoding runs on the Hugging Face ``tokenizers`` library (Rust), so it is fast and
matches the reference tokenizers bit for bit. Decoding is done here, token by token,
with llama.cpp's rules (normal tokens are byte-level decoded, control and
user-defined tokens are their literal text), because a stream of tokens must be
turned into text one token at a time without ever cutting a UTF-8 character.
"""

from __future__ import annotations

import codecs
import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

log = logging.getLogger(__name__)

__all__ = [
    "GGUFTokenizer",
    "StreamDecoder",
    "TokenizerError",
    "TokenType",
    "SUPPORTED_PRE_TOKENIZERS",
    "KIMI_K2_PATTERN_ORIGINAL",
    "KIMI_K2_PATTERN",
    "DEEPSEEK_V3_SPLITS",
]


class TokenizerError(ValueError):
    """The GGUF tokenizer metadata cannot be used (missing, malformed or unsupported)."""


class TokenType:
    """GGUF ``tokenizer.ggml.token_type`` values (gguf ``TokenType`` / llama.cpp ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# --------------------------------------------------------------------------- split rules
#
# DeepSeek-V3 (and V3.1/V3.2/V4, which keep the same tokenizer): llama.cpp
# LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM in src/llama-vocab.cpp. The model's tokenizer.json
# (deepseek-ai/DeepSeek-V3) has the same three patterns as a pre_tokenizer
# Sequence of Split(pattern, behavior="Isolated", invert=false) followed by
# ByteLevel(add_prefix_space=false, trim_offsets=true, use_regex=false), with an empty
# normalizer. The CJK class is literally U+4E00-U+9FA5, U+3040-U+309F, U+30A0-U+30FF.
DEEPSEEK_V3_SPLITS: tuple[str, ...] = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
    "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*"
    "|\\s*[\r\n]+"
    "|\\s+(?!\\S)"
    "|\\s+",
)

# Kimi-K2 / K3: tiktoken pattern (``pat_str``) of moonshotai's tokenization_kimi.py.
# llama.cpp (LLAMA_VOCAB_PRE_TYPE_KIMI_K2) only registers the trigger "\p{Han}+" and
# implements the rest by hand in unicode.cpp (unicode_regex_split_custom_kimi_k2);
# that hand-written version is known to differ from Moonshot's pattern on camelCase
# words ("getUserName" is one piece there, three in tiktoken), so the authority here
# is Moonshot's own pattern, run by the same kind of regex engine.
KIMI_K2_PATTERN_ORIGINAL = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# The pattern above uses class intersection (``[A&&[^B]]``, "A but not B"), which
# tiktoken's engine (fancy-regex over Rust regex) supports but many engines do not
# (Python ``re``; Python ``regex`` only in V1 mode; ``&&`` is a literal in others).
# We rewrite each intersection as a one-character lookahead guard,
#     [A&&[^\p{Han}]]   ->   (?:(?!\p{Han})[A])
# which matches exactly the same single characters (a character of A that is not Han)
# and keeps every quantifier applied to one character at a time, so greedy matching and
# backtracking behave as before. Oniguruma (the engine behind ``tokenizers``) compiles
# it; the tests compare the split against Python ``regex`` in V1 mode running the
# original pattern on mixed Han/Latin/kana/digit text.
_KIMI_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_KIMI_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
KIMI_K2_PATTERN = KIMI_K2_PATTERN_ORIGINAL.replace(
    _KIMI_UPPER, r"(?:(?!\p{Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])"
).replace(_KIMI_LOWER, r"(?:(?!\p{Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])")
assert "&&" not in KIMI_K2_PATTERN

# GPT-2 (openai/gpt-2 encoder.py; HF ByteLevel's built-in regex) and Llama 3
# (llama.cpp LLAMA_VOCAB_PRE_TYPE_LLAMA3, "original regex from tokenizer.json").
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizerRule:
    splits: tuple[str, ...]
    ignore_merges: bool = False  # llama.cpp: whole-word vocab hit wins over merges (llama3)
    add_bos_default: bool = False  # llama.cpp default before tokenizer.ggml.add_bos_token


_RULES: dict[str, _PreTokenizerRule] = {
    "deepseek-v3": _PreTokenizerRule(DEEPSEEK_V3_SPLITS),
    "kimi-k2": _PreTokenizerRule((KIMI_K2_PATTERN,)),
    "gpt-2": _PreTokenizerRule((_GPT2_PATTERN,)),
    "llama-bpe": _PreTokenizerRule((_LLAMA3_PATTERN,), ignore_merges=True, add_bos_default=True),
}

# Other names llama.cpp maps to the very same rule (same case label in llm_tokenizer_bpe).
_ALIASES: dict[str, str] = {
    # "joyai-llm" is a later-recorded checksum of the same DeepSeek-V3 tokenizer; newer
    # convert_hf_to_gguf.py runs write it for DeepSeek-V3-family files.
    "joyai-llm": "deepseek-v3",
    "llama3": "llama-bpe",
    "llama-v3": "llama-bpe",
}

SUPPORTED_PRE_TOKENIZERS: tuple[str, ...] = tuple(sorted([*_RULES, *_ALIASES]))

# End-of-generation tokens recognised by their text, as llama.cpp does in
# llama_vocab::impl::load ("maintain a list of tokens that cause end-of-generation").
# "<|end_of_msg|>" is added for Kimi-K3, whose chat template closes every message with it.
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",  # Kimi-K2
        "[EOS]",  # Kimi-K2
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<｜end▁of▁sentence｜>",  # DeepSeek
        "<|end_of_msg|>",  # Kimi-K3
    }
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _canonical_pre(name: str) -> str:
    return _ALIASES.get(name, name)


def _build_pre_tokenizer(rule: _PreTokenizerRule) -> pre_tokenizers.PreTokenizer:
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in rule.splits
    ]
    # The byte-level step only maps bytes to characters; the splitting is done above,
    # exactly like the models' tokenizer.json (use_regex=false).
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _as_str(value: Any, key: str) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, str):
        return value
    raise TokenizerError(f"GGUF key {key!r} should be a string but is {type(value).__name__}: {value!r:.80}")


def _as_list(value: Any, key: str) -> list:
    if value is None:
        raise TokenizerError(f"GGUF key {key!r} is missing; the file has no usable tokenizer")
    try:
        return list(value)
    except TypeError:
        raise TokenizerError(f"GGUF key {key!r} should be an array but is {type(value).__name__}") from None


def _opt_id(metadata: Mapping[str, Any], key: str, n_tokens: int) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    try:
        token_id = int(value)
    except (TypeError, ValueError):
        raise TokenizerError(f"GGUF key {key!r} should be a token id but is {value!r}") from None
    if not 0 <= token_id < n_tokens:
        # llama.cpp ignores an out-of-range special id with a warning; do the same
        # rather than refuse an otherwise good file.
        log.warning("%s = %d is outside the vocabulary (%d tokens); ignoring it", key, token_id, n_tokens)
        return None
    return token_id


class GGUFTokenizer:
    """Byte-level BPE tokenizer described by GGUF ``tokenizer.ggml.*`` metadata.

    Build it with :meth:`from_metadata`. Token ids, special-token handling and the
    text split match llama.cpp and the models' Hugging Face tokenizers.
    """

    # Set by from_metadata, the only constructor.
    _tokens: list[str]
    _types: list[int]
    _vocab: dict[str, int]
    pre: str
    pre_name: str
    chat_template: str | None
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    eos_ids: frozenset[int]
    _tok: Tokenizer
    _tok_plain: Tokenizer | None  # built on first encode(parse_special=False)
    _piece_cache: list[bytes | None]
    _special_ids: frozenset[int]  # control and unknown tokens: matched in text only with parse_special
    _special_texts: tuple[str, ...]

    def __init__(self) -> None:  # use from_metadata
        raise TypeError("use GGUFTokenizer.from_metadata(metadata) to build a tokenizer")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> GGUFTokenizer:
        """Build the tokenizer from GGUF key/values (plain python values).

        Raises :class:`TokenizerError` when the model is not byte-level BPE
        (``tokenizer.ggml.model`` must be ``"gpt2"``), when ``tokenizer.ggml.pre`` is
        missing or names a split rule this module does not implement, or when the
        vocabulary/merges are malformed.
        """
        model_name = metadata.get("tokenizer.ggml.model")
        if model_name is None:
            raise TokenizerError("GGUF key 'tokenizer.ggml.model' is missing; the file has no tokenizer")
        model_name = _as_str(model_name, "tokenizer.ggml.model")
        if model_name != "gpt2":
            raise TokenizerError(
                f"tokenizer.ggml.model is {model_name!r}, but only 'gpt2' (byte-level BPE, used by "
                "DeepSeek-V3/V4 and Kimi-K2/K3) is supported; this model's tokenizer cannot be loaded"
            )

        pre_raw = metadata.get("tokenizer.ggml.pre")
        if pre_raw is None:
            raise TokenizerError(
                "GGUF key 'tokenizer.ggml.pre' is missing, so the text-splitting rule of this model is "
                f"unknown; supported values are {', '.join(SUPPORTED_PRE_TOKENIZERS)}. Re-convert the "
                "model with a current convert_hf_to_gguf.py (a guessed rule would silently change token ids)"
            )
        pre = _as_str(pre_raw, "tokenizer.ggml.pre")
        canonical = _canonical_pre(pre)
        if canonical not in _RULES:
            raise TokenizerError(
                f"tokenizer.ggml.pre is {pre!r}, a text-splitting rule ExpertDesk does not implement; "
                f"supported values are {', '.join(SUPPORTED_PRE_TOKENIZERS)}. The tokenizer is refused "
                "rather than guessed, because a wrong rule silently changes every token id"
            )
        rule = _RULES[canonical]

        tokens = [
            _as_str(t, "tokenizer.ggml.tokens")
            for t in _as_list(metadata.get("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens")
        ]
        n = len(tokens)
        if n == 0:
            raise TokenizerError("GGUF key 'tokenizer.ggml.tokens' is empty; the file has no vocabulary")
        for i, t in enumerate(tokens):
            if t == "":  # llama.cpp renames empty entries so the vocabulary stays a bijection
                tokens[i] = f"[EMPTY_{i}]"

        raw_types = metadata.get("tokenizer.ggml.token_type")
        if raw_types is None:
            types = [TokenType.NORMAL] * n
        else:
            types = [int(t) for t in _as_list(raw_types, "tokenizer.ggml.token_type")]
            if len(types) < n:
                raise TokenizerError(
                    f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens; the file is corrupt"
                )
            types = types[:n]

        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if t in vocab:
                raise TokenizerError(
                    f"duplicate token in vocabulary: {t!r} has ids {vocab[t]} and {i}; the file is corrupt"
                )
            vocab[t] = i

        merges: list[tuple[str, str]] = []
        for rank, m in enumerate(_as_list(metadata.get("tokenizer.ggml.merges"), "tokenizer.ggml.merges")):
            m = _as_str(m, "tokenizer.ggml.merges")
            sep = m.find(" ", 1)  # llama.cpp: first space after position 0
            if sep < 0:
                raise TokenizerError(f"tokenizer.ggml.merges[{rank}] = {m!r} is not of the form 'left right'")
            left, right = m[:sep], m[sep + 1 :]
            if left not in vocab or right not in vocab or left + right not in vocab:
                raise TokenizerError(
                    f"tokenizer.ggml.merges[{rank}] = {m!r} uses a token that is not in the vocabulary; "
                    "the vocabulary and merges do not belong together"
                )
            merges.append((left, right))

        self = object.__new__(cls)
        self._tokens = tokens
        self._types = types
        self._vocab = vocab
        self.pre = canonical
        self.pre_name = pre
        self.chat_template = (
            _as_str(metadata["tokenizer.chat_template"], "tokenizer.chat_template")
            if metadata.get("tokenizer.chat_template")
            else None
        )

        self.bos_id = _opt_id(metadata, "tokenizer.ggml.bos_token_id", n)
        self.eos_id = _opt_id(metadata, "tokenizer.ggml.eos_token_id", n)
        self.eot_id = _opt_id(metadata, "tokenizer.ggml.eot_token_id", n)
        self.eom_id = _opt_id(metadata, "tokenizer.ggml.eom_token_id", n)
        self.pad_id = _opt_id(metadata, "tokenizer.ggml.padding_token_id", n)

        add_bos = metadata.get("tokenizer.ggml.add_bos_token")
        add_eos = metadata.get("tokenizer.ggml.add_eos_token")
        self.add_bos = rule.add_bos_default if add_bos is None else bool(add_bos)
        self.add_eos = False if add_eos is None else bool(add_eos)
        if self.add_bos and self.bos_id is None:
            log.warning("tokenizer.ggml.add_bos_token is set but there is no BOS id; not adding BOS")
            self.add_bos = False
        if self.add_eos and self.eos_id is None:
            log.warning("tokenizer.ggml.add_eos_token is set but there is no EOS id; not adding EOS")
            self.add_eos = False

        # End-of-generation set, llama.cpp style: the declared ids plus well-known
        # end-of-turn texts (converters often leave eot_token_id unset). Such tokens
        # are treated as control tokens even if the file typed them otherwise.
        eos_ids = {i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None}
        for text in _EOG_TEXTS:
            token_id = vocab.get(text)
            if token_id is not None:
                eos_ids.add(token_id)
                if types[token_id] not in (TokenType.CONTROL, TokenType.USER_DEFINED):
                    types[token_id] = TokenType.CONTROL
        self.eos_ids = frozenset(eos_ids)

        try:
            bpe = models.BPE(
                vocab=vocab,
                merges=merges,
                unk_token=None,
                fuse_unk=False,
                byte_fallback=False,
                ignore_merges=rule.ignore_merges,
            )
        except Exception as exc:  # the Rust side reports inconsistent vocab/merges
            raise TokenizerError(f"cannot build the BPE model from the GGUF vocabulary: {exc}") from exc
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = _build_pre_tokenizer(rule)
        tok.decoder = decoders.ByteLevel()

        # Control/unknown tokens are matched whole in the text only when special
        # parsing is on; user-defined tokens (e.g. DeepSeek's <think>) always are.
        # Same rule as llama.cpp's tokenizer_st_partition.
        special, user = [], []
        for i, ty in enumerate(types):
            if ty in (TokenType.CONTROL, TokenType.UNKNOWN):
                special.append(AddedToken(tokens[i], special=True, normalized=False, lstrip=False, rstrip=False))
            elif ty == TokenType.USER_DEFINED:
                user.append(AddedToken(tokens[i], special=False, normalized=False, lstrip=False, rstrip=False))
        if user:
            tok.add_tokens(user)
        if special:
            tok.add_special_tokens(special)
        self._tok = tok
        self._tok_plain = None
        self._piece_cache = [None] * n
        self._special_ids = frozenset(i for i, ty in enumerate(types) if ty in (TokenType.CONTROL, TokenType.UNKNOWN))
        self._special_texts = tuple(tokens[i] for i in sorted(self._special_ids))
        return self

    # ------------------------------------------------------------------ properties
    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocabulary (the model's logits width may be padded beyond it)."""
        return len(self._tokens)

    def token_type(self, token_id: int) -> int:
        """GGUF token type of ``token_id`` (see :class:`TokenType`)."""
        return self._types[self._check_id(token_id)]

    def is_control(self, token_id: int) -> bool:
        """True for control/unknown/unused tokens (the ones ``skip_special`` hides)."""
        return self.token_type(token_id) in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.UNUSED)

    def token_text(self, token_id: int) -> str:
        """The raw vocabulary entry (byte-level encoded for normal tokens)."""
        return self._tokens[self._check_id(token_id)]

    def __contains__(self, text: object) -> bool:
        """True if ``text`` is a vocabulary entry (lets ``builtin_format_for_vocab(tokenizer)`` work)."""
        return text in self._vocab

    def token_to_id(self, text: str) -> int | None:
        """Id of the vocabulary entry ``text`` (e.g. ``"<think>"``), or None if absent."""
        return self._vocab.get(text)

    # ------------------------------------------------------------------ encode/decode
    @property
    def special_token_texts(self) -> tuple[str, ...]:
        """Texts of the tokens ``parse_special`` reads as one id (control and unknown tokens).

        ``render_prompt(control_tokens=...)`` takes them to find where message text spells one.
        """
        return self._special_texts

    def encode(self, text: str, *, add_special: bool = False, parse_special: bool = True,
               literal_at: Collection[int] = ()) -> list[int]:
        """Token ids for ``text``.

        ``add_special`` adds BOS/EOS as the GGUF file asks (``add_bos_token`` /
        ``add_eos_token``). With ``parse_special`` control tokens written in the text
        (``<｜User｜>``, ``<|im_end|>``) become their single id; without it they are
        tokenized as plain characters (use that for untrusted user text).

        ``literal_at`` (with ``parse_special``): offsets in ``text`` where a control token's
        text is message data, not template markup (``RenderedPrompt.literal_at``). A control
        token starting there is tokenized as plain characters, together with the text around
        it up to the neighbouring real control tokens, as ``parse_special=False`` would; all
        others stay single ids. Without such a token the ids are those of ``parse_special``.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        if parse_special and literal_at:
            ids = self._encode_with_literals(text, literal_at)
        else:
            tok = self._tok if parse_special else self._plain_tokenizer()
            ids = list(tok.encode(text, add_special_tokens=False).ids)
        if add_special:
            if self.add_bos:
                ids.insert(0, self.bos_id)  # type: ignore[arg-type]
            if self.add_eos:
                ids.append(self.eos_id)  # type: ignore[arg-type]
        return ids

    def _encode_with_literals(self, text: str, literal_at: Collection[int]) -> list[int]:
        # The tokenizer splits the text at special tokens first and encodes the pieces between
        # them independently; so: find its special tokens, keep those that are markup as cuts,
        # and encode the text between two cuts (literal control tokens included) as plain text.
        encoding = self._tok.encode(text, add_special_tokens=False)
        literal = set(literal_at)
        cuts: list[tuple[int, int, int]] = []  # (start, end, id) of the control tokens that are markup
        found = False
        for token_id, (start, _) in zip(encoding.ids, encoding.offsets):
            if token_id in self._special_ids and text.startswith(self._tokens[token_id], start):
                if start in literal:
                    found = True
                else:
                    cuts.append((start, start + len(self._tokens[token_id]), token_id))
        if not found:
            return list(encoding.ids)
        plain = self._plain_tokenizer()
        ids: list[int] = []
        at = 0
        for start, end, token_id in cuts:
            if start > at:
                ids.extend(plain.encode(text[at:start], add_special_tokens=False).ids)
            ids.append(token_id)
            at = end
        if at < len(text):
            ids.extend(plain.encode(text[at:], add_special_tokens=False).ids)
        return ids

    def _plain_tokenizer(self) -> Tokenizer:
        if self._tok_plain is None:
            plain = Tokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True  # special added tokens are split like text
            self._tok_plain = plain
        return self._tok_plain

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes token ``token_id`` stands for (may be part of a UTF-8 character)."""
        token_id = self._check_id(token_id)
        piece = self._piece_cache[token_id]
        if piece is None:
            text = self._tokens[token_id]
            ty = self._types[token_id]
            if ty in (TokenType.NORMAL, TokenType.UNDEFINED, TokenType.BYTE):
                try:
                    piece = bytes(_CHAR_TO_BYTE[c] for c in text)
                except KeyError:
                    # Not a byte-level entry; the HF ByteLevel decoder falls back to the
                    # raw UTF-8 of such a token, so do the same.
                    piece = text.encode("utf-8")
            else:  # control / user-defined / unknown / unused: literal text
                piece = text.encode("utf-8")
            self._piece_cache[token_id] = piece
        return piece

    def token_to_piece(self, token_id: int) -> str:
        """Text of one token; bytes of an incomplete UTF-8 character show as U+FFFD.

        Use :class:`StreamDecoder` to turn a stream of tokens into text.
        """
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text for ``ids``; ``skip_special`` leaves out control tokens (BOS, EOS, role markers)."""
        data = b"".join(self.token_bytes(i) for i in ids if not (skip_special and self.is_control(i)))
        return data.decode("utf-8", errors="replace")

    def _check_id(self, token_id: int) -> int:
        if type(token_id) is not int:
            token_id = int(token_id)  # numpy / torch integers
        if not 0 <= token_id < len(self._tokens):
            raise TokenizerError(
                f"token id {token_id} is outside the vocabulary (0..{len(self._tokens) - 1}); "
                "the model produced an id this tokenizer does not know (padded logits?)"
            )
        return token_id

    def __repr__(self) -> str:
        return (f"GGUFTokenizer(pre={self.pre!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, "
                f"eos={sorted(self.eos_ids)})")


class StreamDecoder:
    """Turns generated token ids into text deltas that are always complete UTF-8 text.

    A character split over several byte tokens (emoji, CJK) is held back until its
    last byte arrives; bytes that can never form a character become U+FFFD, so every
    delta can be shown or encoded as is.
    """

    def __init__(self, tokenizer: GGUFTokenizer, *, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Add one token; returns the newly complete text (possibly empty)."""
        if self._skip_special and self._tokenizer.is_control(token_id):
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def feed_many(self, ids: Sequence[int]) -> str:
        """Add several tokens; returns the newly complete text."""
        return "".join(self.feed(i) for i in ids)

    def flush(self) -> str:
        """End of stream: returns held-back bytes of an unfinished character as U+FFFD."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out

    @property
    def pending_bytes(self) -> int:
        """Number of bytes held back waiting for the rest of a character."""
        return len(self._utf8.getstate()[0])
