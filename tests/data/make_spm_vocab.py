"""Writes tests/data/spm-vocab.json: a small sentencepiece BPE vocabulary (pieces, scores, token types) for the
conformance suite's sentencepiece-vocabulary GGUFs (Llama 2 / Mistral / Gemma / Phi-3 files carry such
vocabularies; the bundled model's is byte-level BPE). Needs the sentencepiece package, only to regenerate the
file: `pip install sentencepiece && python tests/data/make_spm_vocab.py`. Deterministic for a given version."""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

OUT = Path(__file__).with_name("spm-vocab.json")
WORDS = ("the quick brown fox jumps over the lazy dog while the model reads a long novel and writes its ending "
         "memory paging blocks cache attention token context window kernel decode prefill café naïve résumé").split()
ZH = "长上下文生成受限于键值缓存而不是权重每个上下文令牌在每一层都保留一个键和一个值分页注意力把缓存切成固定大小的块"
CODE = ["def f(x):\n    return x * 2\n", "for i in range(10):\n\tprint(i)\n", "if (a && b) { c = d; }\n",
        "x  =  1   # two  spaces\n", "SELECT * FROM t WHERE id = 42;\n"]
USER_DEFINED = ["<start_of_turn>", "<end_of_turn>", "<|endoftext|>"]
CONTROL = ["<|user|>", "<|assistant|>", "<|end|>"]


def main() -> None:
    import sentencepiece as spm

    rng = random.Random(0)
    lines = []
    for _ in range(4000):
        r = rng.random()
        if r < 0.5:
            lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))))
        elif r < 0.8:
            i = rng.randint(0, len(ZH) - 10)
            lines.append(ZH[i:i + rng.randint(3, 10)])
        else:
            lines.append(rng.choice(CODE))
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "train.txt").write_text("\n".join(lines), encoding="utf-8")
        spm.SentencePieceTrainer.train(
            input=str(Path(d) / "train.txt"), model_prefix=str(Path(d) / "v"), vocab_size=700, model_type="bpe",
            byte_fallback=True, character_coverage=1.0, split_digits=True, allow_whitespace_only_pieces=True,
            remove_extra_whitespaces=False, normalization_rule_name="identity", user_defined_symbols=USER_DEFINED,
            control_symbols=CONTROL, num_threads=1, minloglevel=2)
        sp = spm.SentencePieceProcessor(model_file=str(Path(d) / "v.model"))
    pieces, scores, types = [], [], []
    for i in range(sp.get_piece_size()):  # llama.cpp's converter's token types
        piece = sp.id_to_piece(i)
        pieces.append(piece)
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
                     else 4 if piece in USER_DEFINED else 5 if sp.is_unused(i) else 1)
    OUT.write_text(json.dumps({"tokens": pieces, "scores": scores, "token_type": types, "bos": sp.bos_id(),
                               "eos": sp.eos_id(), "unk": sp.unk_id()}, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({len(pieces)} pieces)")


if __name__ == "__main__":
    main()
