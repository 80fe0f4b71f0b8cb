"""The command line: --help/--version, one-line errors for bad input, and a real `continue` run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli_helpers import one_line_error

from kvcli.cli import app

runner = CliRunner()
KVCLI = [sys.executable, "-c", "from kvcli.cli import main; main()"]


def test_help_and_version():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0 and "continue" in r.stdout
    r = runner.invoke(app, ["continue", "--help"])
    assert r.exit_code == 0 and "--kv-budget" in r.stdout and "--truncate" in r.stdout
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.startswith("kvcli ")


@pytest.mark.parametrize("columns", [80, 100, "rich"])
def test_help_never_cuts_an_option_name(columns):
    """Every command's --help shows each option's names in full: at 80 and 100 columns (click's plain layout:
    typer's rich table cut "--repetition-pe…" there) and at the narrowest width that keeps the rich table."""
    import typer

    from kvcli.cli_help import RICH_HELP_MIN_COLUMNS

    width = RICH_HELP_MIN_COLUMNS if columns == "rich" else columns
    for name, command in typer.main.get_command(app).commands.items():
        r = runner.invoke(app, [name, "--help"], env={"COLUMNS": str(width)})
        assert r.exit_code == 0, (name, r.output)
        assert "…" not in r.stdout, (name, width, [line for line in r.stdout.splitlines() if "…" in line])
        assert ("╭" in r.stdout) == (columns == "rich"), (name, width)  # which layout ran
        for p in command.params:
            for opt in (*p.opts, *p.secondary_opts):
                if opt.startswith("--"):
                    assert opt in r.stdout, (name, width, opt)


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, Path]:
    f = {
        "empty": tmp_path / "empty.txt",
        "blank": tmp_path / "blank.txt",
        "binary": tmp_path / "blob.bin",
        "late_nul": tmp_path / "late.txt",
        "latin1": tmp_path / "latin1.txt",
        "dir": tmp_path / "folder",
        "ok": tmp_path / "ok.txt",
    }
    f["empty"].write_bytes(b"")
    f["blank"].write_text("  \n\n")
    f["binary"].write_bytes(bytes(range(256)) * 4)
    f["late_nul"].write_bytes(b"plain text " * 1000 + b"\x00" + b"more text")  # past the first 8 KiB
    f["latin1"].write_bytes("caf\xe9 au lait".encode("latin-1"))
    f["dir"].mkdir()
    f["ok"].write_text("Once upon a time")
    return f


@pytest.mark.parametrize("kind,needle", [
    ("missing", "no such file"), ("empty", "empty"), ("blank", "only whitespace"), ("binary", "binary"),
    ("late_nul", "a NUL byte at 11,000"), ("latin1", "not valid UTF-8"), ("dir", "directory"),
])
def test_bad_input_files(files, tmp_path, kind, needle):
    path = files.get(kind, tmp_path / "nope.txt")
    one_line_error(runner.invoke(app, ["continue", str(path)]), needle)


@pytest.mark.parametrize("args,needle", [
    (["--max-tokens", "0"], "--max-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--block-size", "0"], "--block-size"),
    (["--block-size", "-16"], "--block-size"),
    (["--block-size", "24"], "--block-size"),
    (["--kv-budget", "lots"], "--kv-budget"),
    (["-o", "/nonexistent-dir/out.txt"], "does not exist"),
    (["--model", "/nonexistent/model.gguf"], "model not found"),
    (["--model", "dummy:gpt-17"], "unknown dummy preset"),
])
def test_bad_flags(files, args, needle):
    one_line_error(runner.invoke(app, ["continue", str(files["ok"]), *args]), needle)


def test_a_failed_run_leaves_no_empty_output_file(files, tmp_path):
    """-o is checked writable before the run; a run refused after that check (here: a budget too small for the
    text) creates no empty file."""
    out = tmp_path / "out.txt"
    one_line_error(runner.invoke(app, ["continue", str(files["ok"]), "-o", str(out), "--kv-budget", "1KiB"]),
                   "--kv-budget")
    assert not out.exists()


def test_corrupt_gguf(files, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(200))
    one_line_error(runner.invoke(app, ["continue", str(files["ok"]), "--model", str(bad)]), "broken.gguf")


def test_dummy_model_budget_too_small(files):
    r = runner.invoke(app, ["continue", str(files["ok"]), "--model", "dummy:smollm2-135m", "--kv-budget", "100KB"])
    one_line_error(r, "holds no KV block")


@pytest.mark.slow
def test_continue_json_and_output_file(tmp_path):
    src = Path(__file__).resolve().parents[1] / "samples" / "keepers-log.txt"
    out = tmp_path / "cont.txt"
    p = subprocess.run([*KVCLI, "continue", str(src), "-n", "24", "--json", "-o", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)  # nothing but the JSON on stdout
    assert len(report["generated_token_ids"]) == 24
    assert report["finish_reason"] == "length"
    assert report["prompt_tokens"] > 3000
    assert out.read_text() == report["text"] and report["text"].strip()
    m = report["metrics"]
    assert m["prompt_tokens"] == report["prompt_tokens"] and m["generated_tokens"] == 24
    assert m["kv"]["peak_blocks_used"] == -(-(report["prompt_tokens"] + 24 - 1) // 16)
    assert m["weight_bytes"]["layers"] > 0 and m["prefill_tok_s"] > 0 and m["decode_tok_s"] > 0


@pytest.mark.slow
def test_context_overflow_error_and_truncate(tmp_path):
    src = Path(__file__).resolve().parents[1] / "samples" / "keepers-log.txt"
    # The default streams a long text through the bounded cache (tests/test_kv_window_cli.py);
    # --kv-window none asks for the error instead.
    p = subprocess.run([*KVCLI, "continue", str(src), "-n", "8", "--max-model-len", "1024", "--kv-window", "none"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert "tokens" in last and "1,016 fit" in last and "--truncate head" in last
    p = subprocess.run([*KVCLI, "continue", str(src), "-n", "8", "--max-model-len", "1024", "--truncate",
                        "head", "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["truncated"] and report["prompt_tokens"] == 1016


def test_gguf_with_unsupported_architecture(files, tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    one_line_error(runner.invoke(app, ["continue", str(files["ok"]), "--model", str(path)]),
                   "unsupported architecture 'gpt2'")


def test_budget_too_small_for_the_prompt(tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("word " * 400)  # ~2,000 byte-level tokens for a dummy model
    # A few blocks of 16 tokens (fp32 SmolLM2 shapes: 737,280 B per block) cannot hold the prompt.
    r = runner.invoke(app, ["continue", str(long), "--model", "dummy:smollm2-135m", "--kv-budget", "1474560",
                            "--no-live"])
    one_line_error(r, "raise --kv-budget")


def test_perplexity_past_the_pool_says_what_fits_and_what_to_change(tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("word " * 400)
    r = runner.invoke(app, ["perplexity", str(long), "--kv-budget", "1MiB"])
    one_line_error(r, "the KV pool holds 16 tokens of one sequence, not 401")  # 1 MiB: 2 blocks, one the null
    assert "--window / --stride" in r.stderr and "--kv-window" in r.stderr
