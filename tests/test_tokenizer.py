"""GGUFTokenizer against reference tokenizers on a small but real byte-level BPE vocabulary.

A vocabulary is trained with the ``tokenizers`` BpeTrainer, written out as GGUF
``tokenizer.ggml.*`` metadata and loaded with ``GGUFTokenizer.from_metadata``. The
references are independent of the code under test:

* DeepSeek-V3: a ``tokenizers.Tokenizer`` built from a tokenizer.json laid out like
  deepseek-ai/DeepSeek-V3's (empty normalizer, three Isolated Split regexes, ByteLevel
  without regex, BPE model, added tokens).
* Kimi-K2: Moonshot's tiktoken pattern (tokenization_kimi.py ``pat_str``, with its
  ``&&`` class intersections) run by the Python ``regex`` module in V1 mode, plus a
  plain-Python merge-rank BPE.
"""

from __future__ import annotations

import json

import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from engine.text import GGUFTokenizer, StreamDecoder, TokenizerError, builtin_format_for_vocab
from engine.text.tokenizer import KIMI_K2_PATTERN

# --------------------------------------------------------------------------- references

# deepseek-ai/DeepSeek-V3 tokenizer.json "pre_tokenizer" (as serialized there).
DEEPSEEK_V3_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": False},
        {"type": "Split", "pattern": {"Regex": "[一-龥぀-ゟ゠-ヿ]+"}, "behavior": "Isolated", "invert": False},
        {
            "type": "Split",
            "pattern": {
                "Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
                "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
                "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
            },
            "behavior": "Isolated",
            "invert": False,
        },
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ],
}

# moonshotai Kimi-K2 tokenization_kimi.py TikTokenTokenizer.pat_str (tiktoken / fancy-regex syntax).
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# V1 is the regex module's mode in which [A&&[^B]] is a set intersection, like tiktoken.
KIMI_REF_RE = regex.compile(KIMI_PAT_STR, flags=regex.V1)

DS_CONTROL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜tool▁sep｜>"]
DS_USER_DEFINED = ["<think>", "</think>"]
KIMI_CONTROL = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog. 1234567890 3.14159",
    "你好，世界！这是一个测试。我们正在测试中文分词。北京市和上海市都很大。",
    "日本語のテキストとカタカナ、ひらがな。東京タワーに行きました。",
    "emoji 😀👍🏽🎉 ok ❤️ 👨‍👩‍👧 smile 😀😀",
    "def f(x):\n    return x ** 2  # comment\n\tif x != 0:\n        pass\n",
    "   leading spaces\n\n\ntrailing   \r\n tabs\t\there    four",
    "Ünïcödé ßtraße ΑΒΓ αβγ Привет мир 한국어 텍스트",
    "getUserName iPhone helloWorld I'm they're we'LL it's XMLHttpRequest",
    '{"key": [1, 2, 3], "x": null}  <tag attr=\'v\'> a&&b || c',
    "混合English和中文123数字 中a中A中1中",
]

TEXTS = [
    "Hello world!",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\r\n\r\n",
    "multiple    spaces   between words",
    "你好，世界！北京市和上海市。",
    "日本語のテキスト、カタカナとひらがな。",
    "混合English和中文123数字",
    "中a中A中1中 中",
    "emoji 😀👍🏽🎉 ❤️ 👨‍👩‍👧 🦜",
    "def f(x):\n    return x ** 2  # comment\n",
    "if (a&&b) { c += 1; }",
    "1234567890 3.14159 1,000,000 0x1F",
    "I'm they're WE'LL it's",
    "getUserName iPhone helloWorld XMLHttpRequest",
    "Ünïcödé ßtraße ΑΒΓ αβγ Привет мир 한국어 텍스트",
    "e\u0301 a\u0308 ǅungla",
    "\u3000full-width\u3000space ＡＢＣ１２３",
    "",
    " ",
    "\n",
    "a\u00a0b\u2028c\x85d",
    "😀😀😀x",
    "   \n   \n\n  end",
]

