"""The `phasewise` command: the desktop app by default, plus `ask`, `bench`, `serve` and
`models` (app/models_cli.py).

Bad input exits non-zero with one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from app import __version__
from app.cli_error import CliError
from app.models_cli import add_models_parser
from app.remote_cli import (
    add_backend_options,
    add_serve_parser,
    bench_remote,
    open_engine,
    report_remote_outcome,
)

if TYPE_CHECKING:
    from engine.params import Speculative

EXIT_ERROR = 1
EXIT_CANCELLED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command and return its exit code (tests call it in their own process)."""
    # A frozen bundle's child processes (engine.native) start as this program: run theirs.
    multiprocessing.freeze_support()
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="phasewise: %(levelname)s: %(message)s")
    try:
        return int(args.handler(args))
    except CliError as exc:
        print(f"phasewise: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("phasewise: cancelled", file=sys.stderr)
        return EXIT_CANCELLED


def entry() -> None:
    """The `phasewise` program: main(), then an exit that never finalizes the interpreter
    under one of our threads still inside native code (engine/threads.py)."""
    code = main()
    if "engine" in sys.modules:  # threads of ours exist only once the engine was imported
        from engine.threads import settle

        code = settle(code)
    sys.exit(code)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phasewise",
        description="Chat with local language models and see where the time goes.",
    )
    parser.add_argument("--version", action="version", version=f"phasewise {__version__}")
    add_model_options(parser)
    parser.add_argument("--smoke-test", action="store_true",
                        help="open the window, send one prompt, print one JSON line, exit")
    parser.set_defaults(handler=cmd_gui)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    ask = sub.add_parser("ask", help="answer one prompt on the terminal, streaming")
    add_model_options(ask)
    add_sampling_options(ask)
    ask.add_argument("--system", help="system prompt")
    ask.add_argument("--json", action="store_true", help="print one JSON object last")
    ask.add_argument("--speculative", choices=["ngram", "draft"], default=None,
                     help="speculative decoding: ngram = prompt lookup (greedy only), draft "
                          "= the --draft-model (implied by it); greedy output is unchanged, "
                          "sampled output keeps its distribution")
    add_draft_options(ask)
    ask.add_argument("prompt", nargs="+", help="the prompt ('-' reads standard input)")
    ask.set_defaults(handler=cmd_ask)

    bench = sub.add_parser("bench", help="measure TTFT, prefill and decode speed")
    add_model_options(bench)
    bench.add_argument("--json", action="store_true", help="print one JSON object last")
    bench.add_argument("--max-tokens", type=int, default=64, help="tokens to decode (default 64)")
    bench.add_argument("--prompt-tokens", type=int, default=None,
                       help="prompt length in tokens (default 128; 4000 with --interference)")
    bench.add_argument("--repeats", type=int, default=None,
                       help="runs; medians reported (default 3; 1 with --interference)")
    # Not engine.tools.bench.PEERS: importing it would load torch before --help could print.
    bench.add_argument("--vs", choices=["hf", "llama.cpp"], nargs="+", action="extend",
                       default=[], metavar="PEER",
                       help="also run peers in the same process on the same prompt: hf = "
                            "transformers generate(), llama.cpp = llama-cpp-python on the "
                            "model's GGUF (`make peers`); e.g. --vs hf llama.cpp")
    bench.add_argument("--turns", type=int, default=0,
                       help="run a scripted K-turn chat instead, measuring the prefix cache")
    bench.add_argument("--batch", type=int, nargs="+", metavar="B",
                       help="decode B requests per step for each B given (e.g. 1 2 4 8): "
                            "per-token latency and total throughput")
    bench.add_argument("--interference", action="store_true",
                       help="one chat streams while another's long prompt (--prompt-tokens) "
                            "is prefilled, once "
                            "per schedule (whole between two steps, in chunks, beside the "
                            "stream on its own cores where there is one), then the same stream "
                            "again alone and the prompt alone: the stream's ITL p99 alone and "
                            "during the prefill, and the prefill rate. One round by default: "
                            "about 5 minutes on 2 cores for the bundled model on llama.cpp "
                            "(the chunked schedule's thousands of steps, run twice, are most "
                            "of it); --repeats N runs N rounds, N times as long")
    bench.add_argument("--speculative", action="store_true",
                       help="also decode with prompt-lookup drafts (and the --draft-model's, "
                            "if given); report acceptance, speedup")
    add_draft_options(bench)
    bench.set_defaults(handler=cmd_bench)
    # Remote backends and `serve` (app/remote_cli.py).
    for command in (parser, ask, bench):
        add_backend_options(command)
    add_serve_parser(sub, add_model_options)
    add_models_parser(sub)  # app/models_cli.py: search, pull, list, rm
    return parser


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="'default' (bundled SmolLM2-135M), a model folder, a .gguf file, "
                             "or a hub id")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | mps")
    parser.add_argument("--engine", default="auto", choices=["auto", "torch", "llama.cpp"],
                        help="runtime: llama.cpp runs a .gguf quantized on the CPU (needs "
                             "`make llama-cpp`), torch any model; auto = llama.cpp for a .gguf "
                             "or the default model when there is no CUDA GPU, else torch")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--context", type=int, default=None, metavar="TOKENS",
                        help="context length to allocate (default: the model's own, 8192 at "
                             "most on llama.cpp); a model that does not fit at it is refused "
                             "before loading, with the context that would fit")
    parser.add_argument("--allow-download", action="store_true",
                        help="allow fetching a hub model (offline otherwise)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="allow pickle (.bin) checkpoints, which can run code")
    # Not argparse choices: listing them would import torch before --help could print.
    parser.add_argument("--kernel", default="auto",
                        help="decode path: auto (measured once per model and CPU: the fastest "
                             "that passes the quality guard) | fp32-eager | int8-dynamic | "
                             "bf16-eager | fp16-eager")


def add_draft_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft-model", metavar="SPEC",
                        help="a draft model for speculative decoding, sharing the model's "
                             "vocabulary: 'default', a folder or a .gguf file (e.g. the same "
                             "model with --draft-kernel int8-dynamic)")
    parser.add_argument("--draft-kernel", default="auto",
                        help="the draft model's decode path (as --kernel)")


