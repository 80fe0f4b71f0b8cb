"""llama.cpp's side of the benchmarks, run by kvcli/bench/llama_cpp_runner.py inside the benchmark-only venv that scripts/build_llama_cpp.sh
builds (never imports kvcli). Reads a JSON job on stdin, prints one JSON result on stdout.

It drives llama.cpp's C API (llama-cpp-python's ctypes bindings) with kvcli's token ids, so both
engines see exactly the same tokens:
  batch 1   prefill of N tokens from an empty cache (n_batch chunks), then greedy decode steps of one
            token each; tok/s = tokens / wall time of those llama_decode calls (+ argmax).
  trace     the request trace with `parallel` sequences in flight: every step one llama_decode of a
            batch holding each running sequence's next token and new requests' prompt tokens (what
            llama.cpp's server does with --parallel); greedy, each request runs to its max_tokens.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import llama_cpp as L  # run by its path, so nothing in kvcli/bench/ may be named llama_cpp (it would stand in)


class Engine:
    def __init__(self, model_path: str, n_ctx: int, n_seq: int, threads: int, n_batch: int = 512) -> None:
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(model_path.encode(), mp)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {model_path}")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_batch, n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = True  # one pool shared by all sequences, like a paged cache
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.mem = L.llama_get_memory(self.ctx)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.batch = L.llama_batch_init(n_batch, 0, n_seq)

    def decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """items: (token, pos, seq, wants_logits); returns the argmax token of every wanted row."""
        b = self.batch
        for i, (tok, pos, seq, want) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        if L.llama_decode(self.ctx, b) != 0:
            raise SystemExit("llama_decode failed (context full?)")
        out = []
        for i, (_, _, _, want) in enumerate(items):
            if want:
                row = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                out.append(int(row.argmax()))
        return out

    def clear(self, seq: int = -1) -> None:
        L.llama_memory_seq_rm(self.mem, seq, -1, -1)

    def prefill(self, ids: list[int], seq: int = 0) -> int:
        nxt = -1
        for s in range(0, len(ids), self.n_batch):
            chunk = ids[s:s + self.n_batch]
            last = s + len(chunk) == len(ids)
            got = self.decode([(t, s + j, seq, last and j == len(chunk) - 1) for j, t in enumerate(chunk)])
            nxt = got[0] if got else nxt
        return nxt


def batch1(job: dict) -> list[dict]:
    rows = []
    for n in job["contexts"]:
        ids = job["prompt_ids"][:n]
        m = job["new_tokens"]
        eng = Engine(job["model"], n + m + 16, 1, job["threads"])
        best_p = best_d = float("inf")
        for _ in range(job["repeats"] + 1):  # the first pass is a warm-up
            eng.clear()
            t = time.perf_counter()
            tok = eng.prefill(ids)
            tp = time.perf_counter() - t
            t = time.perf_counter()
            for k in range(m):
                tok = eng.decode([(tok, n + k, 0, True)])[0]
            td = time.perf_counter() - t
            best_p, best_d = min(best_p, tp), min(best_d, td)
        rows.append({"context": n, "prefill_tok_s": n / best_p, "decode_tok_s": m / best_d})
        L.llama_free(eng.ctx)
    return rows


def trace(job: dict) -> dict:
    reqs = job["trace"]
    par = job["parallel"]
    eng = Engine(job["model"], job["n_ctx"], par, job["threads"])
    queue = list(range(len(reqs)))
    slots: dict[int, dict] = {}  # seq id -> running request state
    produced = [0] * len(reqs)
    t0 = time.perf_counter()
    while queue or slots:
        items: list[tuple[int, int, int, bool]] = []
        owners: list[int] = []  # seq of each wanted row, in order
        for seq, st in slots.items():  # decoding sequences: one token each
            items.append((st["tok"], st["pos"], seq, True))
            owners.append(seq)
        free = [s for s in range(par) if s not in slots]
        while queue and free and len(items) + len(reqs[queue[0]]["prompt"]) <= eng.n_batch:
            r, seq = queue.pop(0), free.pop(0)
            ids = reqs[r]["prompt"]
            items += [(t, j, seq, j == len(ids) - 1) for j, t in enumerate(ids)]
            owners.append(seq)
            slots[seq] = {"req": r, "pos": len(ids) - 1, "tok": -1}
        if not items:  # a prompt longer than n_batch alone: prefill it in chunks
            r, seq = queue.pop(0), free.pop(0)
            ids = reqs[r]["prompt"]
            slots[seq] = {"req": r, "pos": len(ids), "tok": eng.prefill(ids, seq)}
            produced[r] = 1
            continue
        for seq, tok in zip(owners, eng.decode(items)):
            st = slots[seq]
            st["pos"] += 1  # a new request's first output goes right after its prompt
            st["tok"] = tok
            produced[st["req"]] += 1
        for seq in [s for s, st in slots.items() if produced[st["req"]] >= reqs[st["req"]]["max_tokens"]]:
            eng.clear(seq)
            del slots[seq]
    wall = time.perf_counter() - t0
    return {"output_tokens": sum(produced), "wall_s": wall, "tok_s": sum(produced) / wall, "parallel": par}


def main() -> None:
    job = json.load(sys.stdin)
    out = {"llama_cpp_version": L.__version__, "system_info": L.llama_print_system_info().decode()}
    print(out["system_info"], file=sys.stderr, flush=True)  # the build's features, for the caller's note if it dies
    if job.get("contexts"):
        out["batch1"] = batch1(job)
    if job.get("trace"):
        out["trace"] = trace(job)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
