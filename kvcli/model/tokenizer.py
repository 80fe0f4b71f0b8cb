"""Tokenizers, always offline: byte-level BPE GGUFs built directly with `tokenizers` (fast, also on a
first run), other GGUFs and checkpoint folders through transformers, and a byte-level tokenizer for
dummy models (random weights have no vocabulary to speak of)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, Protocol

from kvcli.paths import cache_dir

# Never contact a model hub: kvcli only reads local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    # What the model expects before a text it reads from its start (the BOS its file asks for: GGUF
    # tokenizer.ggml.add_bos_token, by default on for sentencepiece and Llama 3 vocabularies as in llama.cpp;
    # a folder's tokenizer: what encode(add_special_tokens=True) puts first). Chat templates write their own.
    bos_prefix: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]: ...

    def core(self):
        """The `tokenizers.Tokenizer` underneath (for batch calls that release the GIL), or None."""
        ...

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str | None:
        """The chat template rendered as text (None: the tokenizer has no template)."""
        ...


def fold_system_prompt(messages: list[dict]) -> list[dict]:
    """For a chat template without a system role (Gemma 2's raises on one): the leading system message put at
    the head of the first user message, as llama.cpp merges it for such templates and Gemma 3's template does."""
    if not messages or messages[0].get("role") != "system":
        return messages
    system, rest = messages[0], [dict(m) for m in messages[1:]]
    if rest and rest[0].get("role") == "user" and isinstance(rest[0].get("content"), str):
        rest[0]["content"] = f"{system['content']}\n\n{rest[0]['content']}"
        return rest
    return [{"role": "user", "content": system["content"]}, *rest]


def with_bos(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """A text's ids as the model reads them from its start: the file's BOS (bos_prefix) first, not doubled
    when the text already begins with it."""
    ids = list(ids)
    prefix = list(getattr(tokenizer, "bos_prefix", ()))
    return ids if not prefix or ids[:len(prefix)] == prefix else prefix + ids


def document_ids(tokenizer: Tokenizer, text: str, literal: bool = False) -> list[int]:
    """A text the model reads from its start (continue, perplexity, an engine text prompt). literal: special-token
    spellings in it (<|endoftext|>, <|im_start|>) are text, as llama.cpp's perplexity tokenizes a document
    (parse_special false); else they are the tokens they name, as a hand-written prompt means them."""
    return with_bos(tokenizer, encode_literal(tokenizer, text) if literal else tokenizer.encode(text))


def encode_literal(tokenizer: Tokenizer, text: str) -> list[int]:
    """The text's ids with special-token spellings read as plain text (llama_tokenize, parse_special false)."""
    if isinstance(tokenizer, SPMTokenizer):  # llama.cpp's encoder takes the choice itself
        return tokenizer.encode(text, parse_special=False)
    core = tokenizer.core() if hasattr(tokenizer, "core") else None
    if core is None:
        return tokenizer.encode(text)
    literal = getattr(tokenizer, "_literal_core", None)
    if literal is None:  # a private copy: the setting is per object, and the shared one keeps parsing
        from tokenizers import Tokenizer as CoreTokenizer

        literal = CoreTokenizer.from_str(core.to_str())
        literal.encode_special_tokens = True
        tokenizer._literal_core = literal
    return list(literal.encode(text, add_special_tokens=False).ids)


NO_CHAT_TEMPLATE = ("this model has no chat template: {what} go to it as plain 'user: ...' / 'assistant: ...' lines, "
                    "which a base model may not follow")


def has_chat_template(tokenizer: Tokenizer) -> bool:
    """Whether chat turns go through the model's own template (else plain_chat_text's lines). A template that
    fails to render counts: each use reports its error (chat_template_error)."""
    try:
        return tokenizer.render_chat([{"role": "user", "content": "x"}]) is not None
    except Exception:
        return True


def chat_template_error(tokenizer: Tokenizer) -> Exception | None:
    """Why the model's chat template cannot render one plain user message (a Jinja syntax error, a template that
    raises); None when it renders or there is none."""
    try:
        tokenizer.render_chat([{"role": "user", "content": "x"}])
    except Exception as e:
        return e
    return None


def plain_chat_text(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The conversation as plain "role: content" lines, for a tokenizer without a chat template."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if add_generation_prompt else "")


class HFTokenizer:
    def __init__(self, tok, eos_token_ids: tuple[int, ...]) -> None:
        self.tok = tok
        ids = set(eos_token_ids)
        if tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
        self.eos_token_ids = tuple(sorted(ids))
        try:  # what transformers puts before a text when asked for its special tokens
            plain = list(tok.encode("x", add_special_tokens=False))
            full = list(tok.encode("x", add_special_tokens=True))
            k = len(full) - len(plain)
            self.bos_prefix = tuple(full[:k]) if k > 0 and full[k:k + len(plain)] == plain else ()
        except Exception:
            self.bos_prefix = ()

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not getattr(self.tok, "chat_template", None):
            return self.encode(plain_chat_text(messages, add_generation_prompt))
        out = self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def core(self):
        tk = getattr(self.tok, "backend_tokenizer", None)
        return tk if tk is not None and hasattr(tk, "encode_batch") else None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str | None:
        if not getattr(self.tok, "chat_template", None):
            return None
        return self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)


class BPETokenizer:
    """A `tokenizers.Tokenizer` built from GGUF metadata (kvcli.model.gguf_tokenizer). transformers is
    imported only for the chat template, so `continue` and `profile` never pay for it."""

    def __init__(self, tk, eos_token_ids: tuple[int, ...], meta: dict[str, Any]) -> None:
        self.tk = tk
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        tokens = meta.get("tokenizer.ggml.tokens") or []

        def token(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        self.bos_prefix = gguf_bos_prefix(meta)
        self._specials = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                          "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}
        self._chat_template = meta.get("tokenizer.chat_template")
        self._hf: HFTokenizer | None = None

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tk.decode(ids, skip_special_tokens=True)

    def _transformers(self) -> HFTokenizer:
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast(tokenizer_object=self.tk, chat_template=self._chat_template,
                                          **{k: v for k, v in self._specials.items() if v is not None})
            self._hf = HFTokenizer(tok, self.eos_token_ids)
        return self._hf

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self._transformers().apply_chat_template(messages, add_generation_prompt)

    def core(self):
        return self.tk

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str | None:
        return self._transformers().render_chat(messages, add_generation_prompt) if self._chat_template else None


class SPMTokenizer:
    """A sentencepiece-vocabulary GGUF: encoded as llama.cpp encodes it (kvcli.model.spm_tokenizer), rendered
    chat templates encoded the same way; decoding through transformers' tokenizer for the file."""

    def __init__(self, hf: HFTokenizer, meta: dict[str, Any]) -> None:
        from kvcli.model.spm_tokenizer import SPMEncoder

        self.hf = hf
        self.spm = SPMEncoder(meta)
        self.eos_token_ids = hf.eos_token_ids
        self.bos_prefix = gguf_bos_prefix(meta)
        self._strips: bool | None = None

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        return self.spm.encode(text, parse_special)

    def decode(self, ids: list[int]) -> str:
        """llama_detokenize's text: the leading space the encoder adds (add_space_prefix) is taken off, and
        only then; transformers' decoder for such a file takes a first space off either way."""
        text = self.hf.decode(ids)
        if not self.spm.add_space_prefix and self._decoder_strips_space() and self.spm.opens_with_space(ids):
            text = " " + text
        return text

    def _decoder_strips_space(self) -> bool:
        """Whether transformers' decoder drops the first space of a text (asked once, of a token that opens with
        one: U+2581 alone or the first such token)."""
        if self._strips is None:
            probe = next((i for i in range(len(self.spm.tokens)) if self.spm.opens_with_space([i])), None)
            self._strips = probe is not None and not self.hf.decode([probe]).startswith(" ")
        return self._strips

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = self.hf.render_chat(messages, add_generation_prompt)
        return self.encode(plain_chat_text(messages, add_generation_prompt) if text is None else text)

    def core(self):
        return None  # no `tokenizers` object encodes as this does

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str | None:
        return self.hf.render_chat(messages, add_generation_prompt)


class ByteTokenizer:
    """UTF-8 bytes shifted by 3 (0 pad, 1 bos, 2 eos); fits any vocabulary of >= 259 ids."""

    eos_token_ids = (2,)
    bos_prefix = ()

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))

    def core(self):
        return None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str | None:
        return None


# llama.cpp's add_bos default by vocabulary: on for sentencepiece ("llama") files and the Llama 3 family of
# byte-level pre-tokenizers (llama_vocab::impl::load), else off; the file's add_bos_token key decides when set.
_BOS_BY_DEFAULT_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "tekken", "chameleon"})