def speculative_method(args: argparse.Namespace) -> Speculative | None:
    """ask's --speculative, "draft" when only --draft-model is given."""
    if args.speculative == "draft" and not args.draft_model:
        raise CliError("--speculative draft needs --draft-model SPEC")
    return args.speculative or ("draft" if args.draft_model else None)


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"device": args.device, "dtype": args.dtype,
            "allow_download": args.allow_download, "allow_pickle": args.allow_pickle}


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """model_options plus the runtime choice (for the model itself, not a draft)."""
    return {**model_options(args), "engine": args.engine, "context_length": args.context}


# ----- phasewise (the window) --------------------------------------------------------------
def cmd_gui(args: argparse.Namespace) -> int:
    from app.gui import run_gui

    return run_gui(args.model, device=args.device, dtype=args.dtype, kernel=args.kernel,
                   engine=args.engine,
                   allow_download=args.allow_download, smoke_test=args.smoke_test,
                   backend=args.backend, backend_model=args.backend_model)


# ----- phasewise ask -------------------------------------------------------------------------
def cmd_ask(args: argparse.Namespace) -> int:
    from engine import (
        ChatMessage,
        GenerationRequest,
        ModelLoadError,
        PhasewiseError,
        SamplingParams,
        TextFlushed,
        TokenEmitted,
    )

    text = sys.stdin.read() if args.prompt == ["-"] else " ".join(args.prompt)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens,
        seed=args.seed, stop=tuple(args.stop),
    )
    messages = ([ChatMessage("system", args.system)] if args.system else [])
    messages.append(ChatMessage("user", text))
    request = GenerationRequest(messages=messages, params=params, conversation_id="cli",
                                speculative=speculative_method(args))
    try:
        request.validate()  # fail before the model loads
    except PhasewiseError as exc:
        raise CliError(str(exc)) from None

    with open_engine(args) as engine:  # local, or remote with --backend
        if sys.stderr.isatty():  # first start converts the model: say what is happening
            engine.add_listener(show_loading_stage)
        try:
            info = engine.load_model_sync(args.model, kernel=args.kernel, **engine_options(args))
            note_context_clamp(args.context, info.context_length, info.name)
            if args.draft_model:
                if not engine.capabilities.draft_model:
                    raise CliError("--draft-model needs a local model (not --backend)")
                engine.load_draft_sync(args.draft_model, kernel=args.draft_kernel,
                                       **model_options(args))
        except ModelLoadError as exc:
            raise CliError(str(exc)) from None
        handle = engine.submit(request)
        previous = signal.signal(signal.SIGINT, lambda *_: handle.cancel())
        try:
            for event in handle.events():
                if isinstance(event, (TokenEmitted, TextFlushed)) and event.text:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
        finally:
            signal.signal(signal.SIGINT, previous)
        try:
            result = handle.wait()
        except PhasewiseError as exc:
            raise CliError(str(exc)) from None
    sys.stdout.write("\n")
    if args.json:
        print(json.dumps(result.to_json_dict()))
    if report_remote_outcome(result):  # a remote reply broke off: partial text was kept
        return EXIT_ERROR
    return EXIT_CANCELLED if result.finish_reason == "cancelled" else 0


