"""`phasewise models`: search the Hugging Face hub for GGUF models (each quant with its size,
whether it fits, and how fast it would run here: engine/tools/speed.py), pull one into the models
folder (progress, Ctrl+C cancels, the same pull resumes), list and remove what is there.
engine/tools/hub.py does the work; this prints it.

Only `search` and `pull` reach the network, and only the hub at --endpoint (default:
HF_ENDPOINT or huggingface.co); HF_HUB_OFFLINE=1 keeps them offline with one line.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from app.cli_error import CliError

if TYPE_CHECKING:
    from engine.tools.hub import Hub, HubRepo, Progress
    from engine.tools.speed import EngineSpeed


def add_models_parser(sub: Any) -> None:
    models = sub.add_parser("models", help="find, download, list and remove GGUF models")
    models.set_defaults(handler=lambda _args: models.print_help() or 0)
    actions = models.add_subparsers(dest="models_command", metavar="ACTION")

    search = actions.add_parser("search", help="search the hub: repositories and their "
                                               "quant files with size and fit")
    search.add_argument("text", help="words of the repository's name, e.g. 'qwen 7b'")
    search.add_argument("--limit", type=int, default=5, help="repositories shown (default 5)")
    search.add_argument("--no-speed", action="store_true",
                        help="leave out the speed predicted on this computer (which measures "
                             "it once, the first time: up to a minute)")
    search.add_argument("--measure-again", action="store_true",
                        help="measure this computer again for the speed prediction (after a "
                             "measurement taken while it was busy, or an engine upgrade)")
    search.add_argument("--no-folders", action="store_true",
                        help="leave out Hugging Face folders (safetensors, for the torch "
                             "engine): GGUF repositories only")
    add_fit_options(search)
    search.set_defaults(handler=cmd_search)

    pull = actions.add_parser("pull", help="download a GGUF into the models folder "
                                           "(resumes an interrupted download)")
    pull.add_argument("spec", metavar="REPO[:FILE]",
                      help="a hub repository, and the file when it has several")
    pull.add_argument("--force", action="store_true",
                      help="download even when the estimate says it does not fit")
    add_fit_options(pull)
    pull.set_defaults(handler=cmd_pull)

    listing = actions.add_parser("list", help="the models folder: files and partial downloads")
    listing.set_defaults(handler=cmd_list)

    rm = actions.add_parser("rm", help="remove a model file or a partial download")
    rm.add_argument("name", help="its file name, as `phasewise models list` shows it")
    rm.add_argument("--yes", action="store_true", help="do not ask first")
    rm.set_defaults(handler=cmd_rm)


def add_fit_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context", type=int, default=None, metavar="TOKENS",
                        help="the context the fit is estimated at (default: the model's own, "
                             "8192 at most, as the llama.cpp engine allocates)")
    parser.add_argument("--endpoint", default=None, metavar="URL",
                        help="the hub's address (default: HF_ENDPOINT or huggingface.co)")


def _hub(args: argparse.Namespace) -> Hub:
    from engine.tools.hub import Hub

    return Hub(endpoint=args.endpoint)


def _fit_words(est: Any) -> str:
    verdict = "fits" if est.fits else "does not fit"
    words = f"{verdict}: needs ~{_size(est.needed_bytes)} at {est.context:,} tokens"
    if est.fitting_context:
        words += f" (fits at {est.fitting_context:,})"
    return words


def _size(n: int | None) -> str:
    from engine.tools.fit import size

    return size(n)


# ----- search ----------------------------------------------------------------------------
def cmd_search(args: argparse.Namespace) -> int:
    from engine.core.memory import free_memory
    from engine.tools.hub import HubError

    hub = _hub(args)
    args.measured = set()  # engines measured (again) in this search
    try:
        repos = hub.search(args.text, limit=max(1, args.limit))
        folders = [] if args.no_folders else hub.search_folders(args.text,
                                                                limit=max(1, args.limit))
    except HubError as exc:
        raise CliError(str(exc)) from None
    if not repos and not folders:
        print(f"no GGUF repositories or Hugging Face folders match {args.text!r}")
        return 0
    print(f"memory free: {_size(free_memory('cpu'))}")
    if repos:
        _print_gguf_repos(hub, repos, args)
    if folders:
        _print_folders(hub, folders, args)
    return 0


def _print_gguf_repos(hub: Hub, repos: list[HubRepo], args: argparse.Namespace) -> None:
    from engine.runtime_choice import gguf_engine
    from engine.tools.hub import HubError, iter_fits
    from engine.tools.speed import predict

    speed = _machine_speed(args, gguf_engine())
    if speed is not None:
        print(speed.describe())
    for repo in repos:
        print(f"\n{_repo_line(repo)}")
        try:
            files = hub.files(repo.id)
        except HubError as exc:
            print(f"  {exc}")
            continue
        if not files:
            print("  no GGUF model files")
        width = max((len(f.label) for f in files), default=0)
        for row in iter_fits(hub, sorted(files, key=lambda f: f.size), args.context):
            f = row.file
            verdict = _fit_words(row.estimate) if row.estimate is not None else row.why
            if speed is not None and row.cost is not None:
                verdict += f"; {predict(row.cost, speed).text()}"
            print(f"  {f.quant or '-':<8} {f.label:<{width}}  {_size(f.size):>8}  {verdict}")
    print(f"\ndownload one: phasewise models pull {repos[0].id}:FILE")


def _print_folders(hub: Hub, repos: list[HubRepo], args: argparse.Namespace) -> None:
    """Hugging Face folders: one row each, on the torch engine (which loads them by hub id)."""
    from engine.runtime_choice import TORCH
    from engine.tools.hub import HubError
    from engine.tools.speed import predict

    print("\nHugging Face folders (the torch engine loads them by hub id):")
    speed = _machine_speed(args, TORCH)
    if speed is not None:
        print(speed.describe())
    for repo in repos:
        print(f"\n{_repo_line(repo)}")
        try:
            row = hub.folder_fit(hub.folder(repo.id), args.context)
        except HubError as exc:
            print(f"  {exc}")
            continue
        verdict = _fit_words(row.estimate) if row.estimate is not None else row.why
        if speed is not None and row.cost is not None:
            verdict += f"; {predict(row.cost, speed).text()}"
        print(f"  {row.dtype or '-':<8} {row.folder.label}  {_size(row.folder.size):>8}  "
              f"{verdict}")
    print(f"\nload one: phasewise --model {repos[0].id} --allow-download")


def _repo_line(repo: HubRepo) -> str:
    gated = ", gated" if repo.gated else ""
    return f"{repo.id}  ({repo.downloads:,} downloads{gated})"


def _machine_speed(args: argparse.Namespace, engine: str) -> EngineSpeed | None:
    """This computer's measurement for `engine`: cached, or measured now (once; said on
    stderr); None with --no-speed or where it cannot be measured (one line)."""
    from engine.errors import PhasewiseError
    from engine.tools.speed import SpeedProfiles, speed_device

    if args.no_speed:
        return None
    device = speed_device(engine)
    profiles = SpeedProfiles()
    known = profiles.cached(engine, device)
    again = engine not in args.measured and (
        args.measure_again or (known is not None and known.worth_measuring_again()))
    if again or known is None:
        print(f"phasewise: measuring this computer once for the speed prediction: memory "
              f"bandwidth, then {engine} on the bundled model (up to a minute; cached after)",
              file=sys.stderr)
    try:
        return profiles.get(engine, device, again=again)
    except PhasewiseError as exc:
        print(f"phasewise: no speed prediction: {exc}", file=sys.stderr)
        return None
    finally:
        args.measured.add(engine)


# ----- pull --------------------------------------------------------------------------------
def cmd_pull(args: argparse.Namespace) -> int:
    from engine.tools.hub import HubError, check_absent

    repo, _, name = args.spec.partition(":")
    if repo.count("/") != 1:
        raise CliError(f"{args.spec!r} is not REPO[:FILE] (e.g. someone/Model-GGUF:model.Q4_K_M"
                       ".gguf)")
    hub = _hub(args)
    cancel = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: cancel.set())
    try:
        file = hub.file(repo, name or None)
        check_absent(file)  # before reading its header
        est = hub.estimate(file, args.context)
        print(f"phasewise: {file.label} ({_size(file.size)}): {_fit_words(est)}, "
              f"{_size(est.free_bytes)} free", file=sys.stderr)
        if not est.fits and not args.force:
            raise CliError(f"{est.refusal(file.local_name)}; --force downloads it anyway")
        path = hub.download(file, progress=ProgressPrinter(), cancel=cancel)
    except HubError as exc:
        raise CliError(str(exc)) from None
    finally:
        signal.signal(signal.SIGINT, previous)
    print(path)
    print(f"phasewise: downloaded and verified; chat with it: phasewise --model {path}",
          file=sys.stderr)
    return 0


class ProgressPrinter:
    """Bytes, rate and time left on stderr: rewritten in place on a terminal, a line every
    few seconds otherwise (a log), and always the last one."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.every = 0.5 if self.tty else 5.0
        self.last = 0.0

    def __call__(self, p: Progress) -> None:
        now = time.monotonic()
        finished = p.done >= p.total
        if not finished and now - self.last < self.every:
            return
        self.last = now
        if self.tty:
            end = "\n" if finished else ""
            print(f"\r  {p.line():<60}", end=end, file=sys.stderr, flush=True)
        else:
            print(f"  {p.line()}", file=sys.stderr, flush=True)