def gguf_bos_prefix(meta: dict[str, Any]) -> tuple[int, ...]:
    """The BOS llama.cpp puts before a text of this GGUF (tokenize with add_special), as a prefix."""
    model = meta.get("tokenizer.ggml.model")
    default = model == "llama" or (model == "gpt2" and meta.get("tokenizer.ggml.pre") in _BOS_BY_DEFAULT_PRE)
    add = meta.get("tokenizer.ggml.add_bos_token")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return (int(bos),) if (default if add is None else bool(add)) and bos is not None else ()


def load_gguf_tokenizer(path: Path, eos_token_ids: tuple[int, ...],
                        metadata: dict[str, Any] | None = None) -> BPETokenizer | HFTokenizer | SPMTokenizer:
    """Byte-level BPE files are built directly (kvcli.model.gguf_tokenizer); sentencepiece vocabularies
    are encoded by llama.cpp's algorithm (SPMTokenizer). For the rest, and for those files' decoding and
    chat templates, transformers rebuilds the tokenizer from the metadata (seconds); the result is kept as
    tokenizer files in the cache, keyed by the file's identity, and loaded from there next time."""
    if metadata is None:
        from kvcli.model.gguf_file import read_gguf

        metadata = read_gguf(path).metadata
    hf = _load_gguf_hf_tokenizer(path, eos_token_ids, metadata)
    if isinstance(hf, HFTokenizer) and metadata.get("tokenizer.ggml.model") == "llama":
        return SPMTokenizer(hf, metadata)
    return hf


def _load_gguf_hf_tokenizer(path: Path, eos_token_ids: tuple[int, ...],
                            metadata: dict[str, Any]) -> BPETokenizer | HFTokenizer:
    from kvcli.model.gguf_tokenizer import build_bpe_tokenizer

    tk = build_bpe_tokenizer(metadata)
    if tk is not None:
        return BPETokenizer(tk, eos_token_ids, metadata)
    from transformers import AutoTokenizer

    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir() / "tokenizers" / key
    if (cached / "tokenizer_config.json").is_file():
        try:
            return HFTokenizer(AutoTokenizer.from_pretrained(str(cached), local_files_only=True), eos_token_ids)
        except Exception:
            pass  # a damaged cache entry: rebuild it below
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    try:
        tmp = cached.with_name(key + f".tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        os.replace(tmp, cached) if not cached.exists() else shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # a read-only cache only costs speed
    return HFTokenizer(tok, eos_token_ids)


def load_dir_tokenizer(path: Path, eos_token_ids: tuple[int, ...]) -> HFTokenizer:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return HFTokenizer(tok, eos_token_ids)
