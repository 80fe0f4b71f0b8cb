"""Request traces for `kvcli profile`: synthetic ones shaped like published datasets, or JSONL.

Synthetic lengths are log-normal (both datasets are right-skewed: many short requests, a long tail),
with the means of the vLLM paper's Fig. 11 and a spread chosen per dataset:
  sharegpt  prompt mean 161, output mean 338 tokens, sigma 1.0 (conversations: wide spread)
  alpaca    prompt mean 19,  output mean 58 tokens,  sigma 0.5 (instructions: narrow spread)
  uniform   prompt and output uniform in [32, 512]
Lengths are clipped to [4, max_len / 2] so every request fits the context; the report prints the
realised means. Arrivals are Poisson at --request-rate (requests/s), or all at t=0 for `inf`.
Prompts for real-model runs are windows of the bundled sample text's tokens, so the model sees
real text of the drawn length; outputs run to their drawn length (EOS ignored), as in vLLM's
throughput benchmarks.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

SHAPES = {
    "sharegpt": (161.0, 338.0, 1.0),
    "alpaca": (19.0, 58.0, 0.5),
}
WORKLOADS = ("sharegpt", "alpaca", "uniform")
SAMPLE_TEXT = Path(__file__).resolve().parent.parent / "samples" / "keepers-log.txt"


class WorkloadError(ValueError):
    pass


@dataclass(frozen=True)
class TraceRequest:
    prompt_len: int
    max_tokens: int
    arrival_s: float
    prompt_text: str | None = None  # JSONL traces carry text; synthetic ones only lengths


@dataclass(frozen=True)
class Trace:
    name: str
    requests: list[TraceRequest]

    @property
    def mean_prompt(self) -> float:
        return sum(r.prompt_len for r in self.requests) / max(1, len(self.requests))

    @property
    def mean_output(self) -> float:
        return sum(r.max_tokens for r in self.requests) / max(1, len(self.requests))


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    # mean = exp(mu + sigma^2 / 2)
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise WorkloadError(f"--request-rate must be > 0 or inf (got {rate})")
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def synthetic(name: str, n: int, max_len: int, rate: float = math.inf, seed: int = 0) -> Trace:
    if n <= 0:
        raise WorkloadError(f"--num-requests must be > 0 (got {n})")
    rng = random.Random(seed)
    cap = max(4, max_len // 2)

    def clip(x: float) -> int:
        return int(min(cap, max(4, round(x))))

    if name in SHAPES:
        p_mean, o_mean, sigma = SHAPES[name]
        lens = [(clip(_lognormal(rng, p_mean, sigma)), clip(_lognormal(rng, o_mean, sigma))) for _ in range(n)]
    elif name == "uniform":
        lens = [(clip(rng.randint(32, 512)), clip(rng.randint(32, 512))) for _ in range(n)]
    else:
        raise WorkloadError(f"unknown workload {name!r} (choose {', '.join(WORKLOADS)} or a .jsonl file)")
    times = arrivals(n, rate, rng)
    return Trace(name, [TraceRequest(p, o, t) for (p, o), t in zip(lens, times)])


def from_jsonl(path: Path, rate: float = math.inf, seed: int = 0, n: int | None = None) -> Trace:
    """One JSON object per line: {"prompt": "...", "max_tokens": N}. Blank lines are skipped."""
    if not path.is_file():
        raise WorkloadError(f"{path}: no such file")
    reqs: list[tuple[str, int]] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise WorkloadError(f"{path}: not valid UTF-8") from None
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise WorkloadError(f"{path}:{i}: expected an object with a non-empty \"prompt\" string")
        mt = obj.get("max_tokens", 128)
        if not isinstance(mt, int) or isinstance(mt, bool) or mt <= 0:
            raise WorkloadError(f"{path}:{i}: \"max_tokens\" must be a positive integer")
        reqs.append((obj["prompt"], mt))
    if not reqs:
        raise WorkloadError(f"{path}: no requests")
    if n is not None:
        reqs = reqs[:n]
    times = arrivals(len(reqs), rate, random.Random(seed))
    return Trace(path.name, [TraceRequest(0, mt, t, prompt_text=p) for (p, mt), t in zip(reqs, times)])


def load(spec: str, n: int, max_len: int, rate: float = math.inf, seed: int = 0) -> Trace:
    if spec.endswith(".jsonl") or Path(spec).is_file():
        return from_jsonl(Path(spec), rate, seed, n)
    return synthetic(spec, n, max_len, rate, seed)


def prompt_ids(trace: Trace, tokenizer, seed: int = 0) -> list[list[int]]:
    """Token ids for each request: JSONL text tokenized, synthetic lengths cut from the sample text."""
    out: list[list[int]] = []
    corpus: list[int] = []
    rng = random.Random(seed + 1)
    for r in trace.requests:
        if r.prompt_text is not None:
            out.append(tokenizer.encode(r.prompt_text))
            continue
        if not corpus:
            corpus = tokenizer.encode(SAMPLE_TEXT.read_text(encoding="utf-8")) if tokenizer else []
            if not corpus:
                corpus = list(range(3, 259))
        start = rng.randrange(len(corpus))
        ids = [corpus[(start + i) % len(corpus)] for i in range(r.prompt_len)]
        out.append(ids)
    return out
