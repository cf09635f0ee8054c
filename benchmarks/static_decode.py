"""Static KV cache + compiled decode step vs the eager DynamicCache loop, one process.

    .venv/bin/python benchmarks/static_decode.py [--model default] [--tokens 128]
        [--compile default] [--rounds 3]
    # on a GPU machine, a Llama-3.2-1B-shaped model with random bf16 weights (no download):
    python benchmarks/static_decode.py --model random-1b --compile reduce-overhead

Paths, each greedy from the same prompt, timed round by round in alternation:
  dynamic-eager   the engine's shape of loop: DynamicCache, argmax read on the host every token
  static-eager    StaticCache, token kept on the device (engine/runtimes/torch/static_decode.py)
  static-<mode>   the same step through torch.compile (reduce-overhead = CUDA graphs)
Prints tok/s, the ratio to dynamic-eager, weight bytes x tok/s (achieved GB/s) against the
device's peak (engine/tools/calibrate.py), the compile time, and whether every path's tokens equal
dynamic-eager's. Measures and prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from engine.runtimes.torch.kernels import configure_threads, decode_weight_bytes
from engine.runtimes.torch.static_decode import COMPILE_MODES, StaticDecoder
from engine.tools.calibrate import device_peaks

PROMPT_TOKENS = 64


def load(spec: str) -> tuple[torch.nn.Module, list[int], str]:
    """(model, prompt ids, label). random-1b needs no files: bandwidth does not care about
    the weights' values."""
    if spec != "random-1b":
        from engine.runtimes.torch.loader import load_model
        from engine.tools.bench import fixed_prompt_ids

        loaded = load_model(spec)
        return loaded.model, fixed_prompt_ids(loaded, PROMPT_TOKENS), loaded.info.name
    from transformers import LlamaConfig, LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    prompt = torch.randint(0, config.vocab_size, (PROMPT_TOKENS,)).tolist()
    return model, prompt, "random Llama-1B-shaped"


@torch.inference_mode()
def dynamic_eager(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], float]:
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([prompt], device=device), cache=cache, use_cache=True,
                logits_to_keep=1)
    tokens = [int(out.logits[0, -1].argmax())]
    start = time.perf_counter()
    for _ in range(n - 1):
        step = torch.tensor([[tokens[-1]]], device=device)
        out = model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=1)
        tokens.append(int(out.logits[0, -1].argmax()))  # a host sync, as streaming needs
    return tokens, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile", default="default", choices=COMPILE_MODES[1:])
    args = parser.parse_args()
    threads = configure_threads()
    model, prompt, label = load(args.model)
    device = next(model.parameters()).device
    max_len = len(prompt) + args.tokens + 8
    decoders = {"static-eager": StaticDecoder(model, max_len, "none"),
                f"static-{args.compile}": StaticDecoder(model, max_len, args.compile)}
    compile_s: dict[str, float] = {}
    for name, decoder in decoders.items():  # the first run compiles (or warms up)
        start = time.perf_counter()
        decoder.generate(prompt, 8)
        compile_s[name] = time.perf_counter() - start
    dynamic_eager(model, prompt, 8)
    rates: dict[str, list[float]] = {"dynamic-eager": [], **{name: [] for name in decoders}}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        tokens["dynamic-eager"], seconds = dynamic_eager(model, prompt, args.tokens)
        rates["dynamic-eager"].append((args.tokens - 1) / seconds)
        for name, decoder in decoders.items():
            run = decoder.generate(prompt, args.tokens)
            tokens[name] = run.tokens
            rates[name].append(run.decode_tok_s)
    weight_bytes = decode_weight_bytes(model)
    peaks = device_peaks(str(device))
    base = statistics.median(rates["dynamic-eager"])
    print(f"\n{label} on {peaks.device}: {args.tokens} greedy tokens, median of {args.rounds} "
          f"alternating rounds, {threads} CPU threads; {weight_bytes / 1e6:,.0f} MB read per "
          f"token; {peaks.describe()}")
    print(f"  {'path':<34} {'tok/s':>8} {'vs eager':>9} {'GB/s':>8} {'of peak':>8} "
          f"{'warm-up s':>9} {'same tokens':>11}")
    for name, values in rates.items():
        rate = statistics.median(values)
        gb_s = weight_bytes * rate / 1e9
        same = tokens[name] == tokens["dynamic-eager"]
        print(f"  {name:<34} {rate:>8.1f} {rate / base:>8.2f}x {gb_s:>8.1f} "
              f"{gb_s / peaks.bandwidth_gb_s:>7.0%} {compile_s.get(name, 0):>9.1f} {same!s:>11}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
