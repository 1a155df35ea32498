"""Train the ExpertDesk demo model once and write `resources/demo/expertdesk-demo.npz`.

Not part of the app: this is how the shipped demo weights were made, kept so they can
be rebuilt. It needs the test extras (transformers) and takes ~15-20 minutes on 2 CPU
cores:

    .venv/bin/python resources/demo/train_demo.py [--steps 900]

What it does, deterministically (fixed seeds, sorted inputs):

1. Builds a small chat corpus from text already on any Python install: the
   docstrings of ~100 standard-library modules and their public functions/classes
   (Python Software Foundation License) and the Zen of Python (`this`), as
   question/answer conversations in the DeepSeek-V4 chat format, some with a short
   reasoning block (thinking mode) and some with a system prompt or two turns.
2. Trains a byte-level BPE tokenizer (1024 merges+bytes) with the deepseek-v3
   pre-tokenizer rules of `engine.text.tokenizer`, plus DeepSeek's control tokens.
3. Trains a tiny DeepseekV4ForCausalLM (transformers; same architecture the engine
   runs: hyper-connections, sliding/CSA/HCA attention, hash and routed MoE layers).
4. Stores every GGUF tensor in its GGUF type (Q8_0 matrices, BF16 compressor and
   indexer projections, F32 norms and hyper-connection parameters) plus the GGUF
   metadata, so `engine.demo` can write the GGUF and build the pack at first use
   without transformers.
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import math
import random
import re
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.models.deepseek4_export import deepseek4_gguf_tensors  # noqa: E402
from engine.text.chat_template import render_builtin  # noqa: E402
from engine.text.tokenizer import DEEPSEEK_V3_SPLITS  # noqa: E402

OUT = Path(__file__).resolve().parent / "expertdesk-demo.npz"

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
CONTROL_TOKENS = [BOS, EOS, USER, ASSISTANT]
USER_DEFINED_TOKENS = ["<think>", "</think>"]
BPE_VOCAB = 1024

MODULES = """abc argparse array ast asyncio base64 bisect bz2 calendar cmath codecs collections colorsys
concurrent.futures configparser contextlib copy csv dataclasses datetime decimal difflib dis email enum
filecmp fnmatch fractions functools getopt gettext glob gzip hashlib heapq hmac html http imaplib inspect io
ipaddress itertools json keyword linecache locale logging lzma math mimetypes numbers operator os pathlib
pickle platform pprint queue random re sched secrets select shelve shlex shutil signal smtplib socket sqlite3
ssl statistics string struct subprocess tarfile tempfile textwrap threading time timeit tokenize traceback
types typing unicodedata unittest urllib.parse urllib.request uuid warnings weakref xml.etree.ElementTree
zipfile zlib""".split()

SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a concise assistant that knows Python well.",
                  "Answer briefly."]
GREETINGS = [
    ("Hello!", "Hello! I am the ExpertDesk demo model: a tiny model trained on Python's docstrings. "
               "Ask me what a Python module or function does."),
    ("Hi", "Hi! I am a tiny demo model, not a real assistant. Try asking: What does json.dumps do?"),
    ("Who are you?", "I am the ExpertDesk demo model, a tiny DeepSeek-V4-style mixture of experts "
                     "trained for a few minutes on Python docstrings. I only know a little about Python."),
    ("What can you do?", "I can tell you, roughly, what a Python standard library module or function does. "
                         "I am only a demo, so do not trust me with anything important."),
]
MODULE_QUESTIONS = ["What is the {m} module?", "What does the {m} module do?", "Tell me about {m}.",
                    "What is {m} in Python?"]
MEMBER_QUESTIONS = ["What does {q} do?", "What is {q}?", "Explain {q}.", "Tell me about {q}.",
                    "What is {q} used for?"]


# --------------------------------------------------------------------------- corpus

def _clean(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _summary(doc: str | None, limit: int = 360) -> str | None:
    """First prose paragraph of a docstring (skipping signature lines), cut at a sentence."""
    if not doc:
        return None
    for para in doc.split("\n\n"):
        para = _clean(para)
        if not para or re.match(r"^[\w.]+\(.*\)( -> .*)?$", para) or len(para) < 20:
            continue
        if len(para) > limit:
            cut = para[:limit]
            end = cut.rfind(". ")
            para = cut[: end + 1] if end > 80 else cut.rsplit(" ", 1)[0] + " ..."
        return para
    return None


def build_pairs() -> list[tuple[str, str, str]]:
    """(subject, question, answer) triples, in a fixed order."""
    import importlib

    rng = random.Random(0)
    pairs: list[tuple[str, str, str]] = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        summary = _summary(inspect.getdoc(module))
        if summary:
            for template in rng.sample(MODULE_QUESTIONS, 2):
                pairs.append((name, template.format(m=name), f"The {name} module: {summary}"))
        members = []
        for attr in sorted(dir(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr, None)
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", name) not in (name, "_" + name.split(".")[-1], None) and \
                    not str(getattr(obj, "__module__", "")).startswith(name):
                continue  # re-exported from elsewhere
            text = _summary(inspect.getdoc(obj))
            if text:
                members.append((f"{name}.{attr}", text))
        for qual, text in members[:30]:
            question = rng.choice(MEMBER_QUESTIONS).format(q=qual)
            pairs.append((qual, question, f"{qual}: {text}"))
    buf = io.StringIO()
    with redirect_stdout(buf):
        import this  # noqa: F401 - prints the Zen of Python
    zen = buf.getvalue().strip()
    lines = [line for line in zen.splitlines()[2:] if line.strip()]
    pairs.append(("zen", "Tell me the Zen of Python.", zen))
    pairs.append(("zen", "What is the Zen of Python?",
                  "The Zen of Python, by Tim Peters, is a list of guiding principles for Python's design, "
                  "for example: " + lines[0] + " " + lines[2]))
    for line in lines:
        pairs.append(("zen", "Give me a line from the Zen of Python.", line))
    for question, answer in GREETINGS:
        for _ in range(3):
            pairs.append(("hello", question, answer))
    return pairs


def build_conversations(pairs: list[tuple[str, str, str]]) -> list[list[dict]]:
    """Chat conversations (messages lists) built from the pairs, deterministic."""
    rng = random.Random(1)
    conversations = []
    for subject, question, answer in pairs:
        messages: list[dict] = []
        if rng.random() < 0.25:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        if rng.random() < 0.12:
            _s, q0, a0 = pairs[rng.randrange(len(pairs))]
            messages += [{"role": "user", "content": q0}, {"role": "assistant", "content": a0}]
        reply = {"role": "assistant", "content": answer}
        if rng.random() < 0.25:
            reply["reasoning_content"] = (f"The user asks about {subject}. I should recall what the "
                                          "documentation says and answer in one short paragraph.")
        messages += [{"role": "user", "content": question}, reply]
        conversations.append(messages)
    return conversations


def render(messages: list[dict]) -> str:
    thinking = "reasoning_content" in messages[-1]
    return render_builtin("deepseek-v4", messages, add_generation_prompt=False, enable_thinking=thinking)


# --------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in DEEPSEEK_V3_SPLITS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    types = [1] * len(tokens) + [3] * len(CONTROL_TOKENS) + [4] * len(USER_DEFINED_TOKENS)
    tokens += CONTROL_TOKENS + USER_DEFINED_TOKENS
    return tokens, types, merges


# --------------------------------------------------------------------------- model

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "sliding_attention",
               "heavily_compressed_attention"]
CSA, HCA = 4, 8


def model_config(vocab_size: int):
    from transformers import DeepseekV4Config

    config = DeepseekV4Config(
        vocab_size=vocab_size, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, qk_rope_head_dim=16, q_lora_rank=64,
        num_experts_per_tok=2, n_routed_experts=16, n_shared_experts=1, routed_scaling_factor=1.5,
        max_position_embeddings=2048, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                         "beta_fast": 32.0, "beta_slow": 1.0},
        layer_types=LAYER_TYPES,
        compress_rates={"compressed_sparse_attention": CSA, "heavily_compressed_attention": HCA},
        num_hash_layers=1, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0,
        sliding_window=64, o_groups=2, o_lora_rank=32, index_n_heads=8, index_head_dim=32, index_topk=16,
        num_nextn_predict_layers=0, rms_norm_eps=1e-6, tie_word_embeddings=False, norm_topk_prob=True,
        bos_token_id=None, eos_token_id=None,
    )
    config._attn_implementation = "eager"
    return config


def make_batches(sequences: list[list[int]], seq_len: int, pad_id: int):
    """Pack whole conversations into rows of seq_len (each row starts at a conversation start)."""
    rows, labels, cur = [], [], []
    for seq in sequences:
        seq = seq[:seq_len]
        if len(cur) + len(seq) > seq_len:
            rows.append(cur + [pad_id] * (seq_len - len(cur)))
            labels.append(cur + [-100] * (seq_len - len(cur)))
            cur = []
        cur = cur + seq
    if cur:
        rows.append(cur + [pad_id] * (seq_len - len(cur)))
        labels.append(cur + [-100] * (seq_len - len(cur)))
    return torch.tensor(rows), torch.tensor(labels)


def train(steps: int, batch: int, seq_len: int) -> None:
    from transformers import DeepseekV4ForCausalLM

    from engine.text.tokenizer import GGUFTokenizer

    torch.manual_seed(0)
    pairs = build_pairs()
    conversations = build_conversations(pairs)
    texts = [render(c) for c in conversations]
    print(f"corpus: {len(pairs)} pairs, {len(texts)} conversations, {sum(map(len, texts))} chars", flush=True)
    tokens, types, merges = train_tokenizer([q + "\n" + a for _s, q, a in pairs])
    tok_meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "deepseek-v3",
                "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                "tokenizer.ggml.merges": merges,
                "tokenizer.ggml.bos_token_id": tokens.index(BOS), "tokenizer.ggml.eos_token_id": tokens.index(EOS),
                "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": False}
    tokenizer = GGUFTokenizer.from_metadata(tok_meta)
    sequences = [tokenizer.encode(t) for t in texts]
    n_tokens = sum(map(len, sequences))
    print(f"tokenizer: {len(tokens)} tokens; corpus {n_tokens} tokens", flush=True)

    config = model_config(len(tokens))
    model = DeepseekV4ForCausalLM(config)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                gate.tid2eid.copy_(torch.stack([torch.randperm(16, generator=gen)[:2] for _ in range(len(tokens))]))
    rows, labels = make_batches(sequences, seq_len, tokens.index(EOS))
    print(f"{rows.shape[0]} packed rows of {seq_len}; {steps} steps of {batch}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = 50
    order = torch.randperm(rows.shape[0], generator=gen)
    started = time.time()
    model.train()
    try:
        _train_loop(model, opt, rows, labels, order, gen, steps, batch, warmup, started)
    except KeyboardInterrupt:  # keep what was learned so far (the export says how far it got)
        print("interrupted: exporting the model as it is now", flush=True)
    model.eval()
    export(model, tok_meta)


def _train_loop(model, opt, rows, labels, order, gen, steps: int, batch: int, warmup: int, started: float) -> None:
    pos = 0
    for step in range(steps):
        lr = 3e-3 * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        if pos + batch > len(order):
            order, pos = torch.randperm(rows.shape[0], generator=gen), 0
        idx = order[pos : pos + batch]
        pos += batch
        out = model(input_ids=rows[idx], labels=labels[idx], use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == steps - 1:
            print(f"step {step} loss {out.loss.item():.3f} lr {lr:.2e} {time.time() - started:.0f}s", flush=True)


# --------------------------------------------------------------------------- export

def export(model, tok_meta: dict) -> None:
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    config = model.config
    tensors: dict[str, np.ndarray] = {}
    kinds: dict[str, list] = {}

    def put(name: str, param: torch.Tensor, ggml_type=T.F32) -> None:
        values = param.detach().float().contiguous().numpy()
        if ggml_type == T.F32:
            raw = values.astype(np.float32)
        elif ggml_type == T.BF16:
            raw = torch.from_numpy(values).to(torch.bfloat16).view(torch.uint16).numpy().view(np.uint8) \
                .reshape(*values.shape[:-1], -1)
        else:
            raw = quantize(values, ggml_type)
        tensors[name] = raw
        kinds[name] = [int(ggml_type), list(values.shape)]

    for name, param, ggml_type in deepseek4_gguf_tensors(model, big_type=T.Q8_0, side_type=T.BF16,
                                                         expert_type=T.Q8_0, f32=T.F32, i32=T.I32):
        if ggml_type == T.I32:
            tensors[name] = param.to(torch.int32).numpy()
            kinds[name] = [int(T.I32), list(param.shape)]
        else:
            put(name, param, ggml_type)

    k = "deepseek4."
    ratios = [{"sliding_attention": 0, "compressed_sparse_attention": CSA,
               "heavily_compressed_attention": HCA}[t] for t in config.layer_types]
    rope = config.rope_parameters["compress"] if "compress" in config.rope_parameters else config.rope_parameters
    n = config.num_hidden_layers
    # [key, GGUF value type name, value]: engine.demo writes them in this order.
    metadata = [
        ["general.name", "STRING", "ExpertDesk demo (tiny, not a real model)"],
        ["general.description", "STRING",
         "Tiny DeepSeek-V4-architecture demo model trained for minutes on Python docstrings "
         "(PSF License) and the Zen of Python. Not a real model."],
        [k + "vocab_size", "UINT32", config.vocab_size],
        [k + "context_length", "UINT32", config.max_position_embeddings],
        [k + "embedding_length", "UINT32", config.hidden_size],
        [k + "block_count", "UINT32", n],
        [k + "attention.head_count", "UINT32", config.num_attention_heads],
        [k + "attention.head_count_kv", "UINT32", 1],
        [k + "attention.key_length", "UINT32", config.head_dim],
        [k + "attention.value_length", "UINT32", config.head_dim],
        [k + "attention.layer_norm_rms_epsilon", "FLOAT32", config.rms_norm_eps],
        [k + "attention.q_lora_rank", "UINT32", config.q_lora_rank],
        [k + "attention.sliding_window", "UINT32", config.sliding_window],
        [k + "attention.output_group_count", "UINT32", config.o_groups],
        [k + "attention.output_lora_rank", "UINT32", config.o_lora_rank],
        [k + "attention.compress_ratios", "ARRAY_UINT32", ratios],
        [k + "attention.compress_rope_freq_base", "FLOAT32", config.compress_rope_theta],
        [k + "attention.indexer.head_count", "UINT32", config.index_n_heads],
        [k + "attention.indexer.key_length", "UINT32", config.index_head_dim],
        [k + "attention.indexer.top_k", "UINT32", config.index_topk],
        [k + "rope.dimension_count", "UINT32", config.qk_rope_head_dim],
        [k + "rope.freq_base", "FLOAT32", config.rope_theta],
        [k + "rope.scaling.type", "STRING", "yarn"],
        [k + "rope.scaling.factor", "FLOAT32", rope["factor"]],
        [k + "rope.scaling.original_context_length", "UINT32", rope["original_max_position_embeddings"]],
        [k + "rope.scaling.yarn_beta_fast", "FLOAT32", rope["beta_fast"]],
        [k + "rope.scaling.yarn_beta_slow", "FLOAT32", rope["beta_slow"]],
        [k + "expert_count", "UINT32", config.n_routed_experts],
        [k + "expert_used_count", "UINT32", config.num_experts_per_tok],
        [k + "expert_feed_forward_length", "UINT32", config.moe_intermediate_size],
        [k + "expert_shared_count", "UINT32", config.n_shared_experts],
        [k + "expert_weights_scale", "FLOAT32", config.routed_scaling_factor],
        [k + "expert_weights_norm", "BOOL", bool(config.norm_topk_prob)],
        [k + "expert_gating_func", "UINT32", 4],
        [k + "swiglu_clamp_exp", "ARRAY_FLOAT32", [float(config.swiglu_limit)] * n],
        [k + "hash_layer_count", "UINT32", config.mlp_layer_types.count("hash_moe")],
        [k + "hyper_connection.count", "UINT32", config.hc_mult],
        [k + "hyper_connection.sinkhorn_iterations", "UINT32", config.hc_sinkhorn_iters],
        [k + "hyper_connection.epsilon", "FLOAT32", config.hc_eps],
        ["tokenizer.ggml.model", "STRING", tok_meta["tokenizer.ggml.model"]],
        ["tokenizer.ggml.pre", "STRING", tok_meta["tokenizer.ggml.pre"]],
        ["tokenizer.ggml.tokens", "ARRAY_STRING", tok_meta["tokenizer.ggml.tokens"]],
        ["tokenizer.ggml.token_type", "ARRAY_INT32", tok_meta["tokenizer.ggml.token_type"]],
        ["tokenizer.ggml.merges", "ARRAY_STRING", tok_meta["tokenizer.ggml.merges"]],
        ["tokenizer.ggml.bos_token_id", "UINT32", tok_meta["tokenizer.ggml.bos_token_id"]],
        ["tokenizer.ggml.eos_token_id", "UINT32", tok_meta["tokenizer.ggml.eos_token_id"]],
        ["tokenizer.ggml.add_bos_token", "BOOL", False],
        ["tokenizer.ggml.add_eos_token", "BOOL", False],
    ]
    arrays = {f"t:{name}": raw for name, raw in tensors.items()}
    header = {"format": "expertdesk-demo-weights", "version": 1, "tensors": kinds, "order": list(tensors),
              "metadata": metadata}
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--corpus-only", action="store_true", help="print corpus statistics and a sample, then stop")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.corpus_only:
        pairs = build_pairs()
        convs = build_conversations(pairs)
        texts = [render(c) for c in convs]
        print(len(pairs), sum(map(len, texts)))
        for t in texts[:3] + texts[-8:-5]:
            print(repr(t))
    else:
        train(args.steps, args.batch, args.seq_len)
