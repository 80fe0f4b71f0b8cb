"""How much the live dashboard slows generation: the same greedy workload with and without the
dashboard (a real rich Live rendering 4 times a second to a terminal-like console), alternated
A/B/A/B in one process. Prints decode tok/s for each and the slowdown.

The goal in the issue: no more than 5 % slower.
"""

from __future__ import annotations

import argparse
import io
import time

from rich.console import Console

from kvcli.config import SamplingParams
from kvcli.llm import LLM
from kvcli.metrics.memory import MemoryProbe
from kvcli.view.dashboard import LiveDashboard
from kvcli.workloads import SAMPLE_TEXT


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    llm = LLM(prefix_caching=False)  # every run prefills its prompt in full, as the first one did
    engine = llm.engine
    ids = llm.tokenizer.encode(SAMPLE_TEXT.read_text(encoding="utf-8"))[: a.prompt_tokens]
    probe = MemoryProbe(str(engine.device))
    weights = sum(engine.weight_bytes().values())

    def run(live: bool) -> float:
        engine.add_request(ids, SamplingParams(max_tokens=a.new_tokens, ignore_eos=True))
        sink = io.StringIO()
        console = Console(file=sink, force_terminal=True, width=120, height=50, color_system="truecolor")
        dash = LiveDashboard(console, live=True) if live else None
        decode_s, decoded, last = 0.0, 0, 0.0
        if dash:
            dash.__enter__()
        try:
            while engine.has_unfinished():
                t = time.perf_counter()
                outs = engine.step()
                if dash and t - last >= 0.2:  # as `kvcli continue` feeds it
                    last = t
                    dash.update(engine.snapshot(probe.sample(engine.kv_pool_bytes, weights), block_map=True))
                dt = time.perf_counter() - t
                if engine.stats().step > 1 and all(len(engine.requests[o.req_id].output_token_ids) > 1 for o in outs):
                    decode_s += dt
                    decoded += len(outs)
        finally:
            if dash:
                dash.__exit__(None, None, None)
        if live:
            assert "KV blocks" in sink.getvalue()  # it really rendered
        return decoded / decode_s

    run(False)  # warm-up
    base, live = [], []
    for _ in range(a.rounds):
        base.append(run(False))
        live.append(run(True))
    b, l_ = max(base), max(live)
    print(f"command: python -m kvcli.bench live "
          f"--prompt-tokens {a.prompt_tokens} --new-tokens {a.new_tokens} --rounds {a.rounds}")
    print(f"decode tok/s without dashboard: {', '.join(f'{x:.1f}' for x in base)} (best {b:.1f})")
    print(f"decode tok/s with dashboard:    {', '.join(f'{x:.1f}' for x in live)} (best {l_:.1f})")
    print(f"slowdown (best vs best): {(1 - l_ / b) * 100:.1f} %  (goal <= 5 %)")
