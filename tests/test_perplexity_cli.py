"""`kvcli perplexity`: window arithmetic, the JSON report, and one-line errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli_helpers import one_line_error
from kvcli.cli import app
from kvcli.engine.perplexity import Window, windows
from kvcli.options import ConfigError

runner = CliRunner()


def test_windows_score_every_token_but_the_first_once():
    assert windows(10, 10, 10) == [Window(0, 10, 1)]
    assert windows(25, 10, 10) == [Window(0, 10, 1), Window(10, 20, 11), Window(20, 25, 21)]
    # Overlapping: later windows score only tokens past the previous window's end.
    ws = windows(25, 10, 4)
    assert ws[0] == Window(0, 10, 1) and ws[1] == Window(4, 14, 10)
    scored = [t for w in ws for t in range(w.first_scored, w.end)]
    assert scored == list(range(1, 25))
    with pytest.raises(ConfigError, match="--stride"):
        windows(25, 10, 11)
    with pytest.raises(ConfigError, match="at least 2"):
        windows(1, 10, 10)


def test_perplexity_json_report_int8(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The keeper climbed the stairs to the lamp room and lit the lamp. " * 12)
    r = runner.invoke(app, ["perplexity", str(text), "--kv-dtype", "int8", "--window", "64", "--stride", "32",
                            "--json", "--kv-budget", "16MiB"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["kv_dtype"] == "int8" and d["kv_bytes_per_token"] == 2 * 30 * 3 * 68
    assert d["tokens_scored"] == d["tokens_total"] - 1 and d["windows"] > 1
    assert 1 < d["perplexity"] < 50 and abs(d["perplexity"] - 2.718281828 ** d["mean_nll"]) < 1e-6 * d["perplexity"]


@pytest.mark.parametrize(("args", "needle"), [
    (["--stride", "0"], "--stride must be a positive integer"),
    (["--window", "1"], "--window must be at least 2"),
    (["--kv-dtype", "q4"], "--kv-dtype must be one of"),
])
def test_perplexity_bad_flags(tmp_path, args, needle):
    text = tmp_path / "t.txt"
    text.write_text("Some text to score, long enough for a few tokens.")
    one_line_error(runner.invoke(app, ["perplexity", str(text), *args]), needle)


def test_perplexity_missing_file(tmp_path):
    one_line_error(runner.invoke(app, ["perplexity", str(tmp_path / "nope.txt")]), "no such file")
