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


def vocab_only_copy(source: Path, target: Path, *, add_bos: bool) -> Path:
    """source's metadata without its chat template (a base model's file) and with
    tokenizer.ggml.add_bos_token set to add_bos; no tensors, so only a vocabulary-only load
    (llama.cpp's vocab_only) reads it."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(target), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "tokenizer.chat_template",
                                              "tokenizer.ggml.add_bos_token"):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
