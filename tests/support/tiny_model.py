"""Build a tiny random Llama model with a real byte-level BPE tokenizer and a ChatML template.

Loads in milliseconds and goes through the same loading code as a real model folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The capital of France is Paris. The capital of Germany is Berlin.",
    "Hello, how are you today? I am fine, thank you for asking.",
    "def main():\n    print('hello world')\n",
    "Emoji 😀🎉 and CJK 你好世界 and accents café naïve résumé.",
] * 20


def build_tiny_tokenizer(
    folder: Path, special: list[str], template: str, *, bos: str, eos: str
) -> Path:
    """A byte-level BPE tokenizer with another template family's control tokens (no model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token=eos)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return folder


def _chatml_tokenizer(folder: Path, *, chat_template: bool = True) -> Any:
    """The tiny models' byte-level BPE tokenizer (400 tokens, ChatML control tokens), saved."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    if chat_template:
        tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(folder)
    return tokenizer


def _special_ids(tokenizer: Any) -> dict[str, int]:
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|im_start|>"),
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
    }


def _built_once(folder: Path, recipe: str, build: Callable[[Path], object]) -> Path:
    """Build a tiny model folder once per machine and copy it afterwards.

    Building one trains a tokenizer and saves a model (~2 s); a mutation run starts thousands of
    short pytest processes, each of which would build its own. The copy is keyed by the recipe,
    this file's source and the library versions, so any change builds afresh.
    """
    source = Path(__file__).read_bytes()
    key = hashlib.sha256(
        source + recipe.encode() + transformers.__version__.encode() + torch.__version__.encode()
    ).hexdigest()[:16]
    stored = Path(tempfile.gettempdir()) / "phasewise-tiny-models" / key
    if not stored.is_dir():
        build(folder)
        partial = stored.with_name(f"{key}.{os.getpid()}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(folder, partial)
        try:
            partial.rename(stored)  # atomic: another process may have stored it meanwhile
        except OSError:
            shutil.rmtree(partial, ignore_errors=True)
        return folder
    shutil.copytree(stored, folder, dirs_exist_ok=True)
    return folder


def build_tiny_model(folder: Path, *, chat_template: bool = True, seed: int = 0) -> Path:
    return _built_once(folder, f"llama template={chat_template} seed={seed}",
                       lambda into: _build_tiny_model(into, chat_template, seed))


def _build_tiny_model(folder: Path, chat_template: bool, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _chatml_tokenizer(folder, chat_template=chat_template)
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        **_special_ids(tokenizer),
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)


# ----- the architecture matrix ---------------------------------------------------------------
TINY_WINDOW = 16  # sliding-window layers see 16 tokens: every chat in the tests is longer
_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
# model_type -> config fields beyond the shared tiny shape (real transformers config classes)
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": dict(use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=1,
                  head_dim=16),
    "mistral": dict(sliding_window=TINY_WINDOW),
    "gemma2": dict(sliding_window=TINY_WINDOW, head_dim=16),
    "gemma3_text": dict(sliding_window=TINY_WINDOW, head_dim=16, num_hidden_layers=3,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    "phi3": dict(sliding_window=TINY_WINDOW),
    # hybrid: short-convolution layers (a per-layer state instead of KV) between attention
    "lfm2": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"]),
    # hybrid: linear attention (a recurrent state, which cannot roll back) + attention, MoE
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"], head_dim=16,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, linear_num_key_heads=2,
                       linear_num_value_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16),
}


def build_tiny_architecture(folder: Path, model_type: str, *, seed: int = 0) -> Path:
    """A tiny random model of one architecture, from its real config class, with the ChatML
    tokenizer: loads like any model folder a user brings."""
    return _built_once(folder, f"{model_type} seed={seed}",
                       lambda into: _build_tiny_architecture(into, model_type, seed))


def _build_tiny_architecture(folder: Path, model_type: str, seed: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = _chatml_tokenizer(folder)
    torch.manual_seed(seed)
    fields = {**_SHAPE, **_special_ids(tokenizer), **ARCHITECTURES[model_type]}
    config = AutoConfig.for_model(model_type, **fields)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # a slow decay, so the recurrent state carries the whole past
        for name, param in model.named_parameters():
            if name.endswith(".A_log"):
                param.fill_(-4.0)
    model.save_pretrained(folder)


def sharpened(folder: Path, into: Path, factor: float = 8.0) -> Path:
    """A copy of a tiny model with its layer weights scaled up: its logits spread far apart
    and depend on the whole context (the plain tiny model's barely differ), so a wrong KV row
    or position shows up in a logits comparison."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(folder, into, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(into)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() == 2 and "embed" not in name:
                weight.mul_(factor)
    model.save_pretrained(into)
    return into
