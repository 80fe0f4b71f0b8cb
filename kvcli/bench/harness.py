"""The one benchmark harness: timing helpers, interleaved rounds over engines, the header every figure
prints first (date, machine line, load average, command), and the paths the figures share.

Every timing helper of the benchmarks lives here (wall clock, this thread's CPU time, best/median of
runs), so that a figure's method is the name of a helper, not a loop written again per script.

Rounds: `interleaved(engines, rounds, measure)` runs every engine once per round, in turn, and keeps all
samples; best and median per engine and the ratios are then taken over one run of the machine, so a slow
phase of a shared VM weighs on every engine alike instead of on whichever ran during it.
"""

from __future__ import annotations

import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "samples"
RESULTS = REPO / "docs" / "results"

# torch reads ATEN_CPU_CAPABILITY once, at import: a figure held to AVX2 re-executes itself with these set.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# AVX-512 without AMX on a CPU that has it: kvcli's tile paths off (capabilities.amx_*_for), oneDNN below AMX.
NOAMX_ENV = {"KVCLI_AMX": "0", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}


def sample_text(name: str) -> str:
    """A text of samples/ (keepers-log.txt, heldout-gpl-3.0.txt, ...)."""
    return (SAMPLES / name).read_text(encoding="utf-8")


# --- timing ---------------------------------------------------------------------------------------------------

def wall(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cpu(fn: Callable[[], Any]) -> float:
    """This thread's CPU seconds of one call (with one torch thread every op runs on this thread, so other
    processes on a shared machine slow the wall clock but not this figure)."""
    t = time.thread_time()
    fn()
    return time.thread_time() - t


def process_cpu(fn: Callable[[], Any]) -> float:
    """The process's CPU seconds of one call (all its threads)."""
    t = time.process_time()
    fn()
    return time.process_time() - t


CLOCKS: dict[str, Callable[[Callable[[], Any]], float]] = {"wall": wall, "cpu": cpu, "process": process_cpu}


def repeat(fn: Callable[[], Any], repeats: int, clock: str = "wall") -> list[float]:
    """Seconds of `repeats` calls of fn, timed by `clock` (wall, cpu, process)."""
    timer = CLOCKS[clock]
    return [timer(fn) for _ in range(repeats)]


def best(fn: Callable[[], Any], repeats: int, clock: str = "wall") -> float:
    """The fastest of `repeats` calls, in seconds."""
    return min(repeat(fn, repeats, clock))


def best_warm(fn: Callable[[], Any], repeats: int, calls: int = 1, clock: str = "wall") -> tuple[float, Any]:
    """One warm-up call, then the fastest of `repeats` timings of `calls` calls each, in seconds per call,
    and the last call's result."""
    out = fn()
    timer, times = CLOCKS[clock], []
    for _ in range(repeats):
        def many():
            nonlocal out
            for _ in range(calls):
                out = fn()
        times.append(timer(many) / calls)
    return min(times), out


def best_ms(fn: Callable[[], Any], repeats: int, calls: int = 1) -> float:
    """best_warm in milliseconds per call (wall clock)."""
    return best_warm(fn, repeats, calls)[0] * 1e3


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


# --- interleaved rounds ---------------------------------------------------------------------------------------

@dataclass
class Rounds:
    """Samples per engine, in round order (one per round per engine)."""

    samples: dict[str, list[Any]] = field(default_factory=dict)

    def add(self, engine: str, value: Any) -> None:
        self.samples.setdefault(engine, []).append(value)

    def best(self, engine: str, key: Callable[[Any], float] = float) -> float:
        return min(key(v) for v in self.samples[engine])

    def median(self, engine: str, key: Callable[[Any], float] = float) -> float:
        return median(key(v) for v in self.samples[engine])

    def ratios(self, a: str, b: str, key: Callable[[Any], float] = float) -> list[float]:
        """Per-round key(a) / key(b): the two were measured in the same round."""
        return [key(x) / key(y) for x, y in zip(self.samples[a], self.samples[b])]


def interleaved(engines: Sequence[str], rounds: int, measure: Callable[[str, int], Any],
                alternate: bool = False, progress: bool = True) -> Rounds:
    """measure(engine, round) for every engine once per round; alternate=True reverses the order every
    other round (so neither side always runs first)."""
    out = Rounds()
    for r in range(rounds):
        order = list(engines)[::-1] if alternate and r % 2 else list(engines)
        for name in order:
            out.add(name, measure(name, r))
        if progress:
            print(f"round {r + 1} of {rounds} done", file=sys.stderr, flush=True)
    return out


# --- the header -----------------------------------------------------------------------------------------------

def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def command_line(figure: str, argv: Sequence[str], own: Sequence[str] = ()) -> str:
    """The command that reproduces the figure: its name and the caller's arguments (the figure adds its own, which
    are named after it, not repeated in it: `python -m kvcli.bench continue continue ...` would pass them twice)."""
    line = "python -m kvcli.bench " + shlex.join([figure, *argv])
    return line + (f"  (the figure's own arguments, first: {shlex.join(own)})" if own else "")


def machine() -> str:
    """kvcli.bench.machine's machine line; where it fails (kvcli's internals mid-change), what is left of it
    and why, so that a figure still runs and says what it could not print."""
    from kvcli.bench import machine as m

    try:
        return m.machine_line()
    except Exception as exc:  # noqa: BLE001 - the figure must still say which machine it ran on
        return f"machine: {m.cpu_name()}, {m.cpu_isa()}, {os.cpu_count()} cores (machine line failed: {exc!r})"


def header(figure: str, argv: Sequence[str], out=None, own: Sequence[str] = ()) -> None:
    """What every figure prints first: its name and the date, the machine line, the load, the command (`argv`: the
    caller's arguments, `own`: those the figure adds before them)."""
    out = out or sys.stdout
    print(f"# {figure} — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", file=out)
    print(machine(), file=out)
    print(f"load average: {load_average()}", file=out)
    print(f"command: {command_line(figure, argv, own)}", file=out)
    print(file=out, flush=True)


def busy_note(load_before: float, load_after: float) -> str:
    busy = max(load_before, load_after) > (os.cpu_count() or 1)
    return (f"load average (1 min): {load_before:.2f} at start, {load_after:.2f} at end"
            + (" — other work shared the CPU, timings are not clean" if busy else ""))


def load1() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0
