"""A small GGUF written for a test: the header the fit estimate and the model picker read."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_gguf(path: Path, *, layers: int, kv_heads: int, heads: int = 8, head_dim: int = 64,
               context: int = 8192, rows: int = 32, vocab: int = 0) -> Path:
    """A llama GGUF header with the shape the estimate reads (its weights: one table of
    `rows`; `vocab` > 0 adds a vocabulary of that many tokens, as a real header carries)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_embedding_length(heads * head_dim)
    writer.add_context_length(context)
    if vocab:
        writer.add_token_list([f"token{i}" for i in range(vocab)])
    writer.add_tensor("token_embd.weight", np.zeros((rows, heads * head_dim), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
