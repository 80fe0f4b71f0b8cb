"""kvcli's own GGUF header reader and byte-level BPE tokenizer against the independent references:
gguf-py's GGUFReader (every metadata value, every tensor's bytes) and transformers' GGUF tokenizer
conversion (token for token on a large mixed text, decode, chat template)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from kvcli.model.gguf_file import GGUFFormatError, read_gguf
from kvcli.model.gguf_tokenizer import build_bpe_tokenizer
from kvcli.model.tokenizer import BPETokenizer, load_gguf_tokenizer

REPO = Path(__file__).resolve().parents[1]


def _texts() -> list[str]:
    texts = [(REPO / f).read_text(encoding="utf-8") for f in
             ("samples/keepers-log.txt", "samples/heldout-gpl-3.0.txt", "kvcli/engine/scheduler.py", "README.md")]
    rng = random.Random(0)
    # Digits, contractions, CJK, emoji, control-token text, CRLF and runs of spaces: where the
    # pre-tokenizer patterns differ from each other.
    alphabet = list("ab Zé日本語\n\t  1234567890'sSre-.,") + ["<|im_start|>", "<|endoftext|>", "🙂", "\r\n", "'LL", "   "]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 120))) for _ in range(400)]
    return texts


def test_header_matches_gguf_reader(gguf_path) -> None:
    import gguf

    ours = read_gguf(gguf_path)
    ref = gguf.GGUFReader(str(gguf_path), "r")
    fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == fields
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.shape == [int(x) for x in b.shape] and a.tensor_type == b.tensor_type, a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name


def test_truncated_or_foreign_file_is_a_clear_error(tmp_path, gguf_path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all, just text" * 4)
    with pytest.raises(GGUFFormatError, match="bad magic"):
        read_gguf(bad)
    bad.write_bytes(b"")
    with pytest.raises(GGUFFormatError, match="empty"):
        read_gguf(bad)
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")  # the magic and version, nothing after
    with pytest.raises(GGUFFormatError, match="truncated header"):
        read_gguf(bad)
    head = gguf_path.read_bytes()[: 2_000_000]  # header intact, tensor data cut off
    bad.write_bytes(head)
    with pytest.raises(GGUFFormatError, match="past the end|truncated"):
        read_gguf(bad)


def test_bundled_tokenizer_matches_transformers(gguf_path) -> None:
    """transformers' conversion of the GGUF, with SmolLM2's own pre-tokenizer (its tokenizer.json: every digit
    alone, then ByteLevel; llama.cpp's `smollm` does the same): the conversion itself ignores tokenizer.ggml.pre
    and splits "  4" as " " + " 4" (tests/conformance checks kvcli against llama.cpp on such text)."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    ours = load_gguf_tokenizer(gguf_path, (2,))
    assert isinstance(ours, BPETokenizer)  # built directly, not through transformers
    ref = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    assert read_gguf(gguf_path).metadata["tokenizer.ggml.pre"] == "smollm"
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    n = 0
    for text in _texts():
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text[:80]
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text[:80]
        n += len(ids)
    assert n > 40_000  # a large text (~49k tokens), not a handful of words
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Go on"}]
    for gen in (True, False):
        expect = ref.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True)
        expect = expect["input_ids"] if hasattr(expect, "keys") else expect
        assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == list(expect)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2"])
def test_pre_tokenizer_families_match_transformers(gguf_path, pre) -> None:
    """The bundled vocabulary under Llama 3's and Qwen2's split patterns, built by both."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    arch, tdict, _ = get_gguf_tokenizer(str(gguf_path))
    ref = convert_gguf_tokenizer(arch, dict(tdict, pre_tokenizer_type=pre))[0]
    meta = dict(read_gguf(gguf_path).metadata)
    meta["tokenizer.ggml.pre"] = pre
    ours = build_bpe_tokenizer(meta)
    assert ours is not None
    for text in _texts()[4:]:
        assert ours.encode(text, add_special_tokens=False).ids == ref.encode(text, add_special_tokens=False).ids, text


def test_numbers_are_split_off_first_under_smollms_rules(gguf_path) -> None:
    """llama.cpp's ids for the bundled file (llama_tokenize, parse_special false; 2026-12-07, llama.cpp 0.3.36):
    every number character is a piece of its own before GPT-2's pattern runs, so the spaces before it stay one
    piece; under `gpt-2` rules the same file's vocabulary splits them as GPT-2 does."""
    tok = load_gguf_tokenizer(gguf_path, (2,))
    assert tok.encode("  4") == [256, 36] and tok.encode("\n\n2") == [1116, 34] and tok.encode(" ²") == [216, 19133]
    gpt2 = build_bpe_tokenizer(dict(read_gguf(gguf_path).metadata, **{"tokenizer.ggml.pre": "gpt-2"}))
    assert gpt2.encode("  4", add_special_tokens=False).ids == [216, 216, 36]


