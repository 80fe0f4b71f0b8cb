"""What a speculative verification step costs against a plain decode step, at batch 1: on the bundled model, or with
--shape on a random-weight GGUF of a real model's shape (kvcli/bench/shapes.py), where a step reads more weights than
the CPU's caches hold.

A step of n query rows after a context of C tokens is made the way speculation makes one: prefix caching on,
the C-token context cached (C a multiple of the block size), then a request of that context plus one token, with
max_tokens n + 1. Its first step computes the new token's row; its second, the one timed, is a running request's
step with n - 1 guesses: their rows and the sampled token's go through the model together and each gets logits and
the acceptance check, as a verification does. The guesses come from a proposer of this benchmark's that always
offers n - 1 tokens (the text's own, from its end), since what a step costs does not depend on where its guesses
come from, and prompt lookup's would depend on what the model answered; the run checks that each timed step
verified n - 1 guesses (n = 1: a plain decode step). The wall time of that engine step (scheduler, model, sampler,
acceptance) is taken for each n in turn within a round, --rounds rounds, medians; printed as ms and as the ratio
to the 1-row step.

The last column is the floor the arithmetic sets: the 1-row step plus, for each further row, its linears' and
vocabulary projection's int8 products at the int8 dot-product instruction's peak, and its attention's fp32
multiply-adds (scores and values over the context's keys, every q head of every layer) at the fp32 FMA's peak, both
measured on registers in the same run (kernels/cpu_probe.c): one int8 product per multiply-add for weights rounded at
one activation level (Q4_0 / Q4_1 forms where the int8 GEMM takes them: the route's one_level; outlier blocks'
second level not counted), two for the others (two int8 levels of every activation). A step cannot be cheaper than
that with these numerics on this CPU, whatever the rest of it costs (conversions, softmax, norms not counted).
With --shape the 1-row step is bound by reading its weights from memory, which the further rows' arithmetic can
overlap, so there the floor is the larger of 1 and all n rows' arithmetic at those peaks against the 1-row step.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvcli.bench.harness import busy_note, load1, sample_text
from kvcli.bench.roofline import fp32_peak, int8_peak


class GivenGuesses:
    """A proposer (PromptLookupProposer's interface) that guesses the request's last tokens again, as many as
    allowed: a verification of a known row count."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, req_id: str, num_tokens: int, token_slice, max_tokens: int) -> list[int]:
        k = min(self.k, max_tokens, num_tokens)
        return token_slice(num_tokens - k, num_tokens) if k > 0 else []

    def release(self, req_id: str) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcli.bench verify-step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--rows", default="1,2,4,6,8")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--shape", default=None, help="a random-weight GGUF of this shape (kvcli/bench/shapes.py SHAPES: "
                    "1b, 3b, 8b) instead of the bundled model")
    ap.add_argument("--kind", default="Q4_0", help="the shape file's tensor types (kvcli/bench/shapes.py KINDS)")
    a = ap.parse_args(argv)
    from kvcli.config import SamplingParams
    from kvcli.llm import LLM

    contexts = [int(x) for x in a.contexts.split(",")]
    rows = [int(x) for x in a.rows.split(",")]
    k = max(max(rows) - 1, 1)  # the most guesses a step verifies
    model = None
    what = "bundled SmolLM2-135M Q4_1"
    if a.shape is not None:
        from kvcli.bench.shapes import shape_file

        model, what = str(shape_file(a.shape, a.kind)), f"random-weight {a.shape} shape {a.kind}"
    llm = LLM(model, prefix_caching=True, max_model_len=max(contexts) + max(rows) + 16, kv_budget="512MiB",
              speculate="ngram", num_speculative_tokens=k, draft_length="fixed")
    eng = llm.engine
    eng.scheduler.proposer = GivenGuesses(k)
    block = eng.options.block_size
    ids = llm.tokenizer.encode(sample_text("heldout-gpl-3.0.txt") * 4)
    load_before = load1()

    def step_ms(context: int, n: int) -> float:
        # the new token's block is partial, never cached: each call computes its rows again
        eng.add_request(ids[:context + 1], SamplingParams(max_tokens=n + 1, ignore_eos=True))
        eng.step()  # the new token's row
        proposed = eng.scheduler.spec_stats().proposed
        t = time.perf_counter()
        eng.step()  # its sampled token's row and n - 1 guesses
        ms = (time.perf_counter() - t) * 1e3
        guesses = eng.scheduler.spec_stats().proposed - proposed
        if guesses != n - 1:
            raise SystemExit(f"verify-step: a {n}-row step verified {guesses} guesses, not {n - 1}")
        while eng.has_unfinished():
            eng.step()
        return ms

    for c in contexts:
        assert c % block == 0, f"contexts must be multiples of the block size ({block})"
        eng.add_request(ids[:c], SamplingParams(max_tokens=1, ignore_eos=True))  # caches the context
        while eng.has_unfinished():
            eng.step()
        for n in rows:
            step_ms(c, n)  # warm-up
    samples: dict[tuple[int, int], list[float]] = {}
    for _ in range(a.rounds):
        for c in contexts:
            for n in rows:
                samples.setdefault((c, n), []).append(step_ms(c, n))
    print(busy_note(load_before, load1()))
    print(f"{what}, {eng.linear_mode} weights, {eng.kv_dtype.name} KV, batch 1; median of "
          f"{a.rounds} rounds")
    cfg = eng.config
    row_macs = cfg.layer_linear_macs() + cfg.vocab_size * cfg.hidden_size
    one = sum(lin.in_features * lin.out_features for lin in eng.model.linears()
              if lin.mode == "int8dot-cpu" and lin.plan.route.one_level)
    products = 2 * row_macs - one  # the vocabulary projection: two levels
    peak = int8_peak() if eng.linear_mode == "int8dot-cpu" else None
    fp32 = fp32_peak() if peak is not None else None
    linear_ms = None if peak is None else products / peak[0] * 1e3

    def attention_fmas(context: int) -> int:
        """A row's decode attention over `context` keys: scores and values, one fp32 FMA per key and dimension
        each, for every q head of every layer (the rows' own few keys left out)."""
        return 2 * cfg.num_layers * cfg.num_heads * context * cfg.head_dim

    def row_floor_ms(context: int) -> float | None:
        if linear_ms is None or fp32 is None:
            return None
        return linear_ms + attention_fmas(context) / fp32[0] * 1e3

    def floor(context: int, n: int, base: float) -> str:
        row_ms = row_floor_ms(context)
        if row_ms is None:
            return "n/a"
        if a.shape is None:  # the 1-row step is arithmetic: further rows add theirs
            return f"{1 + (n - rows[0]) * row_ms / base:.2f}x"
        return f"{max(1.0, n * row_ms / base):.2f}x"  # memory-bound: the rows' arithmetic may overlap the reads

    if linear_ms is not None and fp32 is not None:
        print(f"a row's multiply-adds: {row_macs / 1e6:.1f} M, {one / 1e6:.1f} M of them at one int8 level, the rest "
              f"two: {products / 1e6:.1f} M int8 products; {peak[1]}: {peak[0] / 1e12:.3f} TMAC/s on every thread: "
              f"{linear_ms:.2f} ms a row")
        print(f"a row's attention: {', '.join(f'{attention_fmas(c) / 1e6:.1f} M' for c in contexts)} fp32 FMAs at "
              f"{', '.join(map(str, contexts))} keys; {fp32[1]}: {fp32[0] / 1e9:.1f} G/s on every thread: "
              f"{', '.join(f'{attention_fmas(c) / fp32[0] * 1e3:.2f} ms' for c in contexts)} a row")
    print()
    print("| context | query rows | step ms | vs 1 row | floor vs 1 row |")
    print("|---:|---:|---:|---:|---:|")
    for c in contexts:
        base = statistics.median(samples[(c, rows[0])])
        for n in rows:
            ms = statistics.median(samples[(c, n)])
            print(f"| {c} | {n} | {ms:.2f} | {ms / base:.2f}x | {floor(c, n, base)} |")
    for c in contexts:
        if 6 in rows and 1 in rows:
            r = statistics.median(samples[(c, 6)]) / statistics.median(samples[(c, 1)])
            print(f"goal a 6-row verification step <= 1.3x a 1-row step at {c}: {'met' if r <= 1.3 else 'missed'} "
                  f"({r:.2f}x)")
    return 0
