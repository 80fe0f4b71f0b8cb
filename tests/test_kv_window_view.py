"""A bounded KV cache, seen (issue #27, item 5): the dashboard's KV panel shows the window (S, W), the tokens
dropped and the blocks recycled; the block map marks the blocks the window gave back (free: ∘, held again: ▚);
`profile` runs traces with a window and reports its drops in the table and --json; `serve` takes the window
and counts dropped tokens in /metrics; `continue`'s report agrees with its own counts.

The engines are real: the scheduler and the paged layout run simulated (no model) where only memory is
looked at, and the bundled model where the command runs it."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import httpx
import pytest
from rich.console import Console
from typer.testing import CliRunner

from cli_helpers import one_line_error
from kvcli.cli import app
from kvcli.config import SamplingParams
from kvcli.engine.llm_engine import LLMEngine
from kvcli.metrics.snapshot import BlockMap
from kvcli.metrics.window import WindowTracker, with_window
from kvcli.model.loader import load_config, load_tokenizer
from kvcli.options import EngineOptions
from kvcli.view.block_map import RECYCLED, REUSED, render_block_map, state_counts
from kvcli.view.dashboard import render_dashboard
from kvcli.view.plain_log import format_log_line
from kvcli.view.summary import snapshot_dict, summary_table
from kvcli.workloads import from_jsonl, prompt_ids

runner = CliRunner()
BS = 16


def text_of(renderable, width: int = 120) -> str:
    c = Console(file=io.StringIO(), width=width, no_color=True, force_terminal=False)
    c.print(renderable)
    return c.file.getvalue()


def windowed_engine(budget: str, window: int = 48, sinks: int = 4) -> LLMEngine:
    """The scheduler and the paged layout of the bundled model's shape, without the model."""
    opts = EngineOptions(max_model_len=128, kv_window=window, sink_tokens=sinks, kv_budget=budget, block_size=BS)
    return LLMEngine(None, opts, config=load_config("dummy:smollm2-135m"))


