"""A random-weight GGUF of a chosen shape (engine/tools/synthetic_gguf.py says why), from the
command line:

    .venv/bin/python benchmarks/synthetic_gguf.py OUT.gguf [--arch llama|gemma3]
        [--hidden 768] [--ffn 2048] [--layers 16] [--vocab 0] [--quant Q4_K_M]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.tools.synthetic_gguf import quantize, write_f16

QUANTS = ("F16", "Q4_K_M", "Q4_0", "Q8_0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--arch", choices=("llama", "gemma3"), default="llama")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=0,
                        help="pad the vocabulary to this many tokens (0: the bundled 49,152)")
    parser.add_argument("--quant", choices=QUANTS, default="Q4_K_M")
    args = parser.parse_args()
    f16 = args.out.with_suffix(".f16.gguf") if args.quant != "F16" else args.out
    write_f16(f16, args.arch, args.hidden, args.ffn, args.layers, args.vocab)
    if args.quant != "F16":
        quantize(f16, args.out, args.quant)
        f16.unlink()
    print(args.out)


if __name__ == "__main__":
    main()