# Characters for property tests: one or more of every kind the split rules tell apart.
POOL = list("aAzZ09 \t\n\r'sStTlLdDmMvVeErR.,;:!?-_()[]{}<>/\\\"&|#@$%^*+=~`") + [
    chr(c)
    for c in [
        0x4E00, 0x4E2D, 0x6587, 0x9FA5, 0x3400, 0x20000, 0x2E80, 0x3005, 0x3006, 0x3007, 0x3041, 0x306E, 0x30A2,
        0x30FC, 0x30FB, 0xAC00, 0xE9, 0xDF, 0x1C5, 0x2B0, 0x301, 0x308, 0x660, 0x2160, 0xBD, 0xB2, 0xA0, 0x3000,
        0x2028, 0x85, 0x200B, 0x1F600, 0x1F44D, 0x1F3FD, 0x200D, 0x2764, 0xFE0F, 0xFF21, 0xFF41, 0xFF10, 0x17F, 0x416,
    ]
]
pool_text = st.lists(st.sampled_from(POOL), max_size=24).map("".join)
PROPERTY = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table (openai/gpt-2 encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


B2U = bytes_to_unicode()


class ReferenceKimi:
    """tiktoken-style encoding: special tokens first, pat_str pieces, merge-rank BPE on bytes."""

    def __init__(self, tokens: list[str], merges: list[str], specials: list[str]) -> None:
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self.special_re = regex.compile("|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True)))

    def _bpe(self, piece: str) -> list[int]:
        syms = [B2U[b] for b in piece.encode("utf-8")]
        while len(syms) > 1:
            best = None
            for i in range(len(syms) - 1):
                r = self.ranks.get((syms[i], syms[i + 1]))
                if r is not None and (best is None or r < best[0]):
                    best = (r, i)
            if best is None:
                break
            i = best[1]
            syms[i : i + 2] = [syms[i] + syms[i + 1]]
        return [self.vocab[s] for s in syms]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        for m in list(self.special_re.finditer(text)) + [None]:
            end = m.start() if m else len(text)
            for piece in KIMI_REF_RE.findall(text[pos:end]):
                ids.extend(self._bpe(piece))
            if m:
                ids.append(self.vocab[m.group()])
                pos = m.end()
        return ids


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def trained() -> dict:
    """A byte-level BPE vocabulary: base tokens + merges.

    Trained on whole lines (byte-level mapping only, no splitting), so its merges cross
    the boundaries any split rule draws: a tokenizer that splits differently from the
    reference then gets different ids, instead of the difference being invisible.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=900, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    assert len(merges) > 200, "the trained vocabulary should have real merges"
    return {"tokens": tokens, "merges": merges}


def gguf_metadata(trained: dict, pre: str, control: list[str], user_defined: list[str] = (), **extra) -> dict:
    tokens = trained["tokens"] + list(control) + list(user_defined)
    types = [1] * len(trained["tokens"]) + [3] * len(control) + [4] * len(user_defined)
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": trained["merges"],
    }
    md.update(extra)
    return md


@pytest.fixture(scope="module")
def deepseek(trained):
    md = gguf_metadata(
        trained,
        "deepseek-v3",
        DS_CONTROL,
        DS_USER_DEFINED,
        **{
            "tokenizer.ggml.bos_token_id": len(trained["tokens"]),
            "tokenizer.ggml.eos_token_id": len(trained["tokens"]) + 1,
            "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_eos_token": False,
        },
    )
    return GGUFTokenizer.from_metadata(md), md


@pytest.fixture(scope="module")
def deepseek_reference(trained, deepseek):
    _, md = deepseek
    n = len(trained["tokens"])
    added = [
        {"id": n + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}
        for i, t in enumerate(DS_CONTROL)
    ] + [
        {"id": n + len(DS_CONTROL) + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": True, "special": False}
        for i, t in enumerate(DS_USER_DEFINED)
    ]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": []},
        "pre_tokenizer": DEEPSEEK_V3_PRE_TOKENIZER,
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": {t: i for i, t in enumerate(trained["tokens"])},
            "merges": [m.split(" ", 1) for m in trained["merges"]],
        },
    }
    return Tokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module")
def kimi(trained):
    n = len(trained["tokens"])
    md = gguf_metadata(
        trained,
        "kimi-k2",
        KIMI_CONTROL,
        **{"tokenizer.ggml.bos_token_id": n, "tokenizer.ggml.eos_token_id": n + 1},
    )
    ref = ReferenceKimi(md["tokenizer.ggml.tokens"], trained["merges"], KIMI_CONTROL)
    return GGUFTokenizer.from_metadata(md), ref


# --------------------------------------------------------------------------- DeepSeek-V3


def test_deepseek_split_matches_reference(deepseek, deepseek_reference):
    tok, _ = deepseek
    for text in TEXTS + CORPUS:
        ours = tok._tok.pre_tokenizer.pre_tokenize_str(text)
        assert ours == deepseek_reference.pre_tokenizer.pre_tokenize_str(text), repr(text)


def test_deepseek_matches_reference_tokenizer(deepseek, deepseek_reference):
    tok, _ = deepseek
    for text in TEXTS + CORPUS:
        assert tok.encode(text) == deepseek_reference.encode(text, add_special_tokens=False).ids, repr(text)


def test_deepseek_round_trip_and_reference_decode(deepseek, deepseek_reference):
    tok, _ = deepseek
    for text in TEXTS + CORPUS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode(ids) == deepseek_reference.decode(ids, skip_special_tokens=False)


@PROPERTY
@given(pool_text)
def test_deepseek_property_matches_reference(deepseek, deepseek_reference, text):
    tok, _ = deepseek
    ids = tok.encode(text)
    assert ids == deepseek_reference.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text


def test_deepseek_special_tokens_are_parsed_whole(deepseek, deepseek_reference):
    tok, _ = deepseek
    text = "<｜User｜>hi 你好<｜Assistant｜><think>hm</think>ok<｜end▁of▁sentence｜>"
    ids = tok.encode(text)
    assert ids == deepseek_reference.encode(text, add_special_tokens=False).ids
    assert ids[0] == tok.token_to_id("<｜User｜>")
    assert tok.token_to_id("<think>") in ids and tok.token_to_id("</think>") in ids
    assert ids[-1] == tok.token_to_id("<｜end▁of▁sentence｜>")
    assert tok.decode(ids) == text
    # Control tokens are hidden with skip_special; user-defined ones (<think>) are text.
    assert tok.decode(ids, skip_special=True) == "hi 你好<think>hm</think>ok"


def test_deepseek_parse_special_off_tokenizes_markers_as_text(deepseek, deepseek_reference):
    tok, _ = deepseek
    text = "<｜User｜>inject<｜end▁of▁sentence｜>"
    ids = tok.encode(text, parse_special=False)
    controls = {tok.token_to_id(t) for t in DS_CONTROL}
    assert not controls & set(ids)
    assert tok.decode(ids) == text
    deepseek_reference.encode_special_tokens = True
    try:
        assert ids == deepseek_reference.encode(text, add_special_tokens=False).ids
    finally:
        deepseek_reference.encode_special_tokens = False
    # user-defined tokens stay whole even then (llama.cpp and HF agree)
    assert tok.encode("<think>", parse_special=False) == [tok.token_to_id("<think>")]


def test_literal_control_tokens_are_text_and_markup_stays_special(deepseek):
    tok, _ = deepseek
    text = "<｜User｜>hi <｜User｜>x<｜Assistant｜><think>ok"
    ids = tok.encode(text, literal_at=[text.index("<｜User｜>", 1)])
    user, assistant = tok.token_to_id("<｜User｜>"), tok.token_to_id("<｜Assistant｜>")
    # the literal one is plain text together with its neighbours, up to the next markup token
    assert ids == [user, *tok.encode("hi <｜User｜>x", parse_special=False), assistant, *tok.encode("<think>ok")]
    assert tok.decode(ids) == text
    # offsets where no control token starts change nothing
    assert tok.encode(text, literal_at=[1, 2, len(text)]) == tok.encode(text)
    assert set(tok.special_token_texts) == set(DS_CONTROL)


literal_parts = st.lists(
    st.one_of(
        pool_text.map(lambda t: ("text", t, False)),
        st.tuples(st.just("control"), st.sampled_from(DS_CONTROL), st.booleans()),
        st.sampled_from(DS_USER_DEFINED).map(lambda t: ("text", t, False)),
    ),
    max_size=10,
)


@PROPERTY
@given(literal_parts)
def test_literal_at_matches_the_reference_split(deepseek, deepseek_reference, parts):
    # Reference: the HF tokenizer cut at the control tokens that are markup, the pieces
    # between them encoded with special tokens off (literal control tokens are text).
    tok, _ = deepseek
    text, literal, expected, run = "", [], [], ""
    deepseek_reference.encode_special_tokens = True
    try:
        for kind, value, is_literal in parts:
            if kind == "control" and not is_literal:
                expected += deepseek_reference.encode(run, add_special_tokens=False).ids if run else []
                expected.append(tok.token_to_id(value))
                run = ""
            else:
                if kind == "control":
                    literal.append(len(text))
                run += value
            text += value
        expected += deepseek_reference.encode(run, add_special_tokens=False).ids if run else []
    finally:
        deepseek_reference.encode_special_tokens = False
    assert tok.encode(text, literal_at=literal) == expected
    assert tok.encode(text, literal_at=()) == tok.encode(text)
    assert tok.decode(expected) == text


def test_add_special_and_eos_ids(deepseek):
    tok, _ = deepseek
    bos = tok.token_to_id("<｜begin▁of▁sentence｜>")
    eos = tok.token_to_id("<｜end▁of▁sentence｜>")
    assert tok.bos_id == bos
    assert tok.encode("hi", add_special=True) == [bos] + tok.encode("hi")
    assert tok.eos_ids == {eos}
    assert tok.vocab_size == len(tok._tokens)
    assert builtin_format_for_vocab(tok) == "deepseek-v4"


def test_eos_ids_found_by_text_when_ids_missing(trained):
    md = gguf_metadata(trained, "deepseek-v3", DS_CONTROL)  # no bos/eos/eot ids at all
    tok = GGUFTokenizer.from_metadata(md)
    assert tok.eos_ids == {tok.token_to_id("<｜end▁of▁sentence｜>")}
    assert tok.bos_id is None and tok.encode("x", add_special=True) == tok.encode("x")


# --------------------------------------------------------------------------- Kimi-K2


def test_kimi_translated_pattern_splits_like_moonshot_pattern():
    split = pre_tokenizers.Split(Regex(KIMI_K2_PATTERN), behavior="isolated")
    samples = TEXTS + CORPUS + ["中文English混合", "汉字abc12345DEF", "北京市 Pascal", "々〆〇 漢字かな", "⺀⺁ 中"]
    for text in samples:
        assert [p for p, _ in split.pre_tokenize_str(text)] == KIMI_REF_RE.findall(text), repr(text)
    # Han runs are their own pieces; camelCase splits on case (tiktoken, not llama.cpp's hand-written split)
    assert KIMI_REF_RE.findall("中文English混合") == ["中文", "English", "混合"]
    assert [p for p, _ in split.pre_tokenize_str("getUserName")] == ["get", "User", "Name"]


@PROPERTY
@given(pool_text)
def test_kimi_split_property(text):
    split = pre_tokenizers.Split(Regex(KIMI_K2_PATTERN), behavior="isolated")
    assert [p for p, _ in split.pre_tokenize_str(text)] == KIMI_REF_RE.findall(text)


def test_kimi_matches_reference(kimi):
    tok, ref = kimi
    for text in TEXTS + CORPUS + ["<|im_user|>user<|im_middle|>你好 there<|im_end|>"]:
        ids = tok.encode(text)
        assert ids == ref.encode(text), repr(text)
        assert tok.decode(ids) == text


@PROPERTY
@given(pool_text)
def test_kimi_property_matches_reference(kimi, text):
    tok, ref = kimi
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    assert tok.decode(ids) == text


def test_kimi_eos_ids_include_im_end_and_eos(kimi):
    tok, _ = kimi
    assert tok.eos_ids == {tok.token_to_id("[EOS]"), tok.token_to_id("<|im_end|>")}
    assert tok.pre == "kimi-k2"
    assert builtin_format_for_vocab(tok) == "kimi-k2"


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("pre", ["qwen2", "default", "deepseek-llm", "kimi-k3-guess"])
def test_unknown_pre_tokenizer_refused(trained, pre):
    with pytest.raises(TokenizerError) as info:
        GGUFTokenizer.from_metadata(gguf_metadata(trained, pre, DS_CONTROL))
    message = str(info.value)
    assert repr(pre) in message and "deepseek-v3" in message and "kimi-k2" in message


def test_missing_pre_and_non_bpe_refused(trained):
    md = gguf_metadata(trained, "deepseek-v3", DS_CONTROL)
    del md["tokenizer.ggml.pre"]
    with pytest.raises(TokenizerError, match="tokenizer.ggml.pre' is missing"):
        GGUFTokenizer.from_metadata(md)
    md = gguf_metadata(trained, "deepseek-v3", DS_CONTROL, **{"tokenizer.ggml.model": "llama"})
    with pytest.raises(TokenizerError, match="'llama'"):
        GGUFTokenizer.from_metadata(md)


def test_aliases_and_gpt2_names_load(trained):
    for pre in ("joyai-llm", "gpt-2", "llama-bpe"):
        tok = GGUFTokenizer.from_metadata(gguf_metadata(trained, pre, DS_CONTROL))
        assert tok.decode(tok.encode("Hello 世界 123")) == "Hello 世界 123"


def test_bad_merges_and_ids_refused(trained):
    md = gguf_metadata(trained, "deepseek-v3", DS_CONTROL)
    md["tokenizer.ggml.merges"] = trained["merges"] + ["nosuch token"]
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        GGUFTokenizer.from_metadata(md)
    tok = GGUFTokenizer.from_metadata(gguf_metadata(trained, "deepseek-v3", DS_CONTROL))
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size + 5])


# --------------------------------------------------------------------------- streaming


def test_stream_decoder_yields_valid_utf8_with_split_emoji(deepseek):
    tok, _ = deepseek
    text = "parrot 🦜 and 👨‍👩‍👧 family, 北京 ok"
    ids = tok.encode(text)
    # The parrot is not in the training corpus: it must arrive as several byte tokens.
    parrot_pieces = [i for i in ids if tok.token_bytes(i) and tok.token_bytes(i)[0] >= 0xF0]
    assert parrot_pieces and any(len(tok.token_bytes(i)) < 4 for i in parrot_pieces)
    dec = StreamDecoder(tok)
    out = []
    held_back = False
    for i in ids:
        delta = dec.feed(i)
        delta.encode("utf-8")  # never half a character (no lone surrogates / partial bytes)
        if dec.pending_bytes:
            held_back = True
        out.append(delta)
    out.append(dec.flush())
    assert held_back
    assert "".join(out) == text


def test_stream_decoder_byte_by_byte_and_garbage(deepseek):
    tok, _ = deepseek
    byte_ids = [tok.token_to_id(B2U[b]) for b in "😀é".encode()]
    dec = StreamDecoder(tok)
    deltas = [dec.feed(i) for i in byte_ids]
    assert deltas == ["", "", "", "😀", "", "é"]
    # a lone continuation byte and an unfinished character become U+FFFD, never raw bytes
    dec = StreamDecoder(tok)
    assert dec.feed(tok.token_to_id(B2U[0x80])) == "\ufffd"
    assert dec.feed(tok.token_to_id(B2U[0xE4])) == ""
    assert dec.flush() == "\ufffd"


def test_stream_decoder_skip_special(deepseek):
    tok, _ = deepseek
    ids = tok.encode("<｜Assistant｜>hi<｜end▁of▁sentence｜>")
    assert StreamDecoder(tok, skip_special=True).feed_many(ids) == "hi"
    assert StreamDecoder(tok).feed_many(ids) == "<｜Assistant｜>hi<｜end▁of▁sentence｜>"
