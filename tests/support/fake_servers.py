"""Small misbehaving OpenAI-compatible servers for the remote backend's fault tests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

PARTIAL = ["Hello", " there"]
FAULTS = ("unauthorized", "error_mid_stream", "malformed", "stall", "no_usage",
          "server_error", "not_sse")


def _chunk(delta: dict, reason: str | None = None) -> str:
    body = {"id": "c", "object": "chat.completion.chunk", "model": "fake",
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}
    return f"data: {json.dumps(body)}\n\n"


async def _partial() -> AsyncIterator[str]:
    yield _chunk({"role": "assistant", "content": ""})
    for text in PARTIAL:
        yield _chunk({"content": text})


def fake_app(fault: str) -> Starlette:
    """An app that lists one model, 'fake', and answers chats with the given fault."""

    async def models(_request: Request) -> Response:
        if fault == "unauthorized":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def chat(_request: Request) -> Response:
        if fault == "unauthorized":
            return JSONResponse({"error": {"message": "Incorrect API key"}}, status_code=401)
        if fault == "server_error":
            return JSONResponse({"error": {"message": "model crashed"}}, status_code=500)
        if fault == "not_sse":
            return Response("<html>proxy login</html>", media_type="text/html")
        return StreamingResponse(_stream(), media_type="text/event-stream")

    async def _stream() -> AsyncIterator[str]:
        async for part in _partial():
            yield part
        if fault == "error_mid_stream":
            yield 'data: {"error": {"message": "CUDA out of memory", "type": "server_error"}}\n\n'
        elif fault == "malformed":
            yield "data: {this is not json\n\n"
        elif fault == "stall":
            await asyncio.sleep(3600)  # cancelled when the client hangs up
        elif fault == "no_usage":
            yield _chunk({}, "stop")
            yield "data: [DONE]\n\n"

    return Starlette(routes=[Route("/v1/models", models),
                             Route("/v1/chat/completions", chat, methods=["POST"])])
