"""The dashboard views render exactly the numbers of a hand-built Snapshot; the memory probe works
without NVML. Everything here is CPU-only and loads no model."""

from __future__ import annotations

import io
import os
import re
import resource
import shlex
import shutil
import sys
import time
import types

import pytest
from rich.console import Console

from terminal import Tmux

from kvcli.metrics.memory import NO_GPU_NOTE, MemoryProbe, probe_memory
from kvcli.metrics.snapshot import BlockMap, KVBreakdown, MemorySnapshot, RequestTiming, Snapshot
from kvcli.view import block_map as bmv
from kvcli.view.dashboard import LiveDashboard, hbar, render_dashboard, sparkline
from kvcli.view.plain_log import format_log_line, human_bytes, percentile

MiB = 1024 * 1024
BS = 16


def make_block_map() -> BlockMap:
    """40 blocks: req-a owns 0-5 (block 5 holds 7 of 16 tokens), req-b owns 6-9 and shares
    req-a's block 2 (ref 2), req-c owns 10-12; 13-16 are cached-free, 17-39 free."""
    owner = [0] * 6 + [1] * 4 + [2] * 3 + [-2] * 4 + [-1] * 23
    fill = [BS] * 5 + [7] + [BS] * 4 + [BS] * 3 + [0] * 27
    ref = [1, 1, 2, 1, 1, 1] + [1] * 7 + [0] * 27
    return BlockMap(block_size=BS, owner=tuple(owner), fill=tuple(fill), ref=tuple(ref),
                    owners=("req-a", "req-b", "req-c"))


# Paged: 45 MiB of token states, 5 MiB internal -> 90.0% / 10.0% of 50 MiB allocated.
LIVE_KV = KVBreakdown(token_bytes=45 * MiB, reserved_bytes=0, internal_bytes=5 * MiB,
                      external_bytes=0, free_bytes=974 * MiB)
# Contiguous what-if: 200 MiB allocated -> tokens 22.5%, reserved 60.0%, internal 17.5%,
# external 30 MiB = 15.0% of allocated.
WHATIF_KV = KVBreakdown(token_bytes=45 * MiB, reserved_bytes=120 * MiB, internal_bytes=35 * MiB,
                        external_bytes=30 * MiB, free_bytes=794 * MiB)

CPU_MEM = MemorySnapshot(
    device="cpu", gpu_found=False, device_total_bytes=8 * 1024 * MiB,
    device_used_bytes=2 * 1024 * MiB, process_used_bytes=812 * MiB,
    kv_pool_bytes=1024 * MiB, weight_bytes=int(146.1 * MiB), note=NO_GPU_NOTE,
)


def make_snapshot(**over) -> Snapshot:
    fields = dict(
        step=120, time_s=12.34, layout="paged", num_running=3, num_waiting=1, num_preempted=2,
        kv=LIVE_KV, contiguous_whatif=WHATIF_KV, whatif_fits=2, blocks=make_block_map(),
        memory=CPU_MEM,
        tokens_per_s=(0.0, 35.0, 70.0, 71.2),
        prompt_tokens=4241, generated_tokens=40, prefix_hit_tokens=420, prefix_query_tokens=1000,
        max_model_len=2048,
        requests=(
            RequestTiming("req-a", 1000, 20, 0.21, (0.010, 0.012, 0.014)),
            RequestTiming("req-b", 2000, 15, 0.35, (0.020, 0.040)),
            RequestTiming("req-c", 1241, 5, 0.10, ()),
            RequestTiming("req-d", 500, 0, None, ()),
        ),
    )
    fields.update(over)
    return Snapshot(**fields)


def flat(text: str) -> str:
    """Rendered text with runs of spaces collapsed, so asserts do not depend on column widths."""
    return re.sub(r" +", " ", text)


def render_text(renderable, width: int = 120) -> str:
    console = Console(record=True, width=width, force_terminal=False, no_color=True,
                      file=io.StringIO())
    console.print(renderable)
    return console.export_text()


# -- formatting helpers ------------------------------------------------------------------------

