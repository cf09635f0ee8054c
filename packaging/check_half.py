"""Measure whether the float16-stored bundled model answers exactly like the float32 conversion.

    python packaging/check_half.py BUNDLED_DIR [--max-tokens 64]

Both folders are loaded as float32 (as the app does on a CPU) and decode a fixed prompt set
greedily; the script prints how many replies are token-for-token identical and exits 1 if any
differs. Run it after changing the default model or how it is stored.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.loader import converted_gguf, default_gguf_path  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain what a prime number is.",
    "List three fruits.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for learning to code.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat in two sentences.",
    "What does a CPU do?",
    "Name the planets of the solar system.",
]


def greedy_replies(folder: Path, max_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 local_files_only=True).eval()
    replies = []
    for prompt in PROMPTS:
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True,
            return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=max_tokens,
                                 pad_token_id=tokenizer.eos_token_id)
        replies.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    return replies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundled", type=Path)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    reference = converted_gguf(default_gguf_path(), lambda _msg: None)
    want = greedy_replies(reference, args.max_tokens)
    got = greedy_replies(args.bundled, args.max_tokens)
    same = sum(a == b for a, b in zip(want, got, strict=True))
    print(f"greedy replies identical: {same}/{len(PROMPTS)} ({args.max_tokens} tokens max)")
    for prompt, a, b in zip(PROMPTS, want, got, strict=True):
        if a != b:
            pairs = enumerate(zip(a, b, strict=False))  # replies may differ in length
            first = next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))
            print(f"  differs at token {first}: {prompt!r}")
    return 0 if same == len(PROMPTS) else 1


if __name__ == "__main__":
    sys.exit(main())
