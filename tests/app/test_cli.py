"""`phasewise ask` and `phasewise bench`: output contract and one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ask_json_has_every_field(capsys, tiny_model_dir: Path) -> None:
    code, out, _ = run_cli(capsys, "ask", "--model", str(tiny_model_dir), "--json",
                           "--temperature", "0", "--max-tokens", "5", "Hello")
    assert code == 0
    data = json.loads(out.strip().splitlines()[-1])
    for key in ("text", "finish_reason", "prompt_tokens", "cached_tokens", "prefilled_tokens",
                "output_tokens", "queue_s", "prefill_s", "ttft_s", "decode_s", "e2e_s",
                "decode_tok_s", "itl_s", "prompt_token_ids", "model", "device", "dtype",
                "kernel", "cache_miss_reason"):
        assert key in data, key
    assert data["prompt_tokens"] == data["cached_tokens"] + data["prefilled_tokens"]
    assert data["prompt_tokens"] == len(data["prompt_token_ids"])
    assert len(data["itl_s"]) == max(data["output_tokens"] - 1, 0)
    assert data["finish_reason"] in ("stop", "length")


def test_bench_json_vs_hf(capsys, tiny_model_dir: Path) -> None:
    code, out, _ = run_cli(capsys, "bench", "--model", str(tiny_model_dir), "--json",
                           "--vs", "hf", "--max-tokens", "8", "--prompt-tokens", "16",
                           "--repeats", "1")
    assert code == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert report["decode_tok_s"] > 0 and report["hf_decode_tok_s"] > 0
    assert report["decode_ratio_vs_hf"] == pytest.approx(
        report["decode_tok_s"] / report["hf_decode_tok_s"])
    assert "decode ratio vs generate()" in out


def test_bench_turns_json(capsys, tiny_model_dir: Path) -> None:
    code, out, _ = run_cli(capsys, "bench", "--model", str(tiny_model_dir), "--json",
                           "--turns", "2", "--max-tokens", "8")
    assert code == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert len(report["turns"]) == 2
    assert report["turns"][1]["cached_tokens"] > 0
    assert report["cold_ttft_s_last_prompt"] > 0


def test_bench_interference_table_and_json(capsys, tiny_model_dir: Path) -> None:
    code, out, _ = run_cli(capsys, "bench", "--model", str(tiny_model_dir), "--json",
                           "--interference", "--prompt-tokens", "40")
    assert code == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert report["rounds"] == 1  # by default: a round is minutes on a real model (its --help)
    for mode in report["modes"]:
        assert report[f"{mode}_itl_p99_alone_s"] > 0
        assert report[f"{mode}_itl_p99_before_prefill_s"] > 0
    assert "whole prefill between two steps" in out
    assert "ITL p99 of its tokens before the prompt came" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ask", "--max-tokens", "0", "hi"], "max tokens must be >= 1"),
        (["ask", "--max-tokens", "-5", "hi"], "max tokens must be >= 1"),
        (["ask", "--temperature", "-1", "hi"], "temperature must be >= 0"),
        (["ask", "--top-p", "0", "hi"], "top-p must be in (0, 1]"),
        (["ask", "--top-p", "1.5", "hi"], "top-p must be in (0, 1]"),
        (["ask", "   "], "prompt is empty"),
        (["ask", "--seed", "99999999999999999999999", "hi"], "seed must be from 0 to 2**63 - 1"),
        (["ask", "--seed", "-1", "hi"], "seed must be from 0 to 2**63 - 1"),
        (["ask", "--model", "/no/such/model", "hi"], "model not found"),
        (["ask", "--model", "someone/not-cached-model", "hi"], "--allow-download"),
    ],
)
def test_bad_input_is_one_line_non_zero(capsys, argv: list[str], message: str) -> None:
    code, _, err = run_cli(capsys, *argv)
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
    assert "Traceback" not in err


def test_folder_without_tokenizer_via_cli(capsys, tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "no-tok"
    folder.mkdir()
    (folder / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    code, _, err = run_cli(capsys, "ask", "--model", str(folder), "hi")
    assert code == 1 and "has no tokenizer" in err


def test_prompt_over_context_says_how_many_tokens_over(capsys, tiny_model_dir: Path) -> None:
    code, _, err = run_cli(capsys, "ask", "--model", str(tiny_model_dir), "word " * 400)
    assert code == 1
    assert "over the model's context of 256 tokens" in err
    assert len(err.strip().splitlines()) == 1


def test_a_context_over_the_models_says_what_it_runs_with(capsys, tiny_model_dir: Path) -> None:
    code, _, err = run_cli(capsys, "ask", "--model", str(tiny_model_dir), "--context", "100000",
                           "--max-tokens", "2", "hi")
    assert code == 0
    assert "supports 256 tokens of context; using 256 (asked for 100,000)" in err


def test_console_script_error_has_no_traceback(tmp_path: Path) -> None:
    bogus = tmp_path / "broken.gguf"
    bogus.write_bytes(b"GGUF" + b"\x00" * 64)
    proc = subprocess.run(
        [sys.executable, "-m", "app", "ask", "--model", str(bogus), "hi"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("phasewise: error:")
    assert "corrupt or truncated" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_ask_json_reports_kernel_and_speculation(capsys, tiny_model_dir: Path) -> None:
    code, out, _ = run_cli(capsys, "ask", "--model", str(tiny_model_dir), "--json",
                           "--kernel", "fp16-dynamic", "--speculative", "ngram",
                           "--temperature", "0", "--max-tokens", "24", "Hello Hello Hello")
    assert code == 0
    data = json.loads(out.strip().splitlines()[-1])
    assert data["kernel"] == "fp16-dynamic"
    assert data["speculative"] == "ngram"
    for key in ("spec_proposed", "spec_accepted", "spec_accept_rate"):
        assert key in data


def test_forcing_an_unavailable_kernel_is_one_line(capsys, tiny_model_dir: Path) -> None:
    code, _, err = run_cli(capsys, "ask", "--model", str(tiny_model_dir), "--kernel",
                           "bf16-eager", "hi")
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "bf16-eager needs bf16 weights" in lines[0]


def test_bench_batch_and_speculative_json(capsys, tiny_model_dir: Path) -> None:
    code, out, _ = run_cli(capsys, "bench", "--model", str(tiny_model_dir), "--json",
                           "--kernel", "fp32-eager", "--batch", "1", "2", "--max-tokens", "4",
                           "--prompt-tokens", "8", "--repeats", "1")
    assert code == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert [b["batch"] for b in report["batches"]] == [1, 2]
    assert all(b["total_tok_s"] > 0 for b in report["batches"])
    # every timed step decoded all B rows: the 3 steps after the prefill's token, no fewer
    assert [b["steps_timed"] for b in report["batches"]] == [3, 3]
    code, out, _ = run_cli(capsys, "bench", "--model", str(tiny_model_dir), "--json",
                           "--kernel", "fp32-eager", "--speculative", "--max-tokens", "16",
                           "--prompt-tokens", "32", "--repeats", "1")
    assert code == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert report["spec_output_identical"] is True
    assert report["spec_proposed"] >= report["spec_accepted"] >= 0
    assert "speculative (ngram)" in out
