"""How many CPU threads a step's kernels take (--threads), chosen on the CPU by timing decode steps.

kvcli's C kernels and torch's CPU ops split each call over `torch.get_num_threads()` threads, and each call waits
for its slowest thread. When another process holds one of the cores, the thread sharing it runs in time slices
and every one of a decode step's few hundred parallel regions waits for its slice: on a 2-core Xeon beside one
spinning process, the bundled model decoded at 5.5 tok/s on 2 threads against 312 on 1 (428 against 296 with both
cores free; `python -m kvcli.bench threads`, docs/results/threads.txt, 2026-12-07). So under `--threads auto` the
engine tries the other count now and then and keeps whichever runs faster:

- after the first `first_s` seconds of decode steps, and then after every `period_s`, `probe_steps` decode steps at
  the current count are timed, then as many at the other one: half the current count, or the full count when
  fewer run now;
- a pair counts only steps that decode (no prompt in them) with the same rows and requests as its first step;
  any other step starts the pair over, at the current count;
- the other count is taken when its mean step time is below `margin` times the current count's.

On an idle machine a probe costs its few slower steps every period (4 steps at 1 thread every 2 s of decode at
~400 tok/s: about 0.3 % of the decode time; in the same figure auto ran 1.01x a fixed 2 threads idle, and 245 tok/s
beside the spinning process, where its first pair came after the slow start at 2 threads). `--threads N` fixes the
count and probes nothing. The engine sets the count through torch.set_num_threads before each step (`apply`): for
the whole process, as torch's setting is. Which count a decision took does not change greedy text on the default
backend beyond what batching already may (the attention splits its keys by the thread count); under the invariant
backend, whose promise is text that depends on nothing but the tokens, auto keeps torch's count and never probes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ThreadTuner:
    full: int  # the most threads: torch's count when the engine was built (--threads auto)
    tune: bool = True  # False: never changed (--threads N; the invariant backend; one thread; not the CPU)
    first_s: float = 0.2
    period_s: float = 2.0
    probe_steps: int = 4
    margin: float = 0.85
    current: int = field(init=False)
    switches: int = field(default=0, init=False)  # decisions that changed the count (for the summary, tests)
    pairs: int = field(default=0, init=False)  # pairs completed
    _decode_s: float = field(default=0.0, init=False)  # decode time since the last pair
    _phase: str = field(default="run", init=False)  # run | ref | probe
    _shape: tuple[int, int] | None = field(default=None, init=False)
    _ref: list[float] = field(default_factory=list, init=False)
    _probe: list[float] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.current = self.full

    @classmethod
    def for_option(cls, threads: int | str, may_tune: bool = True) -> "ThreadTuner":
        """From EngineOptions.threads: "auto" (torch's count now, tuned where `may_tune`) or a fixed count."""
        if threads == "auto":
            return cls(torch.get_num_threads(), tune=may_tune and torch.get_num_threads() > 1)
        return cls(int(threads), tune=False)

    @property
    def other(self) -> int:
        return max(1, self.current // 2) if self.current == self.full else self.full

    def threads_for_step(self) -> int:
        """The count the next step runs at."""
        return self.other if self._phase == "probe" else self.current

    def apply(self) -> None:
        """Set torch's count (every kernel's) to the next step's, where it differs."""
        n = self.threads_for_step()
        if n != torch.get_num_threads():
            torch.set_num_threads(n)

    def observe(self, decode_only: bool, rows: int, requests: int, seconds: float) -> None:
        """After each step: whether it only decoded, its rows and requests, its wall time."""
        if not self.tune:
            return
        shape = (rows, requests)
        if not decode_only or (self._phase != "run" and shape != self._shape):
            self._restart()
            return
        if self._phase == "run":
            self._decode_s += seconds
            if self._decode_s >= (self.period_s if self.pairs else self.first_s):
                self._phase, self._shape, self._ref, self._probe = "ref", shape, [], []
            return
        (self._ref if self._phase == "ref" else self._probe).append(seconds)
        if self._phase == "ref" and len(self._ref) == self.probe_steps:
            self._phase = "probe"
        elif self._phase == "probe" and len(self._probe) == self.probe_steps:
            self.pairs += 1
            if sum(self._probe) < self.margin * sum(self._ref):
                self.current, self.switches = self.other, self.switches + 1
            self._decode_s, self._phase, self._shape = 0.0, "run", None

    def _restart(self) -> None:
        """A step that does not fit the pair: the pair starts over at the next decode step."""
        if self._phase != "run":
            self._phase, self._shape = "run", None
