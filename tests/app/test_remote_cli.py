"""`ask` / `bench --backend URL` against real servers on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

from app.cli import main
from app.serve import ServerThread
from tests.support.fake_servers import PARTIAL, fake_app


@pytest.fixture(autouse=True)
def no_keyring(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the user's keyring out of tests; the key comes from the environment."""
    monkeypatch.setenv("PHASEWISE_API_KEY", "test-key")


def test_ask_through_backend_matches_local(capsys, phasewise_server: ServerThread,
                                           served_engine) -> None:
    code = main(["ask", "--backend", phasewise_server.base_url, "--json", "--temperature", "0",
                 "--max-tokens", "6", "Hello"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out.strip().splitlines()[-1])
    assert data["model"] == served_engine.model_info.name
    assert data["device"].startswith("remote 127.0.0.1:")
    assert data["prompt_tokens_known"] and data["prompt_tokens"] > 0
    assert data["output_tokens"] >= 1 and len(data["itl_s"]) == data["output_tokens"] - 1


def test_ask_keeps_the_partial_reply_on_a_mid_stream_error(capsys) -> None:
    with ServerThread(fake_app("error_mid_stream")) as server:
        code = main(["ask", "--backend", server.base_url, "Hello"])
    out, err = capsys.readouterr()
    assert code == 1
    assert out.startswith("".join(PARTIAL))
    assert err.count("\n") == 1 and "CUDA out of memory" in err


def test_ask_unreachable_backend_is_one_line(capsys) -> None:
    code = main(["ask", "--backend", "http://127.0.0.1:9/v1", "Hello"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and "cannot reach http://127.0.0.1:9/v1" in err


def test_bench_through_backend(capsys, phasewise_server: ServerThread) -> None:
    code = main(["bench", "--backend", phasewise_server.base_url, "--repeats", "1",
                 "--max-tokens", "4", "--prompt-tokens", "16", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["repeats"] == 1 and report["prompt_tokens"] > 0
    assert report["ttft_s"] > 0
