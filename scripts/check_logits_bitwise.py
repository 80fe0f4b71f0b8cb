"""Records every logit the engine computes for fixed prompts, or compares a run with such a record
bit for bit (torch.equal). For changes that must not move a single bit (per-step overhead work):
record on the code before, compare after each change.

Runs on the bundled model: INT4 (default path) and --dequantize (dense fp32), each at batch 1 and batch
6 (mixed prompt lengths, so prefill chunks ride beside decodes, then batched decode), plus batch 6 with
n-gram speculation (logits of guess rows) and batch 6 with seeded top-k / top-p / temperature samples
(the sampled tokens are compared too). Every forward's full [rows, vocab] logits are kept.

  python scripts/check_logits_bitwise.py --record /tmp/logits-before.pt
  python scripts/check_logits_bitwise.py --compare /tmp/logits-before.pt     # exit 1 on any difference
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

PROMPT_SLICES = ((0, 40), (50, 125), (130, 260), (300, 317), (320, 620), (700, 764))


def run_case(model, loaded, ids: list[int], batch: int, sampled: bool, speculate: str,
             new_tokens: int) -> dict:
    from kvcli.config import SamplingParams
    from kvcli.engine.llm_engine import EngineOptions, LLMEngine

    engine = LLMEngine(loaded, EngineOptions(device="cpu", kv_budget="128MiB", max_model_len=2048,
                                             max_num_batched_tokens=256, speculate=speculate), model=model)
    logits: list[torch.Tensor] = []
    forward = model.forward

    def capture(*args, **kwargs):
        out = forward(*args, **kwargs)
        logits.append(out.detach().clone())
        return out

    model.forward = capture  # instance attribute: the runner's call goes through it
    try:
        for b in range(batch):
            a, z = PROMPT_SLICES[b]
            if sampled:
                params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.7 + 0.1 * b,
                                        top_k=(0, 40, 0, 5, 100, 0)[b], top_p=(0.9, 1.0, 0.5, 1.0, 0.95, 1.0)[b],
                                        seed=17 + b)
            else:
                params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
            engine.add_request(ids[a:z], params, req_id=f"q{b}")
        while engine.has_unfinished():
            engine.step()
    finally:
        del model.forward
    tokens = {f"q{b}": engine.completion(f"q{b}").token_ids for b in range(batch)}
    return {"logits": logits, "tokens": tokens}


CASES = (  # name, batch, sampled, speculate
    ("b1", 1, False, "none"),
    ("b6", 6, False, "none"),
    ("b6-sampled", 6, True, "none"),
    ("b6-ngram", 6, False, "ngram"),
)


def collect(new_tokens: int) -> dict:
    from kvcli.engine.llm_engine import EngineOptions, LLMEngine
    from kvcli.model.loader import load_weights

    sample = open(os.path.join(os.path.dirname(__file__), "..", "samples", "keepers-log.txt"), encoding="utf-8").read()
    result = {}
    for mode, dequantize in (("int4", False), ("dense", True)):
        loaded = load_weights(None)
        ids = loaded.tokenizer.encode(sample)
        model = LLMEngine(loaded, EngineOptions(device="cpu", kv_budget="16MiB", dequantize=dequantize)).model
        for name, batch, sampled, speculate in CASES:
            if mode == "dense" and name != "b1" and name != "b6":
                continue  # the dense path's rows: batch 1 and 6 are enough
            result[f"{mode}/{name}"] = run_case(model, loaded, ids, batch, sampled, speculate, new_tokens)
    return result


def compare(got: dict, want: dict) -> list[str]:
    bad = []
    for case, w in want.items():
        g = got.get(case)
        if g is None:
            bad.append(f"{case}: missing")
            continue
        if g["tokens"] != w["tokens"]:
            bad.append(f"{case}: sampled tokens differ")
        if len(g["logits"]) != len(w["logits"]):
            bad.append(f"{case}: {len(g['logits'])} forwards, recorded {len(w['logits'])}")
            continue
        for i, (a, b) in enumerate(zip(g["logits"], w["logits"])):
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
                diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else float("nan")
                bad.append(f"{case}: forward {i} logits differ (shape {tuple(a.shape)} vs {tuple(b.shape)}, "
                           f"max |diff| {diff:.3g})")
                break
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--record", metavar="PT")
    g.add_argument("--compare", metavar="PT")
    ap.add_argument("--new-tokens", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(1)  # the same kernels' reduction order as the record
    got = collect(a.new_tokens)
    if a.record:
        torch.save(got, a.record)
        print(f"recorded {sum(len(c['logits']) for c in got.values())} forwards of {len(got)} cases to {a.record}")
        return
    bad = compare(got, torch.load(a.compare))
    n = sum(len(c["logits"]) for c in got.values())
    if bad:
        print("\n".join(bad))
        sys.exit(1)
    print(f"bitwise identical: {n} forwards' logits and every sampled token in {len(got)} cases")


if __name__ == "__main__":
    main()
