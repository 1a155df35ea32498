"""Limits on what a GGUF file may claim: every count and size the reader trusts is bounded here.

A GGUF header is a list of counts and lengths that the reader loops over or allocates
for. A damaged or hostile file can claim anything, so each count is checked *before*
anything is read or allocated for it: against the bytes really present in the file
(an array of N strings needs at least 8*N bytes) and against the fixed limits below,
which are far above anything a real model uses. Why each limit has its value:
``docs/limits.md``. Every refusal names the file, the field, the value and the limit.

This module holds numbers only (no imports), so that the reader, the adapters and the
docs test can share them.
"""

from __future__ import annotations

__all__ = [
    "LIMITS_DOC",
    "MAX_TENSORS",
    "MAX_METADATA_KEYS",
    "MAX_METADATA_ARRAY_ELEMENTS",
    "MAX_METADATA_STRINGS",
    "MAX_STRING_BYTES",
    "MAX_NAME_BYTES",
    "MAX_TENSOR_DIMS",
    "MAX_BLOCK_COUNT",
    "MAX_EXPERTS",
    "MAX_SHARDS",
    "ARCH_COUNT_LIMITS",
]

LIMITS_DOC = "docs/limits.md"  # named in error messages

# -- the file's own structure (packer.gguf_source) -------------------------------------------

MAX_TENSORS = 16_384  # tensor infos in one file; real models: ~300-1,700
MAX_METADATA_KEYS = 16_384  # metadata entries in one file; real models: ~30-100
MAX_METADATA_ARRAY_ELEMENTS = 2_097_152  # elements of all metadata arrays of one file together
MAX_METADATA_STRINGS = 1_048_576  # strings in metadata arrays of one file (tokens + merges)
MAX_STRING_BYTES = 64 * 1024 * 1024  # one string value or array element (an embedded tokenizer.json)
MAX_NAME_BYTES = 65_535  # a metadata key or tensor name (the GGUF spec's key limit)
MAX_TENSOR_DIMS = 4  # GGML_MAX_DIMS
MAX_SHARDS = 99_999  # shards of a split set: the most gguf-split's NAME-%05d-of-%05d.gguf names

# -- the model's counts (packer.gguf_source and packer.adapters) ----------------------------

MAX_BLOCK_COUNT = 4096  # layers; real models: up to ~130
MAX_EXPERTS = 16_384  # routed experts per layer; real models: up to 512

# Metadata keys "{architecture}.{name}" that size loops and tables, and their limits.
# Checked by GGUFSource.open for every architecture when the value is an integer.
ARCH_COUNT_LIMITS: dict[str, int] = {
    "block_count": MAX_BLOCK_COUNT,
    "leading_dense_block_count": MAX_BLOCK_COUNT,
    "nextn_predict_layers": MAX_BLOCK_COUNT,
    "expert_count": MAX_EXPERTS,
    "expert_used_count": MAX_EXPERTS,
    "expert_shared_count": MAX_EXPERTS,
}
