"""llama.cpp's side of the conformance suite, run with the python of the venv that
scripts/build_llama_cpp_python.sh builds (llama-cpp-python; never imports kvcli). One JSON job on stdin:

  {"model": PATH, "tokens": [ids], "logits_out": PATH.npy, "greedy": N, "texts": [str, ...]}

It loads the GGUF through llama.cpp's C API with an F32 KV cache and flash attention off (so the only
rounding left is the weights' own), evaluates `tokens` in one batch from an empty cache with logits for
every row, saves them as float32 [len(tokens), n_vocab] to logits_out, then decodes N greedy tokens after
them, and tokenizes each text (no BOS added; special tokens such as <|im_start|> parsed as the control tokens they name unless "parse_special" is false, as kvcli's encode does), and detokenizes those ids again
(llama_detokenize, remove_special and unparse_special false). Prints one JSON line:
{"greedy": [...], "tokenized": [[...], ...], "detokenized": [str, ...], "n_vocab": V, "llama_cpp_version": ...}, or exits non-zero
with one line on stderr ("load failed: ..." when llama.cpp refuses the file).
"""

from __future__ import annotations

import ctypes
import json
import sys

import numpy as np
import llama_cpp as L

GGML_TYPE_F32 = 0


def main() -> int:
    job = json.load(sys.stdin)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(job["model"].encode(), mp)
    if not model:
        print("load failed: llama.cpp could not load the model", file=sys.stderr)
        return 3
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    out = {"n_vocab": n_vocab, "llama_cpp_version": L.__version__}

    tokenized = []
    for text in job.get("texts", []):
        raw = text.encode("utf-8")
        cap = len(raw) + 16
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(vocab, raw, len(raw), buf, cap, False, bool(job.get("parse_special", True)))
        if n < 0:
            print(f"tokenize failed ({n})", file=sys.stderr)
            return 4
        tokenized.append([int(buf[i]) for i in range(n)])
    out["tokenized"] = tokenized
    detokenized = []
    for ids in tokenized:
        buf = (L.llama_token * max(len(ids), 1))(*ids)
        cap = 16 * len(ids) + 16
        text = ctypes.create_string_buffer(cap)
        n = L.llama_detokenize(vocab, buf, len(ids), text, cap, False, False)
        detokenized.append(text.raw[:n].decode("utf-8", "replace") if n >= 0 else None)
    out["detokenized"] = detokenized

    tokens = job.get("tokens") or []
    if tokens:
        greedy = int(job.get("greedy", 0))
        cp = L.llama_context_default_params()
        n = len(tokens)
        cp.n_ctx = n + greedy + 16
        cp.n_batch = cp.n_ubatch = n
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = int(job.get("threads", 2))
        cp.type_k = cp.type_v = GGML_TYPE_F32
        if hasattr(cp, "flash_attn_type"):
            cp.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED
        else:
            cp.flash_attn = False
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            print("context failed", file=sys.stderr)
            return 5
        batch = L.llama_batch_init(n, 0, 1)
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, True
            batch.seq_id[i][0] = 0
        batch.n_tokens = n
        if L.llama_decode(ctx, batch) != 0:
            print("llama_decode failed", file=sys.stderr)
            return 6
        ptr = L.llama_get_logits(ctx)
        logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n, n_vocab)).copy()
        np.save(job["logits_out"], logits.astype(np.float32))
        nxt = int(logits[-1].argmax())
        gen = []
        one = L.llama_batch_init(1, 0, 1)
        for k in range(greedy):
            gen.append(nxt)
            one.token[0], one.pos[0], one.n_seq_id[0], one.logits[0] = nxt, n + k, 1, True
            one.seq_id[0][0] = 0
            one.n_tokens = 1
            if L.llama_decode(ctx, one) != 0:
                print("llama_decode failed", file=sys.stderr)
                return 6
            row = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, 0), shape=(n_vocab,))
            nxt = int(row.argmax())
        out["greedy"] = gen
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