def test_characters_the_vocabulary_lacks_are_dropped_without_joining_their_neighbours(gguf_path) -> None:
    """llama.cpp's ids (as above): U+0004 and U+001D have no byte token in the bundled vocabulary; llama.cpp drops
    them and merges nothing across them, where `tokenizers` alone merged '.' + '.' into '..' ([950])."""
    from kvcli.model.gguf_tokenizer import absent_chars

    tok = load_gguf_tokenizer(gguf_path, (2,))
    assert tok.encode(".\x04.") == [30, 30] and tok.encode(" \x1d\u200d") == [216, 321, 231]
    assert absent_chars(set()) is None and absent_chars({0x85}) is None  # (continuation bytes: not listed)
    assert absent_chars({0x04, 0xC3, 0xF4}) == "[\\x{4}\\x{C0}-\\x{FF}\\x{100000}-\\x{10FFFF}]"


def test_phi3_specials_strip_ascii_whitespace_only(tmp_path) -> None:
    """A Phi-3 file's special tokens take the whitespace beside them as C's isspace() sees it (llama.cpp): a
    no-break or ideographic space stays text (llama.cpp's ids for the conformance suite's spm-phi3 file)."""
    import sys

    sys.path.insert(0, str(Path(__file__).with_name("conformance")))
    from tiny_gguf import BY_NAME, write

    from kvcli.model.loader import load_tokenizer

    tok = load_tokenizer(str(write(BY_NAME["spm-phi3"], tmp_path / "phi3.gguf")))
    assert tok.encode("<|end|>\xa0") == [5, 603, 203, 169]
    assert tok.encode("<|end|> \t\n") == [5]
    no_prefix = load_tokenizer(str(write(BY_NAME["spm-no-prefix"], tmp_path / "np.gguf")))
    for text in (" x", "  hi", " ", "x y"):  # no space prefix: a first space is the text's own, kept in decoding
        assert no_prefix.decode(no_prefix.encode(text)) == text


def test_other_tokenizer_models_fall_back(gguf_path) -> None:
    meta = dict(read_gguf(gguf_path).metadata)
    assert build_bpe_tokenizer(dict(meta, **{"tokenizer.ggml.model": "llama"})) is None
    assert build_bpe_tokenizer(dict(meta, **{"tokenizer.ggml.pre": "some-future-pre"})) is None


def test_bos_prefix_follows_the_file_as_llama_cpp_adds_it():
    """llama.cpp puts BOS before a text (tokenize with add_special) by the vocabulary's default, on for
    sentencepiece and the Llama 3 family, and the file's add_bos_token when set; document_ids (continue,
    perplexity, completion prompts) prepends it once."""
    from kvcli.model.tokenizer import document_ids, gguf_bos_prefix

    spm = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.bos_token_id": 1}
    assert gguf_bos_prefix(spm) == (1,)
    assert gguf_bos_prefix({**spm, "tokenizer.ggml.add_bos_token": False}) == ()
    bpe = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.bos_token_id": 7}
    assert gguf_bos_prefix({**bpe, "tokenizer.ggml.pre": "smollm"}) == ()
    assert gguf_bos_prefix({**bpe, "tokenizer.ggml.pre": "llama-bpe"}) == (7,)
    assert gguf_bos_prefix({**bpe, "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.add_bos_token": True}) == (7,)
    assert gguf_bos_prefix({"tokenizer.ggml.model": "llama"}) == ()  # no BOS id: nothing to add

    class Tok:
        bos_prefix = (1,)

        def encode(self, text):
            return [1, 5] if text.startswith("<s>") else [5]

    assert document_ids(Tok(), "x") == [1, 5] and document_ids(Tok(), "<s>x") == [1, 5]


def test_a_sentencepiece_gguf_reads_a_text_after_its_bos(tmp_path):
    """A sentencepiece-vocabulary file (tests/data/spm-vocab.json) through the engine: a text prompt starts with
    the BOS; the bundled model's (add_bos_token false) does not."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).with_name("conformance")))
    from tiny_gguf import BY_NAME, write

    from kvcli.config import SamplingParams
    from kvcli.llm import LLM

    path = write(BY_NAME["spm"], tmp_path / "spm.gguf")
    llm = LLM(str(path), kv_budget="4MiB")
    req = llm.engine.add_request("the quick brown fox", SamplingParams(max_tokens=1))
    assert req.prompt_token_ids[0] == 1 and req.prompt_token_ids[1:] == llm.tokenizer.encode("the quick brown fox")
    bundled = LLM(kv_budget="4MiB")
    assert bundled.engine.add_request("the quick brown fox", SamplingParams(max_tokens=1)).prompt_token_ids == \
        bundled.tokenizer.encode("the quick brown fox")
