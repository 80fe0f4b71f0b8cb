"""GGUF conformance against llama.cpp (issue #29, item 1): each tiny variant of tiny_gguf.py through both engines,
on the same token ids. F32 files: logits of every teacher-forced position within 1e-3 relative (llama.cpp
with an F32 KV cache and no flash attention, kvcli with fp32 KV) and the same greedy tokens. F16 and quantized
files: llama.cpp's CPU kernels round the activations (to fp16, or to 8 bits per block: Q8_0 / Q8_K) before
each dot product, kvcli's do not lose that much, so the two differ by llama.cpp's rounding: kvcli's logits must be
no farther from llama.cpp's than the exactly dequantized model's are (+1e-3), and that distance under
QUANT_TOLERANCE (a misread scale, minimum or nibble order moves them by far more). A variant kvcli cannot compute
exactly may instead be refused in one line: never a silently different model."""

from __future__ import annotations

import json
import os

import pytest

from engines import LlamaCppError, kvcli_logits, relative_error, run_llama_cpp
from tiny_gguf import VARIANTS, Variant, write

pytestmark = pytest.mark.slow

F32_TOLERANCE = 1e-3
QUANT_TOLERANCE = 6e-2
GREEDY = 12
# Text of every script the tokenizer has to get right, tokenized by both engines; its ids also feed the models.
TEXT = ("The keeper climbed the stairs at dusk, counting 1,024 steps; the lamp hissed. "
        "灯塔守护者每晚爬上楼梯，点亮灯火。海风很冷。"
        "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 🌊🔥\n"
        "Ça va? Ünïcödé — naïve café, Ελληνικά, русский текст, 日本語のテキスト。\t\ttabs  and   spaces\n")


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    """~250 token ids: the text tokenized by kvcli, twice over (positions past 128, where yarn and linear
    scalings bend)."""
    from kvcli.model.loader import load_tokenizer

    ids = load_tokenizer(None).encode(TEXT)
    return (ids + ids)[:256]


def file_tokens(path) -> list[int]:
    """TEXT twice over as kvcli tokenizes it with the file's own vocabulary, cut to 256 ids."""
    from kvcli.model.loader import load_tokenizer

    ids = load_tokenizer(str(path)).encode(TEXT)
    return (ids + ids)[:256]


def _ids(v: Variant) -> str:
    return v.name


def record(variant: Variant, **fields) -> None:
    """Where KVCLI_CONFORMANCE_MARGINS names a file (the conformance-margins figure, kvcli/bench/conformance.py),
    one JSON line per variant with what the test measured: the suite itself asserts and prints nothing."""
    path = os.environ.get("KVCLI_CONFORMANCE_MARGINS")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"variant": variant.name, "weights": variant.weights, **fields}) + "\n")


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_variant_matches_llama_cpp(variant: Variant, llama_cpp, tokens, tmp_path):
    from kvcli.model.gguf_loader import GGUFError
    from kvcli.model.loader import ModelLoadError

    path = write(variant, tmp_path / f"{variant.name}.gguf")
    if variant.vocab != "bundled" or variant.drop_merges:  # the ids of this file's own vocabulary
        tokens = file_tokens(path)
    try:
        want, ref = run_llama_cpp(llama_cpp, path, tokens, greedy=GREEDY, tmp=tmp_path)
    except LlamaCppError as e:
        if not variant.refused:
            pytest.fail(f"llama.cpp refused the {variant.name} file (the variant is malformed): {e}")
        with pytest.raises((GGUFError, ModelLoadError)) as info:  # kvcli must not load what llama.cpp refuses
            kvcli_logits(path, tokens)
        assert "\n" not in str(info.value) and str(info.value)
        record(variant, outcome="refused by both")
        return
    assert not variant.refused, f"llama.cpp loads {variant.name}, which the suite expects it to refuse"
    try:
        got, gen = kvcli_logits(path, tokens, greedy=GREEDY)
    except (GGUFError, ModelLoadError) as e:  # refused in one line: allowed, never a different model
        assert "\n" not in str(e) and str(e), e
        record(variant, outcome="refused by kvcli", why=str(e))
        pytest.skip(f"kvcli refuses {variant.name} in one line: {e}")
    err = relative_error(got, want)
    same = gen == ref["greedy"]
    if variant.weights == "F32":
        record(variant, outcome="compared", error=err, bound=F32_TOLERANCE, greedy_same=same)
        assert err < F32_TOLERANCE, f"{variant.name} ({variant.note}): logits {err:.2e} relative from llama.cpp's"
        assert same, f"{variant.name}: greedy tokens differ: kvcli {gen} llama.cpp {ref['greedy']}"
        return
    exact, _ = kvcli_logits(path, tokens, dequantize=True)
    floor = relative_error(exact, want)  # llama.cpp's activation rounding, as far as the exact model sees it
    if os.environ.get("KVCLI_CONFORMANCE_MARGINS"):  # the figure also shows the one-kernel-at-every-row-count route
        invariant, _ = kvcli_logits(path, tokens, attention_backend="invariant")
        record(variant, outcome="compared", error=err, bound=floor + 1e-3, exact=floor,
               invariant=relative_error(invariant, want), greedy_same=same)
    assert floor < QUANT_TOLERANCE, f"{variant.name}: the dequantized model is {floor:.2e} from llama.cpp"
    assert err <= floor + 1e-3, (f"{variant.name} ({variant.note}): kvcli's integer path is {err:.2e} from "
                                 f"llama.cpp, the exactly dequantized model {floor:.2e}")