def expected_dropped(computed: int, window: int, sink_slots: int = BS) -> int:
    """retention.py's rule, by hand: whole blocks leave the window's front until it holds W to W + 15 tokens."""
    over = computed - sink_slots - window
    return max(0, over // BS * BS) if over >= BS else 0


# -- the block map ---------------------------------------------------------------------------------------

def test_block_map_marks_recycled_blocks_free_and_held_again():
    # 8 blocks: a sink (never dropped), two re-used window blocks (one the partial head), a plain full one,
    # two recycled free blocks, one cached-free and one never used.
    bm = BlockMap(BS, owner=(0, -1, -1, 0, 0, 0, -2, -1), fill=(16, 0, 0, 16, 16, 7, 16, 0),
                  ref=(1, 0, 0, 1, 1, 1, 0, 0), owners=("r0",),
                  recycled=(False, True, True, True, False, True, False, False))
    grid = text_of(render_block_map(bm, width=8, height=2)).splitlines()
    assert grid[0] == f"█{RECYCLED}{RECYCLED}{REUSED}█▄░·"  # the partial head stays partial
    counts = state_counts(bm)
    assert counts == {"full": 2, "partial": 1, "shared": 0, "re-used": 1, "cached-free": 1, "recycled": 2, "free": 1}
    legend = "\n".join(grid[1:])
    assert f"{REUSED} re-used 1" in legend and f"{RECYCLED} recycled 2" in legend
    # Without a bounded cache the map and its legend are as before: no recycled states at all.
    plain = BlockMap(BS, bm.owner, bm.fill, bm.ref, bm.owners)
    out = text_of(render_block_map(plain, width=8, height=2))
    assert out.splitlines()[0] == "█··██▄░·" and "re-used" not in out and "recycled" not in out


def test_tracker_marks_exactly_the_blocks_the_window_gave_back():
    e = windowed_engine("64MiB")
    tracker = WindowTracker(e)
    req = e.add_request(list(range(1, 300)), SamplingParams(max_tokens=50, ignore_eos=True))
    given_back: set[int] = set()  # blocks that left the request's table while it ran
    last: list[int] = []
    sink = None
    while e.has_unfinished():
        e.step()
        tracker.observe()
        table = list(e.kv.block_table(req.req_id))
        if table:
            given_back |= set(last) - set(table)
            sink = table[0] if sink is None else sink
            assert table[0] == sink  # the sink block never leaves
            last = table
    assert given_back
    assert tracker.recycled == given_back
    dropped = e.scheduler.dropped_tokens(req)
    assert dropped == expected_dropped(299 + 50 - 1, 48) == e.kv.dropped_total
    assert e.kv.recycled_blocks == dropped // BS


def test_a_small_pool_shows_the_window_reusing_its_recycled_blocks():
    e = windowed_engine("4MiB")  # 10 blocks: the window's band wraps around the pool
    assert e.num_blocks == 10
    tracker = WindowTracker(e)
    e.add_request(list(range(1, 300)), SamplingParams(max_tokens=50, ignore_eos=True))
    reused = 0
    while e.has_unfinished():
        e.step()
        tracker.observe()
        s = tracker.snapshot(block_map=True)
        reused = max(reused, state_counts(s.blocks)["re-used"])
        if reused and state_counts(s.blocks)["recycled"]:
            break
    assert reused > 0, "the window never took back a block it had given back"
    grid = text_of(render_block_map(s.blocks, width=10, height=1)).splitlines()[0]
    assert REUSED in grid and (RECYCLED in grid or "░" in grid)
    assert s.window is not None and s.window.recycled_blocks > e.num_blocks - 4  # more than the pool's fresh blocks


def test_kv_panel_log_line_and_summary_show_the_window():
    e = windowed_engine("64MiB")
    tracker = WindowTracker(e)
    e.add_request(list(range(1, 300)), SamplingParams(max_tokens=50, ignore_eos=True))
    while e.has_unfinished():
        e.step()
        tracker.observe()
    s = tracker.snapshot(block_map=True)
    w = s.window
    assert (w.sink_tokens, w.sink_slots, w.window, w.max_slots) == (4, 16, 48, 16 + 48 + 15)
    assert w.dropped_tokens == 272 and w.recycled_blocks == 17 and 16 + 48 <= w.peak_tokens <= w.max_slots
    dash = text_of(render_dashboard(s, width=120, map_rows=4))
    assert "bounded KV: S 4 (16 sink slots) + W 48 · ≤ 79 tokens/request" in dash
    assert "272 tokens dropped · 17 blocks recycled" in dash
    # Of the 17 given back, the 2 written before the first drop stay in the prefix index (░, with the sink); the
    # window took the others straight back (a block with nothing indexed goes out again first), so the whole run
    # touched 6 of the 181 blocks: the last 3 shown recycled, 175 never used.
    assert f"░ cached-free 3   {RECYCLED} recycled 3   · free 175" in dash
    assert "272 tokens dropped, 17 blocks recycled" in format_log_line(s)
    summary = text_of(summary_table(s))
    assert "272 tokens dropped, 17 blocks recycled" in summary
    d = snapshot_dict(s)["window"]
    assert d["dropped_tokens"] == 272 and d["recycled_blocks"] == 17 and d["kv_window"] == 48
    # The same engine's plain snapshot has no window: the panel, the log line and the summary say nothing.
    plain = e.snapshot(block_map=True)
    assert plain.window is None and snapshot_dict(plain)["window"] is None
    assert "bounded KV" not in text_of(render_dashboard(plain, width=120, map_rows=4))
    assert "dropped" not in format_log_line(plain) and "bounded KV" not in text_of(summary_table(plain))
    assert with_window(plain, e).window == w  # the counters come from the layout, not the tracker


def test_an_unbounded_engine_tracks_nothing():
    e = LLMEngine(None, EngineOptions(max_model_len=128, kv_budget="4MiB"), config=load_config("dummy:smollm2-135m"))
    tracker = WindowTracker(e)
    e.add_request(list(range(1, 60)), SamplingParams(max_tokens=8, ignore_eos=True))
    while e.has_unfinished():
        e.step()
        tracker.observe()
    s = tracker.snapshot(block_map=True)
    assert s.window is None and s.blocks.recycled == () and not tracker.active


# -- profile ---------------------------------------------------------------------------------------------

def _trace(tmp_path, lengths: list[int], max_tokens: int) -> str:
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"prompt": " ".join(["word"] * n), "max_tokens": max_tokens}) + "\n"
                         for n in lengths))
    return str(f)


def test_profile_runs_a_trace_with_a_window_and_reports_its_drops(tmp_path):
    trace = _trace(tmp_path, [40, 8], 30)  # about 200 and 40 tokens of the dummy model's tokenizer
    js = tmp_path / "r.json"
    r = runner.invoke(app, ["profile", "--model", "dummy:smollm2-135m", "--simulate", "--no-live", "--workload",
                            trace, "--max-model-len", "256", "--kv-window", "64", "--json", str(js)])
    assert r.exit_code == 0, r.stderr
    run = json.loads(js.read_text())["runs"][0]
    assert run["completed"] == 2
    w = run["window"]
    assert (w["kv_window"], w["sink_tokens"], w["sink_slots"]) == (64, 4, 16)
    # Each request drops what the rule says for its length (the short one nothing).
    prompts = prompt_ids(from_jsonl(Path(trace)), load_tokenizer("dummy:smollm2-135m"))
    assert w["dropped_tokens"] == sum(expected_dropped(len(p) + 30 - 1, 64) for p in prompts) > 0
    assert w["recycled_blocks"] == w["dropped_tokens"] // BS
    assert 16 + 64 <= w["kv_tokens_peak"] <= w["max_slots"] == 16 + 64 + 15
    for row in ("bounded KV (S + W)", "tokens dropped", "blocks recycled"):
        assert row in r.stdout
    assert f"{w['dropped_tokens']:,}" in r.stdout
    # No window: no window in the report, and nothing dropped.
    r = runner.invoke(app, ["profile", "--model", "dummy:smollm2-135m", "--simulate", "--no-live", "--workload",
                            trace, "--max-model-len", "256", "--json", str(js)])
    assert r.exit_code == 0, r.stderr
    assert json.loads(js.read_text())["runs"][0]["window"] is None and "tokens dropped" not in r.stdout
    # A prompt longer than the context streams through a window, and is refused without one.
    long = _trace(tmp_path, [150], 10)
    base = ["profile", "--model", "dummy:smollm2-135m", "--simulate", "--no-live", "--workload", long,
            "--max-model-len", "256"]
    r = runner.invoke(app, [*base, "--kv-window", "64", "--json", str(js)])
    assert r.exit_code == 0, r.stderr
    assert json.loads(js.read_text())["runs"][0]["completed"] == 1
    one_line_error(runner.invoke(app, base), "--max-model-len is 256")


