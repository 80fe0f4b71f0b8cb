"""lm-evaluation-harness against `kvcli serve` (issue #31, item 5): lm-eval's `local-completions` client
runs a small loglikelihood task from a local file against `kvcli serve` and its own `hf` backend runs the
same task on the same weights; every item's log-likelihood must agree within 1e-3.

Weights: the bundled GGUF dequantized once into a float32 Hugging Face folder (.cache/lm-eval/, reused),
served by `kvcli serve --quant none --kv-dtype fp32` (dense: a folder is NF4 by default) and loaded by lm-eval's hf backend with dtype float32. Task: N
multiple-choice items cut from samples/keepers-log.txt (a context of a few sentences, its true next
sentence and three others), written as JSONL beside a task YAML (dataset_path json: nothing from a hub).
lm-eval sends token ids (its huggingface tokenizer, the folder's) with echo and logprobs=1, max_tokens 1.

lm-eval is never a kvcli dependency: it runs from its own venv outside the clone, which
scripts/build_lm_eval.sh creates once (`make test` runs it) and names (--where); its torch and transformers
are kvcli's (this venv's site-packages appended to its path). --lm-eval-python points elsewhere.
  python -m kvcli.bench lm-eval [--items 24] [--save]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import site
import subprocess
import sys
import tempfile
from pathlib import Path

from kvcli.bench.serve import start_server

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "lm-eval"
SCRIPT = REPO / "scripts" / "build_lm_eval.sh"


def lm_eval_python() -> Path:
    """Where scripts/build_lm_eval.sh puts lm-eval's python (built or not)."""
    return Path(subprocess.run(["bash", str(SCRIPT), "--where"], capture_output=True, text=True,
                               timeout=30).stdout.strip())
TOL = 1e-3

TASK = """task: kvcli_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""

# Runs in lm-eval's venv: both backends over the task, each item's log-likelihood per choice as JSON.
WORKER = r"""
import json, site, sys
site.addsitedir(sys.argv[4])  # kvcli's torch and transformers, after lm-eval's own packages
import lm_eval
from lm_eval.tasks import TaskManager
folder, task_dir, url = sys.argv[1:4]
tm = TaskManager(include_path=task_dir)
out = {}
for name, model, args in [
    ("kvcli serve", "local-completions",
     f"model=kvcli,base_url={url}/v1/completions,tokenizer={folder},tokenizer_backend=huggingface,"
     "num_concurrent=1,max_retries=1,tokenized_requests=True,max_length=512"),
    ("hf", "hf", f"pretrained={folder},dtype=float32,device=cpu,max_length=512"),
]:
    r = lm_eval.simple_evaluate(model=model, model_args=args, tasks=["kvcli_ll"], task_manager=tm,
                                log_samples=True, batch_size=1)
    samples = sorted(r["samples"]["kvcli_ll"], key=lambda s: s["doc_id"])
    out[name] = {"acc": r["results"]["kvcli_ll"]["acc,none"],
                 "ll": [[float(c[0]) for c in s["filtered_resps"]] for s in samples]}
print("RESULT " + json.dumps(out))
"""


def hf_folder() -> Path:
    """The bundled GGUF as a float32 Hugging Face folder (written once)."""
    out = CACHE / "smollm2-135m-f32"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcli.model.loader import bundled_gguf_path

    g = bundled_gguf_path()
    m = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32)
    cfg = m.config
    cfg.__dict__.pop("quantization_config", None)  # the dequantized tensors, saved as a plain folder
    plain = type(m)(cfg).to(torch.float32)
    plain.load_state_dict(m.state_dict())
    plain.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name).save_pretrained(str(out))
    return out


def items(n: int, seed: int = 0) -> list[dict]:
    text = (REPO / "samples" / "keepers-log.txt").read_text(encoding="utf-8")
    sents = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 20 <= len(s.strip()) <= 160]
    rng = random.Random(seed)
    out = []
    for i in rng.sample(range(3, len(sents) - 1), n):
        others = rng.sample([s for j, s in enumerate(sents) if j != i + 1], 3)
        choices = [" " + sents[i + 1]] + [" " + s for s in others]
        order = list(range(4))
        rng.shuffle(order)
        out.append({"context": " ".join(sents[i - 3:i + 1]), "choices": [choices[k] for k in order],
                    "label": order.index(0)})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=24)
    ap.add_argument("--lm-eval-python", type=Path, default=None, help="default: scripts/build_lm_eval.sh --where")
    a = ap.parse_args(argv)
    a.lm_eval_python = a.lm_eval_python or lm_eval_python()
    if not a.lm_eval_python.is_file():
        raise SystemExit(f"lm-eval's python not found at {a.lm_eval_python}: run scripts/build_lm_eval.sh")
    ver = subprocess.run([str(a.lm_eval_python), "-c", "import importlib.metadata as m; print(m.version('lm_eval'))"],
                         capture_output=True, text=True).stdout.strip()
    folder = hf_folder()
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "items.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in items(a.items)), encoding="utf-8")
        (Path(tmp) / "kvcli_ll.yaml").write_text(TASK.format(data=data), encoding="utf-8")
        proc, url = start_server(["--model", str(folder), "--quant", "none", "--kv-dtype", "fp32", "--max-model-len", "512",
                                  "--max-num-seqs", "4", "--served-model-name", "kvcli"])
        try:
            print(f"lm-eval {ver}; task: {a.items} multiple-choice items from samples/keepers-log.txt (4 choices each)")
            print(f"weights: {folder.relative_to(REPO)} (the bundled GGUF dequantized to float32)")
            print(f"kvcli serve --model {folder.name} --quant none --kv-dtype fp32 -> {url}; lm-eval local-completions "
                  "(token ids, echo, logprobs=1) and lm-eval hf (dtype float32, cpu)")
            env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
            r = subprocess.run([str(a.lm_eval_python), "-c", WORKER, str(folder), tmp, url, site.getsitepackages()[0]],
                               capture_output=True, text=True, env=env)
        finally:
            proc.terminate()
            proc.wait(30)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"lm-eval failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    res = json.loads(line[7:])
    k, h = res["kvcli serve"]["ll"], res["hf"]["ll"]
    diffs = [abs(x - y) for a_, b_ in zip(k, h) for x, y in zip(a_, b_)]
    print(f"{'item':>4}  {'choice log-likelihoods, kvcli serve':<44} {'hf':<44} max |diff|")
    for i, (a_, b_) in enumerate(zip(k, h)):
        print(f"{i:>4}  {' '.join(f'{x:9.4f}' for x in a_):<44} {' '.join(f'{y:9.4f}' for y in b_):<44} "
              f"{max(abs(x - y) for x, y in zip(a_, b_)):.2e}")
    print(f"acc: kvcli serve {res['kvcli serve']['acc']:.4f} · hf {res['hf']['acc']:.4f}")
    worst = max(diffs)
    print(f"per-item log-likelihood agreement: max |diff| {worst:.2e} over {len(diffs)} (item, choice) pairs "
          f"(goal <= {TOL:g}) -> {'met' if worst <= TOL else 'MISSED'}")
    sys.exit(0 if worst <= TOL else 1)


if __name__ == "__main__":
    main()