def note_context_clamp(asked: int | None, got: int, model: str) -> None:
    """Say so when --context asked for more than the model was trained for (the engines
    allocate at most that), instead of running on a smaller context without a word."""
    if asked is not None and asked > got:
        print(f"phasewise: note: {model} supports {got:,} tokens of context; using {got:,} "
              f"(asked for {asked:,})", file=sys.stderr)


def show_loading_stage(event: object) -> None:
    from engine import ModelLoading

    if isinstance(event, ModelLoading):
        print(f"phasewise: {event.stage}", file=sys.stderr, flush=True)


# ----- phasewise bench -----------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    from engine import ModelLoadError, PhasewiseError

    if args.prompt_tokens is None:
        args.prompt_tokens = 4000 if args.interference else 128
    if args.repeats is None:  # a round of --interference takes minutes (its --help says)
        args.repeats = 1 if args.interference else 3
    if args.max_tokens < 2:
        raise CliError(f"--max-tokens must be >= 2 to measure decode (got {args.max_tokens})")
    if args.prompt_tokens < 1 or args.repeats < 1 or args.turns < 0:
        raise CliError("--prompt-tokens and --repeats must be >= 1, --turns >= 0")
    if args.batch and min(args.batch) < 1:
        raise CliError(f"--batch sizes must be >= 1 (got {min(args.batch)})")
    if args.backend:
        return bench_remote(args)
    if "llama.cpp" in args.vs:
        from engine.tools.peers import require_llama_cpp

        try:
            require_llama_cpp()  # say so before the model loads, not after
        except PhasewiseError as exc:
            raise CliError(str(exc)) from None

    def progress(stage: str) -> None:
        print(f"  {stage}", file=sys.stderr, flush=True)

    try:
        reference, loaded, draft = load_for_bench(args, progress)
    except ModelLoadError as exc:
        raise CliError(str(exc)) from None
    try:
        report = run_bench(args, reference, loaded, draft, progress)
    finally:  # llama.cpp's memory freed now, in order, not by the finalizer's garbage collection
        loaded.close()
    if args.json:
        print(json.dumps(report))
    return 0


def run_bench(args: argparse.Namespace, reference: Any, loaded: Any, draft: Any,
              progress: Any) -> dict[str, Any]:
    """The measurement cmd_bench asked for, its table printed; returns the report."""
    from engine import PhasewiseError
    from engine.tools.bench import (
        bench_batch,
        bench_decode,
        bench_interference,
        bench_turns,
        settle,
    )

    if args.prompt_tokens + args.max_tokens > loaded.info.context_length:
        raise CliError(
            f"--prompt-tokens + --max-tokens is {args.prompt_tokens + args.max_tokens}, over the "
            f"model's context of {loaded.info.context_length} tokens"
        )
    settle(loaded, progress)
    try:
        if args.batch:
            report = bench_batch(loaded, batch_sizes=tuple(args.batch),
                                 prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                                 rounds=args.repeats, progress=progress)
            print_batch_table(report)
        elif args.interference:
            report = bench_interference(loaded, prompt_tokens=args.prompt_tokens,
                                        rounds=args.repeats, progress=progress)
            print_interference_table(report)
        elif args.turns:
            report = bench_turns(loaded, turns=args.turns, max_tokens=args.max_tokens,
                                 progress=progress)
            print_turns_table(report)
        else:
            report = bench_decode(loaded, prompt_tokens=args.prompt_tokens,
                                  max_tokens=args.max_tokens, repeats=args.repeats,
                                  peers=args.vs, speculative=args.speculative or bool(draft),
                                  draft=draft, hf_reference=reference, progress=progress)
            print_decode_table(report)
    except PhasewiseError as exc:
        raise CliError(str(exc)) from None
    return report


