"""What a speculative verification step costs against a plain decode step, on the bundled model at batch 1.

A step of n query rows after a context of C tokens is made the way a user's engine meets one: prefix caching on,
the C-token context cached (C a multiple of the block size), then a request of that context plus n new tokens,
whose first step computes exactly those n rows and samples one token (a verification step of 1 + k rows is
such a step, n = 1 + k). The wall time of that engine step (scheduler, model, sampler) is taken for each n in
turn within a round, --rounds rounds, medians; printed as ms and as the ratio to the 1-row step.

The last column is the floor the arithmetic sets: the 1-row step plus, for each further row, its linears' and
vocabulary projection's int8 products at the int8 dot-product instruction's peak, measured on registers in the same
run (kernels/cpu_probe.c): one product per multiply-add for weights rounded at one activation level (Q4_0 / Q4_1
forms where the int8 GEMM takes them: the route's one_level; outlier blocks' second level not counted), two for the
others (two int8 levels of every activation). A step cannot be cheaper than that with these numerics on this CPU,
whatever the rest of it costs.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvcli.bench.harness import busy_note, load1, sample_text
from kvcli.bench.roofline import int8_peak


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcli.bench verify-step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--rows", default="1,2,4,6,8")
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args(argv)
    from kvcli.config import SamplingParams
    from kvcli.llm import LLM

    contexts = [int(x) for x in a.contexts.split(",")]
    rows = [int(x) for x in a.rows.split(",")]
    llm = LLM(None, prefix_caching=True, max_model_len=max(contexts) + max(rows) + 16, kv_budget="512MiB")
    eng = llm.engine
    block = eng.options.block_size
    ids = llm.tokenizer.encode(sample_text("heldout-gpl-3.0.txt") * 4)
    once = SamplingParams(max_tokens=1, ignore_eos=True)
    load_before = load1()

    def step_ms(context: int, n: int, salt: int) -> float:
        # new tokens differ per call (salt), so only the context's blocks are a cache hit
        prompt = ids[:context] + [(salt * 7 + j * 13) % 40000 + 100 for j in range(n)]
        eng.add_request(prompt, once)
        t = time.perf_counter()
        eng.step()
        ms = (time.perf_counter() - t) * 1e3
        while eng.has_unfinished():
            eng.step()
        return ms

    for c in contexts:
        assert c % block == 0, f"contexts must be multiples of the block size ({block})"
        eng.add_request(ids[:c], once)  # caches the context
        while eng.has_unfinished():
            eng.step()
        for n in rows:
            step_ms(c, n, 0)  # warm-up
    samples: dict[tuple[int, int], list[float]] = {}
    for r in range(a.rounds):
        for c in contexts:
            for n in rows:
                samples.setdefault((c, n), []).append(step_ms(c, n, r + 1))
    print(busy_note(load_before, load1()))
    print(f"bundled SmolLM2-135M Q4_1, {eng.linear_mode} weights, {eng.kv_dtype.name} KV, batch 1; median of "
          f"{a.rounds} rounds")
    cfg = eng.config
    row_macs = cfg.layer_linear_macs() + cfg.vocab_size * cfg.hidden_size
    one = sum(lin.in_features * lin.out_features for lin in eng.model.linears()
              if lin.mode == "int8dot-cpu" and lin.plan.route.one_level)
    products = 2 * row_macs - one  # the vocabulary projection: two levels
    peak = int8_peak() if eng.linear_mode == "int8dot-cpu" else None
    row_floor_ms = None if peak is None else products / peak[0] * 1e3
    if row_floor_ms is not None:
        print(f"a row's multiply-adds: {row_macs / 1e6:.1f} M, {one / 1e6:.1f} M of them at one int8 level, the rest "
              f"two: {products / 1e6:.1f} M int8 products; {peak[1]}: {peak[0] / 1e12:.3f} TMAC/s on every thread, so "
              f"at least {row_floor_ms:.2f} ms a row")
    print()
    print("| context | query rows | step ms | vs 1 row | floor vs 1 row |")
    print("|---:|---:|---:|---:|---:|")
    for c in contexts:
        base = statistics.median(samples[(c, rows[0])])
        for n in rows:
            ms = statistics.median(samples[(c, n)])
            floor = "n/a" if row_floor_ms is None else f"{1 + (n - rows[0]) * row_floor_ms / base:.2f}x"
            print(f"| {c} | {n} | {ms:.2f} | {ms / base:.2f}x | {floor} |")
    for c in contexts:
        if 6 in rows and 1 in rows:
            r = statistics.median(samples[(c, 6)]) / statistics.median(samples[(c, 1)])
            print(f"goal a 6-row verification step <= 1.3x a 1-row step at {c}: {'met' if r <= 1.3 else 'missed'} "
                  f"({r:.2f}x)")
    return 0
