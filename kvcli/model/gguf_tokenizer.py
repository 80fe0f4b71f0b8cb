"""A byte-level BPE tokenizer built straight from a GGUF's vocabulary and merges with `tokenizers`.

transformers rebuilds a GGUF's tokenizer through its slow-tokenizer converter: seconds on a first run
(17-27 s measured on an AVX2 laptop-class VM), then cached. Byte-level BPE files (`tokenizer.ggml.model`
= "gpt2": SmolLM, Llama 3, Qwen2, StarCoder, ...) describe everything `tokenizers` needs, so kvcli
builds those itself in ~0.2 s, the same way transformers does (tests/test_gguf_tokenizer.py checks it
token for token against transformers' conversion). Other tokenizer models (sentencepiece "llama",
"t5", ...) and unknown pre-tokenizers return None and go through transformers.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

# Pre-tokenizer split patterns by `tokenizer.ggml.pre`, as the models' own tokenizer.json files and
# llama.cpp (llama_vocab's regex_exprs) define them: each pattern splits the pieces the one before left, its
# matches kept as pieces of their own. Names not listed here fall back to transformers.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"  # ByteLevel's own
# Every number character alone first, then GPT-2's pattern: SmolLM's tokenizer.json (Digits with individual_digits,
# then ByteLevel) and llama.cpp's STARCODER / REFACT / SMOLLM group. So "  4" is "  " + "4", where GPT-2's pattern
# alone gives " " + " 4" (the bundled model's samples: 0.2-0.4 % more tokens).
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2_SPLIT)
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "gpt-2": (_GPT2_SPLIT,), "gpt2": (_GPT2_SPLIT,),
    **dict.fromkeys(("smollm", "starcoder", "refact"), _DIGITS_THEN_GPT2),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), (_QWEN2_SPLIT,)),
}
# Pre-tokenizers for which llama.cpp emits a word that is a vocabulary token whole, without its merges
# (llama_vocab's ignore_merges: the Llama 3 family), as their tokenizer.json files ask of `tokenizers`.
IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3"})
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types


def absent_chars(missing: set[int]) -> str | None:
    """A regex class of the characters whose UTF-8 holds a byte the vocabulary has no token for (SmolLM's lacks
    0x04, 0x06, 0x13, 0x14, 0x16, 0x1D and the lead bytes 0xF1-0xF4: U+40000 and up), or None: none, or a missing
    continuation byte (0x80-0xBF), whose characters this does not list. llama.cpp drops such a character and merges
    nothing across it ('.' U+0004 '.' is two '.' tokens); `tokenizers` drops it before merging ('..'), so each one
    is cut out as a piece of its own first."""
    ranges: list[tuple[int, int]] = []
    for b in sorted(missing):
        if 0x80 <= b <= 0xBF:
            return None
        if b < 0x80:
            ranges.append((b, b))
        elif 0xC2 <= b <= 0xDF:
            ranges.append(((b & 0x1F) << 6, ((b & 0x1F) << 6) | 0x3F))
        elif 0xE0 <= b <= 0xEF:
            lo, hi = max((b & 0x0F) << 12, 0x800), ((b & 0x0F) << 12) | 0xFFF
            ranges.append((lo, 0xD7FF if b == 0xED else hi))  # (0xED's upper half: the surrogates)
        elif 0xF0 <= b <= 0xF4:
            ranges.append((max((b & 0x07) << 18, 0x10000), min(((b & 0x07) << 18) | 0x3FFFF, 0x10FFFF)))
        # 0xC0, 0xC1, 0xF5-0xFF: in no UTF-8 text
    if not ranges:
        return None
    return "[" + "".join(f"\\x{{{lo:X}}}" if lo == hi else f"\\x{{{lo:X}}}-\\x{{{hi:X}}}" for lo, hi in ranges) + "]"


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the alphabet byte-level vocabularies use)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


def supported(meta: dict[str, Any]) -> bool:
    return (meta.get("tokenizer.ggml.model") == "gpt2" and "tokenizer.ggml.merges" in meta
            and meta.get("tokenizer.ggml.pre", "gpt-2") in PRE_TOKENIZER_SPLITS)


def build_bpe_tokenizer(meta: dict[str, Any]):
    """A `tokenizers.Tokenizer` for a byte-level BPE GGUF, or None when this file needs transformers."""
    if not supported(meta):
        return None
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    # A token written outside the byte alphabet (a raw special like "<|x|>" is inside it) is respelled
    # byte by byte, as transformers' converter does; a later duplicate wins, as in a dict literal.
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    tk = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre in IGNORE_MERGES))
    patterns = list(PRE_TOKENIZER_SPLITS[pre])
    gap = absent_chars({b for b, c in spelling.items() if c not in vocab})
    if gap is not None:  # after the family's patterns, which see the text as llama.cpp's regex does
        patterns.append(gap)
    # each pattern in turn, then ByteLevel maps each piece's bytes to the vocabulary's alphabet
    tk.pre_tokenizer = pre_tokenizers.Sequence([*(pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    # Control tokens match whole and are special (skipped when decoding); a "control" token spelled
    # outside the byte alphabet is a mislabel that would grow the vocabulary, so it is left out.
    types = meta.get("tokenizer.ggml.token_type") or []
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True)
                           for t, ty in zip(tokens, types) if ty == CONTROL and set(t) <= alphabet])
    tk.add_tokens([AddedToken(t, normalized=False, special=False)
                   for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab])
    return tk