def test_tokenizers_agree_on_multilingual_text(llama_cpp, tmp_path):
    """The bundled tokenizer read by kvcli and by llama.cpp from the same GGUF: the same ids for English,
    Chinese, code, emoji, accents, Greek and Cyrillic, runs of spaces and tabs, each line alone, and numbers after
    spaces and in other scripts (DIGIT_TEXTS)."""
    from kvcli.model.loader import load_tokenizer

    path = write(VARIANTS[0], tmp_path / "tok.gguf")
    texts = [TEXT, *TEXT.splitlines(keepends=True), " leading space", "trailing space ", "a\n\n\nb", "   ",
             "<|im_start|>user\nhi<|im_end|>", *DIGIT_TEXTS]
    _, ref = run_llama_cpp(llama_cpp, path, [], texts=texts, tmp=tmp_path)
    tok = load_tokenizer(None)
    for text, want in zip(texts, ref["tokenized"]):
        assert tok.encode(text) == want, f"{text!r}: kvcli {tok.encode(text)} llama.cpp {want}"


# Numbers after spaces and newlines, in other scripts and forms: SmolLM's pre-tokenizer splits every number
# character off first (llama.cpp's SMOLLM group), so "  4" is "  " + "4", not " " + " 4".
DIGIT_TEXTS = ["  4", "\n\n2", " ²", "x 12345 y", "pi is 3.14159, e is 2.718", "Ⅻ ① ٣٤ ५ ½", "v1.2.3-rc4\n  10\t20",
               # characters whose bytes the bundled vocabulary lacks (U+0004, U+001D, U+40000 up): dropped, and
               # nothing merges across them
               ".\x04.", " \x1d\u200d", "a\U00050000a bb\x06bb", "\x13\x14 \x16x"]
