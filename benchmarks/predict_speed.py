"""How fast here, predicted against measured: decode tok/s and a 4,000-token prompt's time.

The prediction is the browser's (engine/tools/speed.py): one measurement of this machine per engine
(memory bandwidth, and the engine on the bundled model: a short decode and cold prompts of
128, 512, 1,536 and 4,000 tokens), then each file priced from its header alone. Here the measurement
is taken fresh (not the user cache's), and each file is then run for real on each engine, as
the app loads it (a child process per run): the best of two 64-token decodes after a 64-token
prompt, and one cold 4,000-token prompt. The files: the bundled SmolLM2-135M Q4_1, its
requantizations to Q4_K_M and Q8_0 (llama.cpp's llama_model_quantize with allow_requantize,
into a temporary folder, never kept; SmolLM2's 576-wide rows do not divide into K-quant
blocks of 256, so its "Q4_K_M" is mostly Q5_0, with Q4_K and Q6_K in the rest) and, with
--large, a random-weight 750M-parameter Llama of the same vocabulary quantized to Q4_K_M (an
untied head; to see the prediction scale).

    .venv/bin/python benchmarks/predict_speed.py [--engines llama.cpp torch] [--large] [--json]

Prints the table (predicted, measured, measured / predicted) with the CPU and the load.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model_files import default_gguf_path
from engine.native import NativeChild
from engine.runtimes.torch.kernels import cpu_name
from engine.tools.speed import (
    PROMPT_TOKENS,
    ModelCost,
    engine_build,
    measure_engine,
    predict,
    run_engine,
    speed_device,
)

KQUANT = "Q4_K_M"
LARGE = {"hidden": 1536, "layers": 24, "heads": 24, "kv_heads": 8, "ffn": 4096}


def quantize_child(conn: Connection, source: str, target: str, ftype: int) -> None:
    """In a child (native code): llama_model_quantize, allowed to requantize."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = len(os.sched_getaffinity(0))
    code = llama_cpp.llama_model_quantize(source.encode(), target.encode(),
                                          ctypes.byref(params))
    conn.send(("done", code))


def quantize(source: Path, target: Path, ftype: int = 15) -> Path:
    """source requantized to `ftype` (15: Q4_K_M) at target."""
    child = NativeChild(quantize_child, str(source), str(target), ftype, what="quantize")
    try:
        code = child.receive(1800)
    finally:
        child.close()
    if code != 0 or not target.is_file():
        raise SystemExit(f"llama_model_quantize failed ({code}) for {target.name}")
    return target


def random_llama(target: Path, vocab_from: Path) -> Path:
    """A random-weight Llama of LARGE's shape in F16, with vocab_from's tokenizer."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    shape = LARGE
    hidden, ffn, layers = shape["hidden"], shape["ffn"], shape["layers"]
    head_dim = hidden // shape["heads"]
    reader = GGUFReader(str(vocab_from))
    writer = GGUFWriter(str(target), "llama")
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") or key in ("general.name",):
            kind = field.types[0]
            sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    vocab = int(reader.fields["llama.vocab_size"].contents())
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(1)  # F16
    rng = np.random.default_rng(0)

    def matrix(rows: int, cols: int) -> Any:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    ones = np.ones(hidden, dtype=np.float32)
    kv = shape["kv_heads"] * head_dim
    writer.add_tensor("token_embd.weight", matrix(vocab, hidden))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.attn_q.weight", matrix(hidden, hidden))
        writer.add_tensor(f"blk.{i}.attn_k.weight", matrix(kv, hidden))
        writer.add_tensor(f"blk.{i}.attn_v.weight", matrix(kv, hidden))
        writer.add_tensor(f"blk.{i}.attn_output.weight", matrix(hidden, hidden))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", matrix(ffn, hidden))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", matrix(ffn, hidden))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", matrix(hidden, ffn))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", matrix(vocab, hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=["llama.cpp", "torch"],
                        choices=("llama.cpp", "torch"))
    parser.add_argument("--large", action="store_true",
                        help="also a random-weight 750M Llama, K-quantized (a few minutes)")
    parser.add_argument("--extra", nargs="+", default=[], type=Path, metavar="GGUF",
                        help="more GGUF files to predict and measure (a --large file kept "
                             "from an earlier run, say)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    load_before = os.getloadavg()
    started = time.time()
    rows: list[dict[str, Any]] = []
    calibrations: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="phasewise-predict-") as tmp:
        bundled = default_gguf_path()
        files = [("SmolLM2-135M Q4_1 (bundled)", "default", bundled),
                 (f"SmolLM2-135M {KQUANT} (requantized)", None,
                  quantize(bundled, Path(tmp) / f"SmolLM2-135M.{KQUANT}.gguf")),
                 ("SmolLM2-135M Q8_0 (requantized)", None,
                  quantize(bundled, Path(tmp) / "SmolLM2-135M.Q8_0.gguf", 7))]
        if args.large:
            f16 = random_llama(Path(tmp) / "random-750M.F16.gguf", bundled)
            large = quantize(f16, Path(tmp) / f"random-750M.{KQUANT}.gguf")
            f16.unlink()
            files.append((f"random Llama 750M {KQUANT}", None, large))
        files += [(path.name, None, path) for path in args.extra]
        for engine in args.engines:
            device = speed_device(engine)
            speed = measure_engine(engine, device)  # fresh: the browser's measurement
            calibrations[engine] = speed.describe()
            print(f"# {speed.describe()}", file=sys.stderr, flush=True)
            for name, spec, path in files:
                cost = ModelCost.from_gguf_file(path)
                predicted = predict(cost, speed, PROMPT_TOKENS)
                run = run_engine(spec or str(path), engine, device, (PROMPT_TOKENS,))
                (tokens, prompt_s), = run.prefill
                row = {"model": name, "engine": engine, "kernel": run.kernel,
                       "file_mb": path.stat().st_size / 1e6, "step_mb": cost.step_bytes / 1e6,
                       "decode_predicted": predicted.decode_tok_s,
                       "decode_measured": run.decode_tok_s,
                       "decode_ratio": run.decode_tok_s / predicted.decode_tok_s,
                       "prompt_tokens": tokens, "prompt_predicted_s": predicted.prompt_s,
                       "prompt_measured_s": prompt_s,
                       "prompt_ratio": prompt_s / (predicted.prompt_s or float("nan"))}
                rows.append(row)
                print(f"# {json.dumps(row)}", file=sys.stderr, flush=True)
    about = {"cpu": cpu_name(), "threads": len(os.sched_getaffinity(0)),
             "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
             "builds": {e: engine_build(e) for e in args.engines},
             "minutes": (time.time() - started) / 60, "calibrations": calibrations}
    if args.json:
        print(json.dumps({"about": about, "rows": rows}, indent=1))
        return
    print(f"CPU: {about['cpu']} ({about['threads']} threads); load average before "
          f"{load_before[0]:.2f}, after {about['loadavg_after'][0]:.2f}; "
          f"{about['minutes']:.1f} min")
    print("\n| model | engine | decode tok/s predicted | measured | measured / predicted "
          f"| {PROMPT_TOKENS:,}-token prompt s predicted | measured | measured / predicted |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['model']} | {r['engine']} ({r['kernel']}) | {r['decode_predicted']:.1f} "
              f"| {r['decode_measured']:.1f} | {r['decode_ratio']:.2f} "
              f"| {r['prompt_predicted_s']:.1f} | {r['prompt_measured_s']:.1f} "
              f"| {r['prompt_ratio']:.2f} |")


if __name__ == "__main__":
    main()
