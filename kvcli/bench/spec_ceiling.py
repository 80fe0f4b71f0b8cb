"""How far prompt lookup can take speculation on a text, whatever verification costs: the ceiling of the speedup.

The greedy continuation of each prompt (kvcli, plain decode) is replayed through kvcli's own proposer and back-off
(spec_decode/prompt_lookup.py, backoff.py) at each --num-speculative-tokens k: at every step the guesses are
those the engine's scheduler would ask for, and the step accepts the leading guesses equal to the greedy tokens
(what verification does under greedy decoding) plus the model's own token. Tokens per step is then the speedup
speculation would give if a step verifying k guesses cost no more than a plain one; a real step costs more
(python -m kvcli.bench verify-step), so the measured speedup (spec-default) stays below it.

The replay is checked against the engine in the same run: kvcli with --speculate ngram at the default k, held
fixed (--draft-length fixed: the replay knows no step costs), on the first prompt of each text must make the same
number of steps (a differing count fails the run).

Prompts: spec.py's texts (kvcli's own scheduler + block manager source as "code", samples/keepers-log.txt as
"prose"), --windows windows of --prompt-tokens at different offsets, --new-tokens greedy tokens each.
"""

from __future__ import annotations

import argparse
import statistics

from kvcli.bench.harness import busy_note, load1

KS = (1, 2, 3, 4, 5, 6, 7)


def replay(prompt: list[int], greedy: list[int], k: int, ngram_min: int, ngram_max: int) -> int:
    """Steps the engine takes to produce `greedy` after `prompt` with prompt lookup at k (greedy decoding)."""
    from kvcli.spec_decode.backoff import AdaptiveBackoff
    from kvcli.spec_decode.prompt_lookup import PromptLookupProposer

    proposer, backoff = PromptLookupProposer(k, ngram_min, ngram_max), AdaptiveBackoff()
    tokens, done, steps = list(prompt), 0, 0
    while done < len(greedy):
        limit = len(greedy) - done - 1  # the scheduler's: one fewer than the tokens still to produce
        guesses = []
        if limit > 0 and backoff.should_propose("r"):
            guesses = proposer.propose("r", len(tokens), lambda a, b: tokens[a:b], limit)
        accepted = 0
        while accepted < len(guesses) and guesses[accepted] == greedy[done + accepted]:
            accepted += 1
        if guesses:
            backoff.record("r", len(guesses), accepted)
        new = greedy[done:done + accepted + 1]
        tokens.extend(new)
        done += len(new)
        steps += 1
    return steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcli.bench spec-ceiling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--windows", type=int, default=6, help="prompts per text (windows at different offsets)")
    a = ap.parse_args(argv)

    from kvcli.bench.spec import texts
    from kvcli.config import SamplingParams
    from kvcli.engine.llm_engine import EngineOptions, LLMEngine
    from kvcli.llm import LLM
    from kvcli.model.loader import load_weights

    load_before = load1()
    loaded = load_weights(None)
    opts = EngineOptions(kv_budget="512MiB", max_model_len=2048)
    plain = LLMEngine(loaded, opts)
    spec = LLMEngine(loaded, EngineOptions(kv_budget="512MiB", max_model_len=2048, speculate="ngram",
                                           draft_length="fixed"), model=plain.model)  # the replay's fixed k
    k0, nmin, nmax = spec.options.num_speculative_tokens, spec.options.ngram_min, spec.options.ngram_max
    params = SamplingParams(max_tokens=a.new_tokens, ignore_eos=True)
    rows, checks = [], []
    for name, prompts in texts(a.prompt_tokens, a.windows, loaded.tokenizer).items():
        for i, prompt in enumerate(prompts):  # one at a time, as the engine check runs it
            greedy = list(LLM.from_engine(plain).generate([prompt], params)[0].token_ids)
            rows.append((name, i, [len(greedy) / replay(prompt, greedy, k, nmin, nmax) for k in KS]))
            if i == 0:  # the engine itself on this prompt, at its default k
                s0, t0 = spec.scheduler.sample_steps, spec.scheduler.sample_tokens
                got = LLM.from_engine(spec).generate([prompt], params)[0].token_ids
                steps, made = spec.scheduler.sample_steps - s0, spec.scheduler.sample_tokens - t0
                checks.append((name, list(got) == greedy, made, steps, replay(prompt, greedy, k0, nmin, nmax)))
    print(busy_note(load_before, load1()))
    print(f"bundled model, greedy; {a.windows} prompts of {a.prompt_tokens} tokens per text, {a.new_tokens} new "
          f"tokens each; prompt lookup n-grams {nmin}-{nmax} with kvcli's back-off\n")
    print("tokens per step = the decode speedup if verifying the guesses cost nothing\n")
    print("| text | prompt | " + " | ".join(f"k={k}" for k in KS) + " |")
    print("|---|---:|" + "---:|" * len(KS))
    for name, i, tps in rows:
        print(f"| {name} | {i} | " + " | ".join(f"{t:.2f}" for t in tps) + " |")
    for name in dict.fromkeys(r[0] for r in rows):
        means = [statistics.mean(r[2][j] for r in rows if r[0] == name) for j in range(len(KS))]
        print(f"| {name} | mean | " + " | ".join(f"{t:.2f}" for t in means) + " |")
    print()
    ok = True
    for name, same, made, steps, replayed in checks:
        ok &= same and steps == replayed
        print(f"engine check, {name} prompt 0, k={k0}: greedy output {'identical' if same else 'DIFFERS'}; "
              f"{made} tokens in {steps} steps, the replay {replayed} steps: "
              f"{'the same' if steps == replayed else 'DIFFERENT'}")
    for name in dict.fromkeys(r[0] for r in rows):
        best = max(statistics.mean(r[2][j] for r in rows if r[0] == name) for j in range(len(KS)))
        print(f"{name}: at most {best:.2f} tokens per step at any k (mean over its prompts): a speedup of 1.8x "
              f"{'is within' if best >= 1.8 else 'is beyond'} this ceiling")
    return 0 if ok else 1
