"""What `phasewise serve` adds to a streaming request's time to first token.

    python benchmarks/serve_latency.py [--tree DIR] [--model default] [--requests 8] [--json]
                                       [-- SERVE_OPTION ...]

Starts `phasewise serve` (from the source tree DIR, default this one) in a child process on a
free loopback port, waits until it answers, then sends short greedy streaming chat requests
one after another from a raw socket client (one fresh connection each, HTTP/1.1, no client
library in the way). For each it takes the client's TTFT (request bytes sent -> the first
chunk with non-empty content read off the socket) and the server's own TTFT (the engine's,
submit -> first token, from the final usage chunk's `phasewise_timings`), and the server's
reported overhead (`phasewise_timings.server_overhead_s`, where the server reports one). The
difference is what the HTTP layer, the hand-offs between threads and the socket add. Prints
medians; the first request (warm-up) is not counted. To compare with an older commit, export
it (`git archive REV | tar -x -C DIR`) and pass --tree DIR. Measures only; asserts nothing.

--busy-engine MS serves a stand-in engine instead of a model: each of its steps emits a token and
then runs MS ms of pure Python (the GIL held), as an engine whose per-token work is Python does;
there the server's loop thread has to win the GIL back at each await on the way out, which is
what the hand-over in app/serve.py's EventRouter avoids. A loaded machine shows the same with
the real engine (run two `python -c "while 1: pass"` beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "What is the capital of France? Answer in one word."
BUSY_ENGINE = """
import sys, threading, time
from app.serve import ServerThread, create_app
from engine.events import GenerationResult, ModelInfo, RequestFinished, TokenEmitted
from engine.metrics import RequestTimeline, compute_metrics

class BusyEngine:
    model_info = ModelInfo("busy", "default", "busy", "cpu", "fp32", 512, 1, 1, "none")
    def __init__(self): self.listeners = []
    def add_listener(self, listener): self.listeners.append(listener)
    def cancel(self, request_id): pass
    def submit(self, request):
        threading.Thread(target=self.run, args=(request.request_id,), daemon=True).start()
    def emit(self, event):
        for listener in self.listeners: listener(event)
    def run(self, rid):
        tl = RequestTimeline(submitted_ns=time.perf_counter_ns())
        tl.prefill_start_ns = tl.first_logits_ns = tl.submitted_ns
        for i in range(8):
            tl.token_ns.append(time.perf_counter_ns())
            self.emit(TokenEmitted(rid, tl.token_ns[-1], i, 1, " word"))
            end = time.perf_counter() + STEP_S  # the step's Python work, the GIL held
            while time.perf_counter() < end: pass
        tl.done_ns = time.perf_counter_ns()
        metrics = compute_metrics(tl, prompt_tokens=1, cached_tokens=0, parameters=1,
                                  weight_bytes_per_step=1, cache_miss_reason="cold")
        self.emit(RequestFinished(rid, tl.done_ns, GenerationResult(
            rid, " word" * 8, "stop", [1] * 8, [1], metrics)))

STEP_S = float(sys.argv[1]) / 1e3
server = ServerThread(create_app(BusyEngine()), port=int(sys.argv[2])).start()
print("serving", flush=True)
sys.stdin.read()  # until the parent closes it
server.stop()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_request(port: int, path: str, body: dict | None = None) -> bytes:
    data = b"" if body is None else json.dumps(body).encode()
    method = "GET" if body is None else "POST"
    head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode() + data


def wait_ready(port: int, server: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"serve exited with {server.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(http_request(port, "/v1/models"))
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("serve did not come up")


def one_request(port: int, index: int, max_tokens: int) -> dict[str, float]:
    body = {"model": "x", "stream": True, "temperature": 0, "max_tokens": max_tokens,
            "stream_options": {"include_usage": True},
            # a unique opening, so the prefix cache serves no request from another's prompt
            "messages": [{"role": "user", "content": f"[{index}] {PROMPT}"}]}
    payload = http_request(port, "/v1/chat/completions", body)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        s.sendall(payload)
        first: float | None = None
        received = b""
        while True:
            data = s.recv(65536)
            if not data:
                break
            received += data
            if first is None and b'"content":"' in received.replace(b'"content":""', b""):
                first = time.perf_counter()
    if first is None:
        raise SystemExit(f"no content in the reply: {received[:400]!r}")
    timings: dict = {}
    for line in received.split(b"\n"):
        if line.startswith(b"data: {") and b"phasewise_timings" in line:
            timings = json.loads(line[6:])["phasewise_timings"]
    client = first - start
    return {"client_ttft_s": client, "server_ttft_s": timings["ttft_s"],
            "added_s": client - timings["ttft_s"],
            "reported_overhead_s": timings.get("server_overhead_s", float("nan"))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--model", default="default")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--busy-engine", type=float, metavar="MS", default=None,
                        help="serve a stand-in engine whose steps are MS ms of Python work")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("serve_args", nargs="*", help="more `serve` options, after --")
    args = parser.parse_args()
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(args.tree))
    if args.busy_engine is None:
        command = [sys.executable, "-m", "app", "serve", "--model", args.model, "--port",
                   str(port), *args.serve_args]
    else:
        command = [sys.executable, "-c", BUSY_ENGINE, str(args.busy_engine), str(port)]
    server = subprocess.Popen(command, cwd=args.tree, env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    try:
        wait_ready(port, server)
        one_request(port, 0, args.max_tokens)  # warm-up, not counted
        runs = [one_request(port, i, args.max_tokens) for i in range(1, args.requests + 1)]
    finally:
        server.terminate()
        server.communicate(timeout=30)
    medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"{args.tree}: {len(runs)} streaming requests, median ms")
    for key, value in medians.items():
        print(f"  {key:22s} {value * 1e3:7.1f}")
    print("  added per request      " + " ".join(f"{r['added_s'] * 1e3:.1f}" for r in runs))
    if args.json:
        print(json.dumps({"tree": str(args.tree), "runs": runs, "medians": medians}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