# ----- list / rm -----------------------------------------------------------------------------
def cmd_list(_args: argparse.Namespace) -> int:
    from engine.model_files import models_dir
    from engine.tools.hub import local_models

    folder = models_dir()
    try:
        models = local_models(folder)
    except OSError as exc:
        raise CliError(f"cannot read {folder}: {exc.strerror or exc}") from None
    print(f"models folder: {folder}")
    if not models:
        print("  no models yet: `phasewise models search TEXT`, then `phasewise models pull`")
    width = max((len(m.label) for m in models), default=0)
    for m in models:
        if m.partial:
            total = f" of {_size(m.total)}" if m.total else ""
            print(f"  {m.name:<{width}}  partial download: {_size(m.size)}{total} (the same "
                  "pull resumes it)")
        else:
            print(f"  {m.label:<{width}}  {_size(m.size):>8}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from engine.model_files import models_dir
    from engine.tools.hub import find_local, remove_local

    try:
        found = find_local(args.name)
    except OSError as exc:
        raise CliError(f"cannot read {models_dir()}: {exc.strerror or exc}") from None
    if not found:
        raise CliError(f"no model {args.name} in {models_dir()}; `phasewise models list` "
                       "shows them")
    for model in found:
        what = f"the partial download of {model.name}" if model.partial else model.name
        if not args.yes:
            if not sys.stdin.isatty():
                raise CliError(f"removing {what} asks first: pass --yes")
            answer = input(f"Remove {what} ({_size(model.size)})? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                print("kept")
                continue
        try:
            freed = remove_local(model)
        except OSError as exc:
            raise CliError(f"cannot remove {model.path}: {exc.strerror or exc}") from None
        print(f"removed {what}: {_size(freed)} freed")
    return 0