def load_for_bench(args: argparse.Namespace, progress: Any) -> tuple[Any, Any, Any]:
    """(the model as loaded, the model with its decode path, the draft model or None).
    On the llama.cpp engine the first is None: there is no torch model for --vs hf."""
    from engine.runtimes import LLAMA_CPP, load, resolve_engine
    from engine.runtimes.torch.kernels import select_kernel
    from engine.runtimes.torch.loader import load_model
    from engine.runtimes.torch.runtime import TorchRuntime

    if resolve_engine(args.model, args.engine, args.device) == LLAMA_CPP:
        if "hf" in args.vs:
            raise CliError("--vs hf compares the torch engine with generate(); use --engine "
                           "torch, or --vs llama.cpp for the llama.cpp engine")
        gguf_model = load(args.model, LLAMA_CPP, kernel=args.kernel, progress=progress,
                          context_length=args.context)
        note_context_clamp(args.context, gguf_model.info.context_length, gguf_model.info.name)
        gguf_draft = gguf_model.load_draft(args.draft_model, kernel=args.draft_kernel,
                                           progress=progress) if args.draft_model else None
        return None, gguf_model, gguf_draft
    reference = load_model(args.model, progress=progress, **model_options(args))
    loaded = TorchRuntime(select_kernel(reference, args.kernel, progress=progress))
    draft = loaded.load_draft(args.draft_model, kernel=args.draft_kernel, progress=progress,
                              **model_options(args)) if args.draft_model else None
    return reference, loaded, draft


def print_decode_table(r: dict[str, Any]) -> None:
    print(f"\n{r['model']} on {r['device']} ({r['dtype']}, {r['kernel']}); "
          f"prompt {r['prompt_tokens']} tokens, {r['max_tokens']} decoded, "
          f"median of {r['repeats']}")
    rows = [
        ("TTFT (cold)", f"{r['ttft_s'] * 1e3:.1f} ms"),
        ("prefill", f"{r['prefill_tok_s']:.0f} tok/s  ({r['prefill_tflop_s']:.3f} TFLOP/s)"),
        ("decode", f"{r['decode_tok_s']:.1f} tok/s  ({r['achieved_gb_s']:.1f} GB/s of weights)"),
        ("ITL p50 / p90 / p99", f"{r['itl_p50_s'] * 1e3:.1f} / {r['itl_p90_s'] * 1e3:.1f} / "
                                f"{r['itl_p99_s'] * 1e3:.1f} ms"),
    ]
    if r.get("memory_pages"):
        rows.append(("memory", r["memory_pages"]))
    rows += peer_rows(r)
    if "spec_decode_tok_s" in r:
        rows.append(("speculative (ngram)", f"{r['spec_decode_tok_s']:.1f} tok/s decode, "
                                            f"x{r['spec_speedup']:.2f} vs plain, accepted "
                                            f"{r['spec_accepted']}/{r['spec_proposed']} "
                                            f"({r['spec_accept_rate']:.0%})"))
        rows.append(("speculative output = plain", str(r["spec_output_identical"])))
    if "draft_decode_tok_s" in r:
        rows.append((f"speculative (draft {r['draft_model']}, {r['draft_kernel']})",
                     f"{r['draft_decode_tok_s']:.1f} tok/s decode, x{r['draft_speedup']:.2f} vs "
                     f"plain, accepted {r['draft_accepted']}/{r['draft_proposed']} "
                     f"({r['draft_accept_rate']:.0%})"))
        rows.append(("draft output = plain", str(r["draft_output_identical"])))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


# JSON key prefix -> (table label, short name in the ratio rows)
PEER_NAMES = {"hf": ("transformers generate()", "generate()"),
              "llama_cpp": ("llama.cpp (llama-cpp-python)", "llama.cpp")}


def peer_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """Each peer's decode, TTFT and ITL, and our ratios against it (above 1: ours is better)."""
    rows = []
    for key, (label, short) in PEER_NAMES.items():
        if f"{key}_error" in r:  # its child process crashed: one line, no numbers
            rows.append((label, r[f"{key}_error"]))
        if f"{key}_decode_tok_s" not in r:
            continue
        detail = f" ({r['hf_kernel']})" if key == "hf" else llama_cpp_config(r)
        rows.append((label, f"{r[f'{key}_decode_tok_s']:.1f} tok/s decode, TTFT "
                            f"{r[f'{key}_ttft_s'] * 1e3:.1f} ms, ITL p50 / p99 "
                            f"{r[f'{key}_itl_p50_s'] * 1e3:.1f} / "
                            f"{r[f'{key}_itl_p99_s'] * 1e3:.1f} ms{detail}"))
        rows.append((f"decode ratio vs {short}", f"x{r[f'decode_ratio_vs_{key}']:.2f}"))
        rows.append((f"TTFT ratio vs {short}",
                     f"x{r[f'ttft_ratio_vs_{key}']:.2f} (their TTFT / ours)"))
    return rows


