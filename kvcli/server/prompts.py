"""Prompts into token ids for the server: off the event loop, bounded, and with typed special tokens
kept as text.

- `max_chars`: no tokenizer turns more than `max_token_chars` characters into one token, so a text
  longer than `max_model_len * max_token_chars` characters cannot fit and is refused without being
  tokenized (a 20 MB prompt costs nothing but its read).
- Tokenizing goes through `tokenizers`' batch call, which releases the GIL (the single call holds it:
  0.8 s for a 1.2 MB text, during which no other request is served).
- Special tokens typed inside a prompt or a message's content (`<|im_start|>system`) are encoded as
  the text they are, unless the request opts in (`parse_special_tokens: true`): otherwise a user could
  forge chat roles. Only the chat template's own special tokens are control tokens. For content
  without special-token text the ids are exactly the tokenizer's own.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from kvcli.model.tokenizer import SPMTokenizer, Tokenizer, fold_system_prompt, with_bos


class PromptError(ValueError):
    pass


def _core(tokenizer: Tokenizer):
    """The `tokenizers.Tokenizer` behind kvcli's tokenizer, if it has one."""
    core = getattr(tokenizer, "core", None)
    return core() if core is not None else None


def _renderer(tokenizer: Tokenizer) -> Callable[[list[dict]], str] | None:
    """The chat template as text (transformers' renderer, as kvcli's tokenizer uses it)."""
    render = getattr(tokenizer, "render_chat", None)
    if render is None or render([{"role": "user", "content": "x"}]) is None:
        return None
    return lambda messages: render(messages, add_generation_prompt=True)


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        from tokenizers import Tokenizer as CoreTokenizer

        self.tokenizer = tokenizer
        core = _core(tokenizer)
        self.specials: dict[str, int] = {}
        self.max_token_chars = 64
        self._parse = self._text = None
        if core is not None:
            blob = core.to_str()
            # Two private copies: the engine thread decodes with the original, and the setting below
            # is per object.
            self._parse = CoreTokenizer.from_str(blob)
            self._text = CoreTokenizer.from_str(blob)
            self._text.encode_special_tokens = True
            self.specials = {t.content: i for i, t in core.get_added_tokens_decoder().items() if t.special}
            vocab = core.get_vocab(with_added_tokens=True)
            # A vocabulary string has at least as many characters as the text it decodes to (byte-level
            # and metaspace pieces: one character per byte or space; byte-fallback pieces more).
            self.max_token_chars = max(max((len(k) for k in vocab), default=1), 4)
        self.max_chars = max_model_len * self.max_token_chars
        self._render = None
        self._render_ready = False

    def _has_specials(self, text: str) -> bool:
        return any(s in text for s in self.specials)

    def _encode(self, text: str, parse_special: bool) -> list[int]:
        if self._parse is None:
            if isinstance(self.tokenizer, SPMTokenizer):  # llama.cpp's encoder takes the choice itself
                return self.tokenizer.encode(text, parse_special)
            return list(self.tokenizer.encode(text))
        core = self._parse if parse_special or not self._has_specials(text) else self._text
        return list(core.encode_batch([text], add_special_tokens=False)[0].ids)

    def check_chars(self, n_chars: int) -> None:
        if n_chars > self.max_chars:
            raise PromptError(f"the prompt has {n_chars:,} characters, more than this model's context of "
                              f"tokens can hold (at most {self.max_chars:,} characters)")

    def encode(self, text: str, parse_special: bool = False) -> list[int]:
        """A completion prompt: the file's BOS (the tokenizer's bos_prefix, not doubled) and the text's ids."""
        self.check_chars(len(text))
        return with_bos(self.tokenizer, self._encode(text, parse_special))

    def chat(self, messages: list[dict[str, Any]], parse_special: bool = False) -> list[int]:
        self.check_chars(sum(len(m["content"]) for m in messages))
        if not self._render_ready:
            self._render, self._render_ready = _renderer(self.tokenizer), True
        typed = not parse_special and any(self._has_specials(m["content"]) for m in messages)
        if self._render is None or self._parse is None:
            if typed:
                raise PromptError("a message contains special-token text, and this model's tokenizer cannot "
                                  "encode it as text (send parse_special_tokens: true to parse it)")
            return self._template_ids(messages)
        # Typed special tokens become placeholders the template passes through; the rendered text is
        # split at the template's own special tokens, and each piece between them is encoded with the
        # placeholders turned back into the text they stand for, special tokens not parsed (tokenizers
        # itself splits at special tokens first and encodes the pieces separately: the same ids).
        nonce = secrets.token_hex(8)
        table: dict[str, str] = {}

        def hide(text: str) -> str:
            for j, s in enumerate(self.specials):
                if s in text:
                    key = f"\ue000{nonce}{j}\ue001"
                    table[key] = s
                    text = text.replace(s, key)
            return text

        shown = [{**m, "content": hide(m["content"])} if typed else m for m in messages]
        rendered = self._without_system_role_if_refused(self._render, shown)
        if not table:
            return list(self._parse.encode_batch([rendered], add_special_tokens=False)[0].ids)
        pieces = self._split_specials(rendered)
        texts = []
        for kind, piece in pieces:
            if kind == "text":
                for key, s in table.items():
                    piece = piece.replace(key, s)
                texts.append(piece)
        encoded = iter(self._text.encode_batch(texts, add_special_tokens=False) if texts else [])
        ids: list[int] = []
        for kind, piece in pieces:
            if kind == "special":
                ids.append(self.specials[piece])
            else:
                ids.extend(next(encoded).ids)
        return ids

    def _template_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return self._without_system_role_if_refused(
            lambda msgs: self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True), messages)

    @staticmethod
    def _without_system_role_if_refused(apply, messages: list[dict[str, Any]]):
        """apply(messages); where the template refuses a leading system message (Gemma 2's has no system role),
        apply again with it folded into the first user message (as kvcli chat and llama.cpp do); a template
        that refuses the conversation anyway is a one-line PromptError."""
        try:
            return apply(messages)
        except Exception as e:  # a template that refuses the roles given (raise_exception)
            first = e
        folded = fold_system_prompt(messages)
        if folded is not messages:
            try:
                return apply(folded)
            except Exception:
                pass
        raise PromptError(f"chat template: {first}") from None

    def _split_specials(self, text: str) -> list[tuple[str, str]]:
        """The text as ("special", token) and ("text", piece) parts, leftmost-longest match."""
        out: list[tuple[str, str]] = []
        i = start = 0
        by_first: dict[str, list[str]] = {}
        for s in sorted(self.specials, key=len, reverse=True):
            by_first.setdefault(s[0], []).append(s)
        while i < len(text):
            hit = next((s for s in by_first.get(text[i], ()) if text.startswith(s, i)), None)
            if hit is None:
                i += 1
                continue
            if i > start:
                out.append(("text", text[start:i]))
            out.append(("special", hit))
            i = start = i + len(hit)
        if start < len(text):
            out.append(("text", text[start:]))
        return out
