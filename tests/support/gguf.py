"""A small GGUF written for a test: the header the fit estimate and the model picker read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def write_gguf(path: Path, *, layers: int, kv_heads: int, heads: int = 8, head_dim: int = 64,
               context: int = 8192, rows: int = 32, vocab: int = 0, untied: bool = False,
               ) -> Path:
    """A llama GGUF header with the shape the estimate reads (its weights: one table of
    `rows`; `vocab` > 0 adds a vocabulary of that many tokens, as a real header carries;
    `untied` adds an output head of its own and one block's weight matrix)."""
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
    if untied:
        width = heads * head_dim
        writer.add_tensor("blk.0.ffn_up.weight", np.zeros((2 * width, width), dtype=np.float16))
        writer.add_tensor("output.weight", np.zeros((rows, width), dtype=np.float32))
    write_out(writer)
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
    write_out(writer)
    return target


def write_split_gguf(folder: Path, stem: str, *, rows: int = 256) -> list[Path]:
    """A llama model split over three files ('STEM-00001-of-00003.gguf', ...), one tensor
    each (the metadata and a vocabulary in the first, as gguf-split writes them): an input
    table of `rows` (f16), one block's matrix (f16) and an untied output head (f32)."""
    from gguf import GGUFWriter

    width = 8 * 64
    writer = GGUFWriter(str(folder / f"{stem}.gguf"), "llama", split_max_tensors=1)
    writer.add_block_count(2)
    writer.add_head_count(8)
    writer.add_head_count_kv(2)
    writer.add_embedding_length(width)
    writer.add_context_length(8192)
    writer.add_token_list([f"token{i}" for i in range(rows)])
    writer.add_tensor("token_embd.weight", np.zeros((rows, width), dtype=np.float16))
    writer.add_tensor("blk.0.ffn_up.weight", np.ones((2 * width, width), dtype=np.float16))
    writer.add_tensor("output.weight", np.ones((rows, width), dtype=np.float32))
    write_out(writer)
    return [folder / f"{stem}-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]


def write_out(writer: Any) -> None:
    """A GGUFWriter's header, metadata and tensors to its file(s), then closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
