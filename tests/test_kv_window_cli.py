"""The bounded KV cache from the command line (issue #27): `continue` streams a text longer than the context,
`perplexity --kv-window` scores a text as one stream (peak KV measured), `chat` goes on past the context."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli_helpers import one_line_error
from kvcli.cli import app

runner = CliRunner()
SAMPLES = Path(__file__).resolve().parents[1] / "samples"


@pytest.fixture(scope="module")
def novel(tmp_path_factory) -> Path:
    """About 24,000 tokens of the bundled model: the samples, twice over."""
    a = (SAMPLES / "keepers-log.txt").read_text(encoding="utf-8")
    b = (SAMPLES / "heldout-gpl-3.0.txt").read_text(encoding="utf-8")
    path = tmp_path_factory.mktemp("novel") / "novel.txt"
    path.write_text((a + "\n\n" + b + "\n\n") * 2, encoding="utf-8")
    return path


def test_continue_streams_a_text_far_longer_than_the_context(novel):
    r = runner.invoke(app, ["continue", str(novel), "-n", "4", "--max-model-len", "1024", "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["prompt_tokens"] == d["text_tokens"] > 20_000 and not d["truncated"]
    assert len(d["generated_token_ids"]) == 4 and d["finish_reason"] == "length"
    assert d["kv_window"] == 1024 - 16 - 16 and d["sink_tokens"] == 4  # auto: context - sink block - max(n, block)
    # everything but the sink block and the window (W to W + 15 tokens) was dropped as it streamed
    kept = d["prompt_tokens"] + 4 - 1 - d["dropped_tokens"]
    assert 16 + d["kv_window"] <= kept <= 16 + d["kv_window"] + 15
    assert d["metrics"]["kv"]["peak_blocks_used"] * 16 <= 16 + d["kv_window"] + 31  # blocks, measured


def test_continue_says_what_it_keeps_and_the_old_error_stays(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text((SAMPLES / "keepers-log.txt").read_text(encoding="utf-8")[:4000], encoding="utf-8")
    r = runner.invoke(app, ["continue", str(text), "-n", "3", "--max-model-len", "512", "--no-live"])
    assert r.exit_code == 0, r.stderr
    note = [line for line in r.stderr.splitlines() if "--kv-window" in line]
    assert note and "the first 16" in r.stderr and "--sink-tokens 4" in r.stderr
    assert "tokens dropped" in r.stderr  # the summary's bounded-KV row
    one_line_error(runner.invoke(app, ["continue", str(text), "-n", "3", "--max-model-len", "512",
                                       "--kv-window", "none", "--no-live"]), "--truncate head")
    one_line_error(runner.invoke(app, ["continue", str(text), "-n", "3", "--max-model-len", "512",
                                       "--kv-window", "600", "--no-live"]), "must fit the 512-token context")
    # a pool too small for the window: said in the flags that change it, not in the engine's request ids
    err = one_line_error(runner.invoke(app, ["continue", str(text), "-n", "3", "--kv-window", "256", "--kv-budget",
                                             "2MiB", "--no-live"]), "raise --kv-budget or lower --kv-window")
    assert "r0" not in err and "holds 4 blocks of 16 tokens" in err and "--kv-window 256 needs 18" in err
    one_line_error(runner.invoke(app, ["continue", str(text), "-n", "3", "--truncate", "head", "--kv-budget",
                                       "2MiB", "--no-live"]), "shorten the prompt or ask for fewer tokens")
    r = runner.invoke(app, ["continue", str(text), "-n", "3", "--max-model-len", "512", "--truncate", "head",
                            "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["truncated"] and json.loads(r.stdout)["kv_window"] is None


def perplexity_json(text: Path, *args: str) -> dict:
    r = runner.invoke(app, ["perplexity", str(text), "--json", "--max-model-len", "512", "--kv-dtype", "fp32",
                            "--max-batch-tokens", "128", *args])
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("sinks", [16, 4])
def test_perplexity_one_stream_holds_at_most_sinks_window_and_a_block(tmp_path, sinks):
    text = tmp_path / "t.txt"
    text.write_text((SAMPLES / "keepers-log.txt").read_text(encoding="utf-8")[:6000], encoding="utf-8")
    d = perplexity_json(text, "--kv-window", "200", "--sink-tokens", str(sinks))
    assert d["tokens_total"] > 1200 and d["tokens_scored"] == d["tokens_total"] - 1
    assert d["kv_window"] == 200 and d["sink_tokens"] == sinks
    sink_slots = -(-sinks // 16) * 16
    assert 200 <= d["kv_tokens_peak"] <= sink_slots + 200 + 15
    if sinks == 16:
        assert d["kv_tokens_peak"] <= sinks + 200 + 16  # S + W + one block, S a whole block
    assert d["perplexity"] > 1


def test_perplexity_with_a_window_longer_than_the_text_equals_the_plain_run(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text((SAMPLES / "keepers-log.txt").read_text(encoding="utf-8")[:1500], encoding="utf-8")
    plain = perplexity_json(text)
    windowed = perplexity_json(text, "--kv-window", "480")
    assert plain["tokens_total"] < 480
    assert windowed["perplexity"] == plain["perplexity"] and windowed["tokens_scored"] == plain["tokens_scored"]
    assert windowed["kv_tokens_peak"] == plain["tokens_total"]
    one_line_error(runner.invoke(app, ["perplexity", str(text), "--kv-window", "100", "--window", "64"]),
                   "give one")


@pytest.mark.parametrize("system", [["--system", "You are a terse assistant who answers about the sea and "
                                                "lighthouses in detail."], []], ids=["--system", "template's own"])
def test_chat_goes_on_past_the_context_with_the_system_prompt_among_the_sinks(system):
    """Given or the template's own (SmolLM2's inserts "You are a helpful AI assistant named SmolLM...", 24 tokens
    with the user header), the system prompt stays among the sinks: --sink-tokens grows to cover it."""
    lines = ["Tell me about lighthouses.", "And the keepers?", "What did they eat?", "How did they sleep?",
             "Which one is the oldest?"]
    p = subprocess.run([str(Path(sys.executable).with_name("kvcli")), "chat", *system,
                        "--max-model-len", "256", "-n", "60", "--temperature", "0", "--kv-dtype", "fp32"],
                       input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    status = [line for line in p.stderr.splitlines() if "prompt tokens ·" in line]
    assert len(status) == 5
    assert "tokens dropped" in status[-1] and "32 sink" in status[-1]  # the system prompt (24-30 tokens) in 2 blocks
    assert int(status[-1].split(" prompt tokens")[0].split()[-1].replace(",", "")) > 256  # past the context


@pytest.mark.slow
def test_the_scenario_a_chinese_text_of_12000_characters_with_the_default_flags():
    """Issue #27's scenario: ~12,000 characters of Chinese are ~21k tokens, 2.5x the bundled model's context;
    with the default flags `continue` streams them through the bounded cache and writes --max-tokens tokens."""
    text = SAMPLES / "lunyu-zh.txt"
    assert 11_000 <= len(text.read_text(encoding="utf-8")) <= 13_000
    p = subprocess.run([sys.executable, "-c", "from kvcli.cli import main; main()", "continue", str(text), "-n", "24",
                        "--seed", "1", "--json"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["prompt_tokens"] == d["text_tokens"] > 2 * 8192 and not d["truncated"]
    assert len(d["generated_token_ids"]) == 24 and d["finish_reason"] == "length"
    assert d["dropped_tokens"] > d["prompt_tokens"] - 8192 and d["kv_window"] == 8192 - 16 - 24
