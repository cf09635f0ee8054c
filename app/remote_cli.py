"""CLI pieces for serving and remote backends: `phasewise serve` and `--backend URL`.

Kept apart from app/cli.py so the two grow independently; cli.py only calls in here.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

from app.cli_error import CliError

if TYPE_CHECKING:
    from engine.protocol import Backend

SERVE_TOKEN_ENV = "PHASEWISE_SERVE_TOKEN"


def add_serve_parser(sub: Any, add_model_options: Any) -> None:
    serve = sub.add_parser("serve", help="serve the local model over an OpenAI-compatible API")
    add_model_options(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1; others need --token)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--token", default=os.environ.get(SERVE_TOKEN_ENV),
                       help=f"require 'Authorization: Bearer TOKEN' (or set {SERVE_TOKEN_ENV})")
    serve.set_defaults(handler=cmd_serve)


def add_backend_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", metavar="URL", default=None,
                        help="an OpenAI-compatible server, e.g. http://host:8000/v1 (the key "
                             "comes from PHASEWISE_API_KEY or the OS keyring)")
    parser.add_argument("--backend-model", metavar="NAME", default=None,
                        help="model name on the backend (default: the first it lists)")


class _Stopped(Exception):
    """SIGTERM reached `serve`: stop as Ctrl+C does."""


def _raise_stopped(*_: object) -> None:
    raise _Stopped


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until Ctrl+C or SIGTERM, either of which is the normal end of a server (exit 0):
    uvicorn drains, the engine thread is joined, the model freed."""
    from app.serve import check_bind
    from engine import PhasewiseError

    try:
        check_bind(args.host, args.token)
    except PhasewiseError as exc:
        raise CliError(str(exc)) from None
    # uvicorn handles both signals while it runs, then raises them again: they land here.
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        _serve(args)
    except (_Stopped, KeyboardInterrupt):
        print("phasewise: server stopped", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _serve(args: argparse.Namespace) -> None:
    from app.serve import create_app, uvicorn_server
    from engine import ModelLoadError
    from engine.worker import Engine

    with Engine() as engine:
        try:
            info = engine.load_model_sync(
                args.model, kernel=args.kernel, engine=args.engine, device=args.device,
                dtype=args.dtype, context_length=args.context,
                allow_download=args.allow_download, allow_pickle=args.allow_pickle)
        except ModelLoadError as exc:
            raise CliError(str(exc)) from None

        def announce() -> None:
            print(f"phasewise: serving {info.name} at http://{args.host}:{args.port}/v1 "
                  f"(Ctrl+C stops)", file=sys.stderr, flush=True)

        app = create_app(engine, token=args.token)
        uvicorn_server(app, args.host, args.port, on_started=announce).run()


def open_engine(args: argparse.Namespace) -> Backend:
    """A started-on-enter Engine, or a RemoteEngine when --backend is given."""
    from engine import PhasewiseError
    from engine.worker import Engine

    if not args.backend:
        return Engine()
    from engine.remote import RemoteConfig, RemoteEngine, resolve_api_key

    try:
        config = RemoteConfig(args.backend, model=args.backend_model,
                              api_key=resolve_api_key(args.backend))
    except PhasewiseError as exc:
        raise CliError(str(exc)) from None
    return RemoteEngine(config)


def report_remote_outcome(result: Any) -> bool:
    """Print a remote reply's error or notice on stderr; True when it ended in an error."""
    if result.error:
        print(f"phasewise: error: {result.error} (the partial reply is above)",
              file=sys.stderr)
    elif result.notice:
        print(f"phasewise: note: {result.notice}", file=sys.stderr)
    return bool(result.error)


def bench_remote(args: argparse.Namespace) -> int:
    """`bench --backend URL`: TTFT, ITL and decode speed as measured at this client."""
    import json
    import statistics

    from engine import (
        ChatMessage,
        GenerationRequest,
        ModelLoadError,
        PhasewiseError,
        SamplingParams,
    )

    runs = []
    with open_engine(args) as engine:
        try:
            info = engine.load_model_sync(timeout=60)
        except ModelLoadError as exc:
            raise CliError(str(exc)) from None
        for i in range(args.repeats):
            # A unique opening per run, so the server's prefix cache cannot serve it.
            prompt = f"[run {i}] " + "Tell me about the history of computing. " * max(
                1, args.prompt_tokens // 8)
            request = GenerationRequest(
                [ChatMessage("user", prompt)],
                SamplingParams(temperature=0, max_tokens=args.max_tokens))
            try:
                result = engine.submit(request).wait()
            except PhasewiseError as exc:
                raise CliError(str(exc)) from None
            if result.error:
                raise CliError(result.error)
            runs.append(result.metrics)

    def median(name: str) -> float:
        return statistics.median(getattr(m, name) for m in runs)

    report = {"model": info.name, "backend": info.path, "repeats": args.repeats,
              "max_tokens": args.max_tokens,
              "prompt_tokens": runs[-1].prompt_tokens if runs[-1].prompt_tokens_known else None,
              **{k: median(k) for k in ("ttft_s", "decode_tok_s", "itl_p50_s", "itl_p90_s",
                                        "itl_p99_s", "e2e_s", "output_tokens")}}
    print(f"\n{info.name} at {info.path}; {args.max_tokens} tokens max, median of "
          f"{args.repeats} (client-side stamps)")
    print(f"  TTFT                 {report['ttft_s'] * 1e3:.1f} ms")
    print(f"  decode               {report['decode_tok_s']:.1f} tok/s")
    print(f"  ITL p50 / p90 / p99  {report['itl_p50_s'] * 1e3:.1f} / "
          f"{report['itl_p90_s'] * 1e3:.1f} / {report['itl_p99_s'] * 1e3:.1f} ms")
    if args.json:
        print(json.dumps(report))
    return 0