SPM_TEXTS = [TEXT, *TEXT.splitlines(keepends=True), " leading space", "  two leading", "trailing space ", "a\n\n\nb",
             "   ", "", "x", "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<s>bos inside</s> text",
             "<|user|>\n  hi <|end|>\n<|assistant|>", "unknown <unk> token", "tab\tand\r\nCRLF 123 3.14 1e-9",
             "Ελληνικά και русский", "🌊🔥 emoji ✓ and ☃", "mixed中文English混合", "<|end|>\xa0x", "<|end|>\u3000 y",
             "<start_of_turn>\u3000x", " x", "  hi", " "]


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.vocab == "spm" or v.name == "bpe-llama3"], ids=_ids)
def test_file_tokenizers_agree_on_multilingual_text(variant: Variant, llama_cpp, tmp_path):
    """A sentencepiece vocabulary read by kvcli and by llama.cpp from the same GGUF (with the space prefix, without
    it, and a Phi-3 file's whitespace-stripping special tokens), and a byte-level one under Llama 3's rules: the
    same ids for every script, byte fallback (emoji, Greek, Cyrillic are outside the sentencepiece vocabulary),
    runs of spaces, text between special tokens (Phi-3's take ASCII whitespace only beside them, as C's isspace);
    and a sentencepiece file's ids decode to llama.cpp's text (a file without the space prefix keeps a first space)."""
    from kvcli.model.loader import load_tokenizer

    path = write(variant, tmp_path / f"{variant.name}.gguf")
    _, ref = run_llama_cpp(llama_cpp, path, [], texts=SPM_TEXTS, tmp=tmp_path)
    tok = load_tokenizer(str(path))
    for text, want, text_back in zip(SPM_TEXTS, ref["tokenized"], ref["detokenized"]):
        assert tok.encode(text) == want, f"{text!r}: kvcli {tok.encode(text)} llama.cpp {want}"
        if variant.vocab == "spm" and "<" not in text:  # (special tokens: kvcli's decode skips control tokens)
            assert tok.decode(want) == text_back, f"{want}: kvcli {tok.decode(want)!r} llama.cpp {text_back!r}"


def test_a_wrongly_computed_variant_is_caught(llama_cpp, tokens, tmp_path, monkeypatch):
    """The suite can fail: kvcli with rope_freqs.weight ignored (what it did before issue #29) is far from
    llama.cpp on the rope-freqs variant, beyond the tolerance the passing variants meet."""
    from kvcli.model import gguf_loader

    v = next(v for v in VARIANTS if v.name == "rope-freqs")
    path = write(v, tmp_path / "rope-freqs.gguf")
    want, _ = run_llama_cpp(llama_cpp, path, tokens, tmp=tmp_path)
    real = gguf_loader._rope_tensor
    monkeypatch.setattr(gguf_loader, "_rope_tensor",
                        lambda reader, name, *a: None if name == "rope_freqs.weight" else real(reader, name, *a))
    got, _ = kvcli_logits(path, tokens)
    assert relative_error(got, want) > 10 * F32_TOLERANCE


def test_spm_text_spelling_a_control_token_stays_text_unless_parsed(llama_cpp, tmp_path):
    """parse_special false (serve's default for prompts): a sentencepiece file's control-token text is encoded as
    text, its user-defined tokens still match, as llama.cpp's llama_tokenize(parse_special = false) does."""
    from kvcli.model.loader import load_tokenizer

    path = write(next(v for v in VARIANTS if v.name == "spm"), tmp_path / "spm.gguf")
    texts = ["<s>bos inside</s> text", "<|user|>\nhi<|end|>", "<start_of_turn>user\nhi<end_of_turn>"]
    want = run_llama_cpp(llama_cpp, path, [], texts=texts, tmp=tmp_path, parse_special=False)[1]["tokenized"]
    tok = load_tokenizer(str(path))
    for text, ids in zip(texts, want):
        assert tok.encode(text, parse_special=False) == ids, text
    assert tok.encode(texts[1], parse_special=False) != tok.encode(texts[1])  # control text differs when parsed


def test_a_document_spelling_special_tokens_reads_them_as_text(llama_cpp, tmp_path):
    """continue and perplexity read a document as llama.cpp's perplexity does (parse_special false): a novel that
    writes <|endoftext|> or <|im_start|> gets their spelling's tokens, not an end-of-text id in its middle."""
    from kvcli.model.loader import load_tokenizer
    from kvcli.model.tokenizer import document_ids

    path = write(VARIANTS[0], tmp_path / "tok.gguf")
    texts = ["x<|im_start|>user\n<|endoftext|>y", "The end.<|endoftext|>\n\nChapter 2  1984", "plain text, no specials"]
    want = run_llama_cpp(llama_cpp, path, [], texts=texts, tmp=tmp_path, parse_special=False)[1]["tokenized"]
    tok = load_tokenizer(None)
    for text, ids in zip(texts, want):
        assert document_ids(tok, text, literal=True) == ids, text
    assert 0 in document_ids(tok, texts[0])  # a prompt (not literal) still means the token it spells
