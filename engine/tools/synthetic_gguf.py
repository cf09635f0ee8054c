"""A random-weight GGUF of a chosen shape, for timing llama.cpp kernels a real file cannot show.

The bundled SmolLM2 (hidden 576) cannot be a K-quant: llama.cpp's K-quants need rows in
multiples of 256, so a Q4_K_M requantization of it falls back to Q5_0 for 180 of 272 tensors.
This writes a Llama-architecture file with the bundled model's tokenizer and chat template
(hidden 768, FFN 2048 by default: every matrix a K-quant), or a Gemma-3-architecture file with
a 262,144-token vocabulary (the bundled tokenizer padded with unused tokens: the per-token
work on a large vocabulary), in F16, then quantizes it with llama.cpp's own quantizer. Its
replies are noise; its speed is a real model's of that shape. engine/tools/speed.py times a
prompt on it in each weight type; benchmarks/synthetic_gguf.py writes one from the command line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from engine.model_files import default_gguf_path

HEAD_DIM = 64


def tokenizer_fields(vocab: int) -> list[tuple[str, Any, Any, Any]]:
    """The bundled model's tokenizer and chat template as (key, value, type, sub type), its
    token list padded to `vocab` with unused tokens when larger."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(default_gguf_path()))
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if vocab and key == "tokenizer.ggml.tokens":
            value = value + [f"<unused{i}>" for i in range(vocab - len(value))]
        if vocab and key == "tokenizer.ggml.token_type":
            value = value + [5] * (vocab - len(value))  # USER_DEFINED: never produced by BPE
        kind = field.types[0]
        fields.append((key, value, kind, field.types[-1] if kind == GGUFValueType.ARRAY else None))
    return fields


def write_f16(path: Path, arch: str, hidden: int, ffn: int, layers: int, vocab: int,
              seed: int = 0, head_dim: int = HEAD_DIM) -> Path:
    """An F16 file at `path` of `arch` ("llama" | "gemma3") with random weights, hidden //
    head_dim attention heads; `vocab` 0 keeps the bundled 49,152 tokens."""
    from gguf import GGUFWriter

    rng = np.random.default_rng(seed)
    fields = tokenizer_fields(vocab)
    n_vocab = len(next(v for k, v, _, _ in fields if k == "tokenizer.ggml.tokens"))
    heads = hidden // head_dim
    kv_heads = max(1, heads // 4)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"synthetic-{arch}-{hidden}x{layers}")
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        writer.add_sliding_window(512)
    for key, value, kind, sub in fields:
        writer.add_key_value(key, value, kind, sub_type=sub)

    def matrix(rows: int, cols: int) -> np.ndarray:  # uniform: 4x faster to draw than normal
        return ((rng.random((rows, cols), dtype=np.float32) - 0.5) * 0.07).astype(np.float16)

    def norm(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    writer.add_tensor("token_embd.weight", matrix(n_vocab, hidden))
    writer.add_tensor("output_norm.weight", norm(hidden))
    for i in range(layers):
        block = f"blk.{i}"
        writer.add_tensor(f"{block}.attn_norm.weight", norm(hidden))
        writer.add_tensor(f"{block}.attn_q.weight", matrix(heads * head_dim, hidden))
        writer.add_tensor(f"{block}.attn_k.weight", matrix(kv_heads * head_dim, hidden))
        writer.add_tensor(f"{block}.attn_v.weight", matrix(kv_heads * head_dim, hidden))
        writer.add_tensor(f"{block}.attn_output.weight", matrix(hidden, heads * head_dim))
        writer.add_tensor(f"{block}.ffn_norm.weight", norm(hidden))
        writer.add_tensor(f"{block}.ffn_gate.weight", matrix(ffn, hidden))
        writer.add_tensor(f"{block}.ffn_up.weight", matrix(ffn, hidden))
        writer.add_tensor(f"{block}.ffn_down.weight", matrix(hidden, ffn))
        if arch == "gemma3":
            writer.add_tensor(f"{block}.attn_q_norm.weight", norm(head_dim))
            writer.add_tensor(f"{block}.attn_k_norm.weight", norm(head_dim))
            writer.add_tensor(f"{block}.post_attention_norm.weight", norm(hidden))
            writer.add_tensor(f"{block}.post_ffw_norm.weight", norm(hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantize(source: Path, target: Path, kind: str, *, pure: bool = False) -> Path:
    """llama.cpp's quantizer from `source` to `target` as file type `kind` ("Q4_K_M"). `pure`:
    every matrix of the body in the type's main one (no mix) and the embedding table left in
    F16 (it is most of the quantizing time and none of a prompt's), as a per-type timing
    needs. Native code: call it in a child process (engine/native.py)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.pure = pure
    if pure:
        params.token_embedding_type = llama_cpp.GGML_TYPE_F16
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params):
        raise RuntimeError(f"llama.cpp could not write {target.name}")
    return target
