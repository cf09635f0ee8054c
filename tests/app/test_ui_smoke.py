"""`phasewise --smoke-test`: the real window, the real default model, one greedy prompt."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.runtimes import resolve_engine


@pytest.mark.real_model
@pytest.mark.timeout(960)  # the child's own limit is 900 s (a first start converts the model)
def test_smoke_test_answers_through_the_gui(tmp_path) -> None:
    env = os.environ | {"QT_QPA_PLATFORM": "offscreen", "PHASEWISE_DATA_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "app", "--smoke-test"],
        capture_output=True, text=True, env=env, timeout=900, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert report["ok"] is True
    assert "Paris" in report["reply"]
    assert report["output_tokens"] >= 1 and report["ttft_s"] > 0
    assert report["decode_tok_s"] >= 0
    assert report["model"] and report["device"]
    # The engine `auto` picks for the user on this machine (llama.cpp without a GPU, when it
    # is installed) is the one that answered: the window did not fall back to another.
    assert report["engine"] == resolve_engine("default")
    assert not list(tmp_path.iterdir())  # the smoke test never touches the user's chats