def llama_cpp_config(r: dict[str, Any]) -> str:
    """Which of llama.cpp's configurations the ratios are against, and both rates."""
    chosen = "on" if r["llama_cpp_flash_attn"] else "off"
    rates = [f"{state} {r[f'llama_cpp_fa_{state}_decode_tok_s']:.1f}" for state in ("off", "on")
             if f"llama_cpp_fa_{state}_decode_tok_s" in r]
    faster = "the faster: " + " / ".join(rates) + " tok/s" if len(rates) > 1 else "the only one"
    return f" (flash attention {chosen}, {faster})"


def print_batch_table(r: dict[str, Any]) -> None:
    print(f"\n{r['model']} on {r['device']} ({r['kernel']}): requests sharing each decode "
          f"step; prompt {r['prompt_tokens']} tokens, {r['max_tokens']} decoded")
    print("  batch  per-token latency ms  total tok/s  throughput vs first")
    for b in r["batches"]:
        print(f"  {b['batch']:>5}  {b['per_token_latency_ms']:>20.1f}  {b['total_tok_s']:>11.1f}"
              f"  {b['throughput_vs_first']:>18.2f}x")


def print_interference_table(r: dict[str, Any]) -> None:
    from engine.tools.bench import INTERFERENCE_LABELS

    print(f"\n{r['model']} on {r['device']} ({r['kernel']}): a chat streams while a "
          f"{r['prompt_tokens']}-token prompt is prefilled; {r['rounds']} round(s)")
    print("  prefill                          ITL p99 alone  during prefill   ratio  "
          "prefill s  tok/s  stream tokens during  tok/s alone  longest wait for progress "
          "(with the stream / alone)")
    for mode in r["modes"]:
        label = INTERFERENCE_LABELS[mode]
        print(f"  {label:<31}  {r[f'{mode}_itl_p99_alone_s'] * 1e3:>10.1f} ms  "
              f"{r[f'{mode}_itl_p99_during_prefill_s'] * 1e3:>11.1f} ms  "
              f"{r[f'{mode}_itl_p99_ratio']:>6.2f}  {r[f'{mode}_prefill_s']:>9.2f}  "
              f"{r[f'{mode}_prefill_tok_s']:>5.0f}  "
              f"{r[f'{mode}_stream_tokens_during_prefill']:>20}  "
              f"{r[f'{mode}_lone_prefill_tok_s']:>11.0f}  "
              f"{r[f'{mode}_progress_gap_max_s']:>12.2f} s / "
              f"{r[f'{mode}_lone_progress_gap_max_s']:.2f} s")
    before = ", ".join(f"{r[f'{mode}_itl_p99_before_prefill_s'] * 1e3:.1f}" for mode in r["modes"])
    print("  alone: the same tokens of the same stream, streamed again with no prompt to read (a "
          "step costs more as the stream's own context grows);\n"
          f"  ITL p99 of its tokens before the prompt came: {before} ms")


def print_turns_table(r: dict[str, Any]) -> None:
    print(f"\n{r['model']} on {r['device']}: scripted chat, prefix cache per turn")
    print("  turn  prompt  cached  share  prefill ms  TTFT ms  decode tok/s  miss reason")
    for t in r["turns"]:
        print(f"  {t['turn']:>4}  {t['prompt_tokens']:>6}  {t['cached_tokens']:>6}  "
              f"{t['cached_share']:>5.0%}  {t['prefill_s'] * 1e3:>10.1f}  {t['ttft_s'] * 1e3:>7.1f}"
              f"  {t['decode_tok_s']:>12.1f}  {t['cache_miss_reason']}")
    print(f"  cold TTFT of the last prompt: {r['cold_ttft_s_last_prompt'] * 1e3:.1f} ms; "
          f"last turn / cold = {r['last_ttft_over_cold']:.2f}")
