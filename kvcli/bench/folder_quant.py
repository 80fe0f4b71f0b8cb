"""What `--quant` costs on a dense Hugging Face folder (issue #30, item 5): the bundled model's weights saved as a
float32 folder (the GGUF dequantized, so every row starts from the same values), run as kvcli's own int4 (group
32, the integer kernel), as NF4 through bitsandbytes (where installed), unquantized, and the GGUF itself (Q4_1),
each priced by perplexity on samples/keepers-log.txt (windows of 512 tokens, stride 256, kvcli perplexity's
exact scoring) and by greedy decode tok/s after a 128-token prompt, rounds alternating between the forms
(ratios within rounds, medians over rounds).
"""

from __future__ import annotations

import argparse
import os
import statistics

from kvcli.bench.harness import REPO

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcli.bench folder-quant", description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    a = ap.parse_args(argv)

    from kvcli.bench.internals import document_ids, perplexity
    from kvcli.bench.kquants import decode_tok_s
    from kvcli.bench.lm_eval_check import hf_folder
    from kvcli.llm import LLM
    from kvcli.model.loader import bitsandbytes_available

    folder = hf_folder()
    forms = {"GGUF Q4_1 (bundled)": (None, "auto"), "folder --quant int4": (str(folder), "int4"),
             "folder --quant none (fp32)": (str(folder), "none")}
    if bitsandbytes_available():
        forms["folder --quant nf4 (bitsandbytes)"] = (str(folder), "nf4")
    else:
        print("bitsandbytes is not installed: no NF4 row")
    text = (REPO / "samples" / "keepers-log.txt").read_text(encoding="utf-8")
    llms = {name: LLM(model, quant=quant, kv_budget="256MiB") for name, (model, quant) in forms.items()}
    ppl, paths = {}, {}
    for name, llm in llms.items():
        ids = document_ids(llm.tokenizer, text)
        ppl[name] = perplexity(llm.engine, ids, 512, 256)
        paths[name] = llm.engine.model.linear_mode
    prompt = document_ids(llms["GGUF Q4_1 (bundled)"].tokenizer, text)[:128]
    rounds: dict[str, list[float]] = {name: [] for name in llms}
    for r in range(a.rounds):
        for name, llm in llms.items():
            rounds[name].append(decode_tok_s(llm, prompt, a.new_tokens, 1, warm=r == 0))
    ref = "GGUF Q4_1 (bundled)"
    print(f"\nbundled SmolLM2-135M: perplexity on samples/keepers-log.txt (windows 512, stride 256), greedy decode of "
          f"{a.new_tokens} tokens after 128, {a.rounds} rounds alternating\n")
    print(f"{'form':36} {'linears':>14} {'perplexity':>11} {'decode tok/s':>13} {'vs GGUF':>8}  rounds")
    for name in llms:
        ratio = statistics.median(x / y for x, y in zip(rounds[name], rounds[ref]))
        print(f"{name:36} {paths[name]:>14} {ppl[name].perplexity:11.3f} {statistics.median(rounds[name]):13.1f} "
              f"{ratio:7.3f}x  {', '.join(f'{x:.1f}' for x in rounds[name])}")
    return 0