def test_profile_with_the_model_and_a_window(tmp_path):
    js = tmp_path / "r.json"
    r = runner.invoke(app, ["profile", "--no-live", "--workload", _trace(tmp_path, [70, 20], 24), "--max-model-len",
                            "128", "--kv-window", "32", "--json", str(js)])
    assert r.exit_code == 0, r.stderr
    run = json.loads(js.read_text())["runs"][0]
    assert run["completed"] == 2 and not run["simulated"]
    assert run["window"]["dropped_tokens"] > 0 and run["window"]["recycled_blocks"] * BS == run["window"]["dropped_tokens"]


@pytest.mark.parametrize("args,needle", [
    (["--kv-window", "0"], "--kv-window must be a positive number"),
    (["--kv-window", "300"], "must fit the 256-token context"),
    (["--kv-window", "64", "--sink-tokens", "-1"], "--sink-tokens"),
])
def test_profile_window_errors(args, needle):
    one_line_error(runner.invoke(app, ["profile", "--model", "dummy:smollm2-135m", "--simulate", "--no-live",
                                       "--max-model-len", "256", "-N", "2", *args]), needle)


# -- continue --------------------------------------------------------------------------------------------

def test_continue_report_and_json_agree_on_the_drops(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"line {i} of the log." for i in range(30)), encoding="utf-8")
    r = runner.invoke(app, ["continue", str(text), "-n", "4", "--max-model-len", "128", "--kv-window", "48", "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    w = d["metrics"]["window"]
    assert d["dropped_tokens"] == w["dropped_tokens"] == expected_dropped(d["prompt_tokens"] + 4 - 1, 48) > 0
    assert w["recycled_blocks"] == w["dropped_tokens"] // BS and w["kv_window"] == d["kv_window"] == 48
    r = runner.invoke(app, ["continue", str(text), "-n", "4", "--max-model-len", "128", "--kv-window", "48",
                            "--no-live"])
    assert r.exit_code == 0, r.stderr
    err = " ".join(r.stderr.split())  # rich wraps the report at the console's width (80 columns under CI)
    assert f"{w['dropped_tokens']:,} tokens dropped, {w['recycled_blocks']:,} blocks recycled" in err
    assert "window S 4 + W 48" in err  # the plain log lines say it as it streams


# -- serve -----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_serve_takes_a_window_and_counts_dropped_tokens_in_metrics():
    from test_serve import ServeProcess

    s = ServeProcess("--kv-budget", "24MiB", "--max-model-len", "256", "--kv-window", "64")
    url = s.wait_ready()
    try:
        assert any("bounded KV: 16 sink + 64 window tokens" in line for line in s.lines)
        text = httpx.get(f"{url}/metrics", timeout=10).text
        assert re.search(r"^kvcli:kv_tokens_dropped_total\{[^}]*\} 0\.0$", text, re.M)
        prompt = list(range(100, 250))  # 150 token ids
        body = {"prompt": prompt, "max_tokens": 20, "ignore_eos": True, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 20
        text = httpx.get(f"{url}/metrics", timeout=10).text

        def value(name: str) -> float:
            m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
            assert m, f"{name} missing from /metrics"
            return float(m.group(1))

        dropped = expected_dropped(150 + 20 - 1, 64)
        assert dropped == 80 and value("kvcli:kv_tokens_dropped_total") == dropped
        assert value("kvcli:kv_blocks_recycled_total") == dropped // BS
        assert value("kvcli:kv_window_tokens") == 64 and value("kvcli:kv_sink_tokens") == 16
        assert 16 + 64 <= value("kvcli:kv_request_tokens_peak") <= 16 + 64 + 15
    finally:
        assert s.stop() == 0, "".join(s.lines)


def test_serve_window_errors_are_one_line():
    one_line_error(runner.invoke(app, ["serve", "--port", "0", "--kv-window", "0"]), "--kv-window")
    one_line_error(runner.invoke(app, ["serve", "--port", "0", "--max-model-len", "128", "--kv-window", "200"]),
                   "must fit the 128-token context")