def test_helpers_exact():
    assert human_bytes(45 * MiB) == "45.0 MiB"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(900) == "900 B"
    assert human_bytes(None) == "n/a"
    assert percentile([0.01, 0.012, 0.014, 0.02, 0.04], 50) == pytest.approx(0.014)
    assert percentile([0.01, 0.012, 0.014, 0.02, 0.04], 99) == pytest.approx(0.0392)
    assert percentile([], 50) is None
    assert sparkline([0.0, 35.0, 70.0], 10) == "▁▅█"
    assert sparkline(list(range(100)), 5)[-1] == "█" and len(sparkline(list(range(100)), 5)) == 5
    assert hbar(0.5, 10) == "█████     "
    assert hbar(0.0625, 4) == "▎   "  # 2 eighths of one cell
    assert hbar(1.5, 4) == "███▶"


# -- block map ---------------------------------------------------------------------------------

def grid_and_legend(bm: BlockMap, width: int, height: int) -> tuple[list[str], str]:
    text = render_text(bmv.render_block_map(bm, width=width, height=height), width=120)
    lines = text.rstrip("\n").split("\n")
    cells = -(-len(bm.owner) // bmv.blocks_per_cell(len(bm.owner), width, height))
    rows = -(-cells // width)
    return lines[:rows], "\n".join(lines[rows:])


def test_block_map_glyphs_and_legend():
    grid, legend = grid_and_legend(make_block_map(), width=16, height=8)
    assert grid == [
        "██▓██▄███████░░░",  # req-a 0-5 (shared block 2, partial block 5), req-b 6-9, req-c 10-12
        "░···············",
        "········",
    ]
    cells = "".join(grid)
    assert (cells.count("█"), cells.count("▄"), cells.count("▓")) == (11, 1, 1)
    assert (cells.count("░"), cells.count("·")) == (4, 23)
    assert legend.split("\n") == [
        "█ full 11   ▄ partial 1   ▓ shared 1   ░ cached-free 4   · free 23",
        "40 blocks x 16 tokens",
        "█ req-a 6   █ req-b 4   █ req-c 3",  # busiest request first, each with its swatch
    ]


def test_block_map_colors_by_owner():
    console = Console(record=True, width=120, force_terminal=True, color_system="standard",
                      no_color=False, file=io.StringIO())
    _, grid = bmv.render_grid(make_block_map(), 16, 8)
    styles = {str(sp.style) for sp in grid.spans}
    assert {"bright_blue", "bold bright_blue", "bright_green", "bright_magenta", "dim"} <= styles
    console.print(grid)
    assert "\x1b[" in console.export_text(styles=True)  # colored on a color terminal


def test_block_map_aggregates_20000_blocks():
    # 10,013 blocks of req-0, 4,987 cached-free, 5,000 free; 80 x 10 cells -> 25 blocks a cell.
    n_owned, n_cached = 10_013, 4_987
    owner = (0,) * n_owned + (-2,) * n_cached + (-1,) * 5000
    fill = (BS,) * n_owned + (0,) * 15_000
    ref = (1,) * n_owned + (0,) * 15_000
    bm = BlockMap(BS, owner, fill, ref, ("req-0",))
    assert bmv.blocks_per_cell(20_000, 80, 10) == 25
    grid, legend = grid_and_legend(bm, width=80, height=10)
    assert len(grid) == 10 and all(len(row) == 80 for row in grid)
    cells = "".join(grid)
    # Cell 400 (blocks 10,000-10,024) is 13 owned vs 12 cached: the owner dominates.
    assert (cells.count("█"), cells.count("░"), cells.count("·")) == (401, 199, 200)
    assert legend.split("\n")[1:] == ["20,000 blocks x 16 tokens · 1 cell = 25 blocks (dominant state)",
                                      "█ req-0 10,013"]


def test_block_map_tie_prefers_owned():
    bm = BlockMap(BS, (0, -1, -1, 0), (BS, 0, 0, 3), (1, 0, 0, 1), ("r",))
    k, keys = bmv.cell_keys(bm, 1, 2)
    assert k == 2 and [bmv._glyph_style(x)[0] for x in keys] == ["█", "▄"]


# -- dashboard ---------------------------------------------------------------------------------

def test_dashboard_shows_exact_numbers():
    text = render_text(render_dashboard(make_snapshot(), width=120))
    f = flat(text)
    # header and memory (CPU)
    assert text.startswith("kvcli · step 120 · 12.3 s · paged KV layout\n")
    assert "│ no GPU found: process RSS shown" in f
    assert "│ device cpu │" in f
    assert "│ process RSS 812.0 MiB │" in f
    assert "│ system RAM 2.0 GiB of 8.0 GiB (25.0%) │" in f
    assert "│ KV pool 1.0 GiB │" in f and "│ weights 146.1 MiB │" in f
    # throughput & latency
    assert "│ tok/s ▁▄██ │" in f  # 0, 35, 70, 71.2 scaled to the maximum (35/71.2*7 -> 3)
    assert "│ current 71.2 tok/s (peak 71.2) │" in f
    assert "│ TTFT p50 0.21s over 3 requests │" in f  # median of 0.21, 0.35, 0.10; req-d has none
    assert "│ ITL p50/p99 14.0ms / 39.2ms │" in f  # over 10, 12, 14, 20, 40 ms
    assert "│ requests running 3 · waiting 1 │" in f and "│ preemptions 2 │" in f
    assert "│ prefix cache 42.0% hit (420 of 1,000 tokens) │" in f
    assert "│ tokens prompt 4,241 · generated 40 │" in f
    # block map with its legend inside its panel
    assert "│ ██▓██▄███████░░░░······················· │" in f
    assert "│ █ full 11 ▄ partial 1 ▓ shared 1 ░ cached-free 4 · free 23 │" in f
    assert "│ █ req-a 6 █ req-b 4 █ req-c 3 │" in f
    # fragmentation: live paged vs contiguous what-if, shares of allocated with bytes
    rows = {line.split()[1]: line for line in text.splitlines()
            if line.startswith("│") and len(line.split()) > 2
            and line.split()[1] in ("tokens", "reserved", "internal", "external", "allocated")}
    assert ["90.0%", "45.0 MiB", "22.5%", "45.0 MiB"] == _numbers(rows["tokens"])
    assert ["0.0%", "0 B", "60.0%", "120.0 MiB"] == _numbers(rows["reserved"])
    assert ["10.0%", "5.0 MiB", "17.5%", "35.0 MiB"] == _numbers(rows["internal"])
    assert ["0.0%", "0 B", "15.0%", "30.0 MiB"] == _numbers(rows["external"])
    assert flat(rows["allocated"]) == (
        "│ allocated 50.0 MiB of a 1.0 GiB pool 200.0 MiB of a 1.0 GiB pool │")
    assert "paged (live)" in text and "contiguous what-if (max-len)" in text
    assert ("contiguous preallocation: the pool fits 2 regions of 2,048 tokens, so only 2 of these 3 requests "
            "could run at once") in text
    # bars 29 cells wide at 120 columns, in eighth-cell steps: 0.9 * 29 * 8 = 209 eighths = 26
    # full cells + 1/8; 0.225 * 29 * 8 -> 52 eighths = 6 full cells + 4/8
    assert rows["tokens"].split()[2:4:] == ["█" * 26 + "▏", "90.0%"]
    assert "█" * 6 + "▌ " in rows["tokens"]


def _numbers(line: str) -> list[str]:
    words = line.replace("│", " ").split()
    out = []
    for i, w in enumerate(words):
        if w.endswith("%"):
            out += [w, f"{words[i + 1]} {words[i + 2]}"]
    return out


def test_dashboard_gpu_memory_and_no_whatif():
    gpu = MemorySnapshot(device="cuda:0 NVIDIA H200", gpu_found=True,
                         device_total_bytes=140 * 1024 * MiB, device_used_bytes=14 * 1024 * MiB,
                         process_used_bytes=7 * 1024 * MiB, torch_allocated_bytes=6 * 1024 * MiB,
                         torch_reserved_bytes=6 * 1024 * MiB + 512 * MiB,
                         kv_pool_bytes=4 * 1024 * MiB, weight_bytes=1024 * MiB)
    text = render_text(render_dashboard(make_snapshot(memory=gpu, contiguous_whatif=None,
                                                      whatif_fits=None, tokens_per_s=()),
                                        width=100), width=100)
    f = flat(text)
    assert "│ device cuda:0 NVIDIA H200 │" in f
    assert "│ device used 14.0 GiB of 140.0 GiB (10.0%) │" in f
    assert "│ this process 7.0 GiB (5.0% of device) │" in f
    assert "│ torch allocated 6.0 GiB │" in f and "│ torch reserved 6.5 GiB │" in f
    assert "│ allocator frag 512.0 MiB (7.7% of reserved) │" in f
    assert "│ KV pool 4.0 GiB │" in f and "│ weights 1.0 GiB │" in f
    assert "no GPU found" not in text and "what-if" not in text and "regions of" not in text
    assert "│ tok/s no samples yet │" in f and "│ current 0.0 tok/s │" in f
    assert max(len(line) for line in text.splitlines()) == 100


def test_plain_log_line():
    assert format_log_line(make_snapshot()) == (
        "step 120 · running 3 waiting 1 preempted 2 · KV 4.9% of pool: 90.0% tokens 10.0% internal"
        " · 71.2 tok/s · TTFT p50 0.21s"
    )
    contiguous = make_snapshot(layout="contiguous", kv=WHATIF_KV, num_preempted=0, requests=())
    assert format_log_line(contiguous) == (
        "step 120 · running 3 waiting 1 · KV 19.5% of pool: 22.5% tokens 60.0% reserved"
        " 17.5% internal 15.0% external · 71.2 tok/s · TTFT p50 n/a"
    )


# -- LiveDashboard -----------------------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_live_dashboard_logs_plain_lines_off_terminal():
    out = io.StringIO()
    clock = FakeClock()
    dash = LiveDashboard(Console(file=out, force_terminal=False, width=200), clock=clock)
    with dash:
        assert not dash.use_live and dash._live is None
        for step, t in ((1, 0.0), (2, 0.5), (3, 1.9), (4, 2.0), (5, 3.0)):
            clock.t = t
            dash.update(make_snapshot(step=step))
    lines = out.getvalue().splitlines()
    # step 1 at t=0, step 4 at t=2.0 (2 s later), and the unlogged last step on exit.
    assert [line.split(" · ")[0] for line in lines] == ["step 1", "step 4", "step 5"]
    assert lines[0] == format_log_line(make_snapshot(step=1))


def test_live_dashboard_live_false_on_terminal_uses_log():
    out = io.StringIO()
    with LiveDashboard(Console(file=out, force_terminal=True), live=False) as dash:
        dash.update(make_snapshot())
    assert out.getvalue().startswith("step 120 · running 3")


def test_live_dashboard_on_terminal_draws_latest_snapshot():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, no_color=True, width=120, height=60)
    with LiveDashboard(console, redirect_stdout=False) as dash:
        assert dash.use_live
        dash.update(make_snapshot(step=1))
        first = dash.renderable()
        assert dash.renderable() is first  # cached until a new snapshot arrives
        dash.update(make_snapshot(step=7))
    text = out.getvalue()
    assert "step 7 · 12.3 s" in text and "req-a 6" in text


def test_print_above_and_off_terminal_writes_stdout(capsys):
    with LiveDashboard(Console(file=io.StringIO(), force_terminal=False)) as dash:
        dash.print_above("one\ntwo\n")
    assert capsys.readouterr().out == "one\ntwo\n"


def test_continue_streams_whole_lines_under_the_dashboard(capsys):
    """`kvcli continue` under the live view: a line goes out once complete, the unfinished rest is held
    for the end, and every piece is kept for the continuation."""
    from kvcli.commands.continue_cmd import _Stream

    with LiveDashboard(Console(file=io.StringIO(), force_terminal=False)) as dash:
        stream = _Stream(quiet=False, above=dash)
        pieces = ["Hel", "lo\nwor", "ld", "\n", "\nta", "il"]
        for i, piece in enumerate(pieces):
            stream.emit(piece)
            if i == 2:
                assert capsys.readouterr().out == "Hello\n"
    assert capsys.readouterr().out == "world\n\n"
    assert "".join(stream.held) == "tail" and "".join(stream.pieces) == "".join(pieces)
    quiet = _Stream(quiet=True, above=None)
    quiet.emit("a\nb")
    assert capsys.readouterr().out == "" and quiet.pieces == ["a\nb"]


# A dashboard whose height changes from frame to frame, redrawn 50 times a second, while the main
# thread prints numbered lines above it, as a streamed reply does.
_REDRAW_SCRIPT = """
import random, sys, time
from rich.console import Console
from rich.table import Table
from kvcli.view.dashboard import LiveDashboard

class Dash(LiveDashboard):
    def renderable(self):
        t = Table(show_header=False, box=None)
        for _ in range(8):
            t.add_column()
        for i in range(random.randint(2, 12)):
            t.add_row(f"panel-row-{i}", *[f"{random.random():.4f}" for _ in range(7)])
        return t

with Dash(Console(stderr=True), refresh_per_second=50, redirect_stdout=True) as dash:
    for i in range(int(sys.argv[1])):
        dash.print_above(f"line {i:05d}\\n")
        time.sleep(0.002)
print("DONE")
"""


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs the tmux binary for a real terminal")
def test_lines_printed_above_a_redrawing_dashboard_all_stay(tmp_path):
    """On a real terminal: every line printed above the panels is on screen once and in order, with no
    panel row left among them. (Printed through rich's stdout proxy while rich's own thread redrew,
    ~1.5 % of 1,500 such lines were erased and as many stale panel rows left here.)"""
    script = tmp_path / "redraw.py"
    script.write_text(_REDRAW_SCRIPT, encoding="utf-8")
    n = 400
    t = Tmux(shlex.join([sys.executable, str(script), str(n)]) + "; sleep 60", width=100, height=40,
             history=800)
    try:
        screen = t.wait(lambda s: "DONE" in s, "the script to finish", timeout=120)
    finally:
        t.close()
    rows = screen.splitlines()
    last = max(i for i, row in enumerate(rows) if row.startswith("line "))
    printed = [row.rstrip() for row in rows[:last + 1] if row.startswith("line ")]
    assert printed == [f"line {i:05d}" for i in range(n)]
    assert not [row for row in rows[:last] if "panel-row" in row]
    assert "panel-row-0" in "\n".join(rows[last:])  # the last frame stays below the text


def test_no_color_env_is_respected(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    dash = LiveDashboard(live=False)
    assert dash.console.no_color and dash.console.stderr


def test_render_time_1500_blocks():
    """Not a benchmark gate (shared CPUs): a loose bound that catches an accidental O(n^2)."""
    n = 1500
    owners = tuple(f"req-{i}" for i in range(24))
    owner = tuple(min(i // 50, 23) if i < 1300 else (-2 if i < 1400 else -1) for i in range(n))
    fill = tuple(BS if o >= 0 else 0 for o in owner)
    ref = tuple(2 if i % 97 == 0 and owner[i] >= 0 else (1 if owner[i] >= 0 else 0) for i in range(n))
    s = make_snapshot(blocks=BlockMap(BS, owner, fill, ref, owners),
                      tokens_per_s=tuple(float(i % 50) for i in range(200)))
    console = Console(file=io.StringIO(), width=100, force_terminal=True, color_system="truecolor")
    console.print(render_dashboard(s, width=100))  # warm caches
    t0 = time.perf_counter()
    for _ in range(10):
        console.print(render_dashboard(s, width=100))
    per_render = (time.perf_counter() - t0) / 10
    assert per_render < 0.1, per_render


# -- memory probe ------------------------------------------------------------------------------

def test_memory_probe_cpu_reads_rss():
    with MemoryProbe("cpu") as probe:
        m = probe.sample(kv_pool_bytes=123, weight_bytes=456)
    assert m.gpu_found is False and m.device == "cpu" and m.note == NO_GPU_NOTE
    assert (m.kv_pool_bytes, m.weight_bytes) == (123, 456)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert 4 * MiB < m.process_used_bytes <= peak + 64 * MiB
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    assert abs(m.process_used_bytes - pages * os.sysconf("SC_PAGE_SIZE")) < 64 * MiB
    assert m.device_total_bytes and 0 < m.device_used_bytes <= m.device_total_bytes
    assert m.torch_allocated_bytes is None and m.torch_reserved_bytes is None


def test_probe_memory_cuda_without_gpu_falls_back_quietly():
    m = probe_memory("cuda:0", 1, 2)
    if m.gpu_found:  # a CUDA machine: NVML or torch must report the device
        assert m.device.startswith("cuda:0") and m.device_total_bytes
    else:
        assert m.device == "cpu" and m.note == NO_GPU_NOTE and m.process_used_bytes > 0
    t0 = time.perf_counter()
    for _ in range(100):
        probe_memory("cpu", 0, 0)
    assert (time.perf_counter() - t0) / 100 < 0.01


def fake_pynvml(my_pid_used: int | None, init_error: bool = False) -> types.ModuleType:
    """A stand-in for pynvml with one 140 GiB GPU; the real NVML needs a driver."""
    nv = types.ModuleType("pynvml")
    calls: list[str] = []

    def init() -> None:
        calls.append("init")
        if init_error:
            raise RuntimeError("NVML Shared Library Not Found")

    nv.nvmlInit = init
    nv.nvmlShutdown = lambda: calls.append("shutdown")
    nv.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    nv.nvmlDeviceGetName = lambda h: b"NVIDIA H200"
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=140 * 1024 * MiB, used=21 * 1024 * MiB, free=119 * 1024 * MiB)
    procs = [types.SimpleNamespace(pid=os.getpid() + 1, usedGpuMemory=MiB)]
    if my_pid_used is not None:
        procs.append(types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=my_pid_used))
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: procs
    nv.calls = calls
    return nv


def test_memory_probe_nvml_path(monkeypatch):
    nv = fake_pynvml(my_pid_used=7 * 1024 * MiB)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with MemoryProbe("cuda:1") as probe:
        m = probe.sample(kv_pool_bytes=5, weight_bytes=6)
        m2 = probe.sample()
    assert nv.calls == ["init", "shutdown"]  # initialised once for many samples
    assert m.gpu_found and m.device == "cuda:1 NVIDIA H200" and m.note == ""
    assert (m.device_total_bytes, m.device_used_bytes) == (140 * 1024 * MiB, 21 * 1024 * MiB)
    assert m.process_used_bytes == 7 * 1024 * MiB and (m.kv_pool_bytes, m.weight_bytes) == (5, 6)
    assert m2.device_used_bytes == m.device_used_bytes
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 1:  # torch sees cuda:1: its counters
        assert isinstance(m.torch_allocated_bytes, int) and m.torch_allocated_bytes >= 0
    else:  # no such device for torch: no allocator counters, the NVML numbers stand on their own
        assert m.torch_allocated_bytes is None and m.torch_reserved_bytes is None


def test_memory_probe_nvml_hides_process(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(my_pid_used=None))
    m = MemoryProbe("cuda").sample()
    assert m.gpu_found and m.process_used_bytes is None
    assert m.note == "per-process GPU memory not reported by NVML"
    text = flat(render_text(render_dashboard(make_snapshot(memory=m))))
    assert "│ this process n/a │" in text and "│ device used 21.0 GiB of 140.0 GiB (15.0%) │" in text


def test_memory_probe_nvml_init_failure_is_quiet(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(None, init_error=True))
    m = MemoryProbe("cuda:0").sample()
    if m.gpu_found:  # a CUDA build of torch on a GPU machine still sees the device
        assert m.note == "NVML unavailable: device memory from torch" and m.device_total_bytes
    else:
        assert m.device == "cpu" and m.note == NO_GPU_NOTE
        assert m.process_used_bytes and m.process_used_bytes > 0


def test_dashboard_header_names_the_kv_dtype_and_bytes_per_token():
    s = make_snapshot(kv_dtype="int8", block_size=16, bytes_per_block=16 * 12240)
    text = render_text(render_dashboard(s, width=120))
    assert text.startswith("kvcli · step 120 · 12.3 s · paged KV layout · KV int8, 12,240 B/token\n")
