"""Sentencepiece-vocabulary GGUFs (`tokenizer.ggml.model` = "llama": Llama 2, Mistral, Gemma, Phi-3, ...)
encoded as llama.cpp encodes them, since llama.cpp defines what a GGUF's tokens are.

transformers rebuilds such a vocabulary as a BPE model with merges derived from the scores, and its pieces
differ from llama.cpp's on ordinary text (runs of spaces, text after a special token): the conformance suite
found it. This is llama.cpp's algorithm (llama-vocab.cpp, llm_tokenizer_spm_session and the SPM branch of
tokenize), for llama_tokenize(add_special = false, parse_special = true), which is what kvcli's encode means:

  1. special tokens (control, user-defined, unknown), longest text first, cut the text into fragments
     (a token marked rstrip / lstrip eats the whitespace after / before it: llama.cpp marks them so for
     files whose general.name says Phi-3);
  2. each text fragment gets a leading space when it opens the text or follows a special token and
     tokenizer.ggml.add_space_prefix holds (default true), and its spaces become U+2581;
  3. its UTF-8 characters are merged pairwise, always the adjacent pair whose merged text is the vocabulary
     token of the highest score (ties: the leftmost), until no pair is a token;
  4. a piece that is no token is split back along the merges that built it, else written as byte tokens
     <0xXX> (or the byte's own token).

Decoding and chat templates stay with transformers' tokenizer for the same file (tests/conformance compares
both encoders with llama.cpp's token for token)."""

from __future__ import annotations

import heapq
from typing import Any

from kvcli.model.gguf_loader import EOG_TEXTS

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's token types
# Token texts llama.cpp makes control tokens whatever the file's type says (llama_vocab::impl::load: the
# end-of-generation set, end of turn / message, fill-in-the-middle markers).
# What llama.cpp's lstrip / rstrip take off beside such a token: isspace() of each byte, C locale (ASCII only:
# not U+00A0, U+3000 or the other Unicode spaces str.strip() would take).
C_SPACE = " \t\n\v\f\r"
CONTROL_LOOKING = EOG_TEXTS | frozenset({
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
    "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
    "<|code_suffix|>", "<|suffix|>", "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
    "▁<MID>", "<|code_middle|>", "<|middle|>", "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>"})


def _utf8_len(lead: int) -> int:
    return 1 if lead < 0x80 else 2 if lead >> 5 == 0x6 else 3 if lead >> 4 == 0xE else 4 if lead >> 3 == 0x1E else 1


class SPMEncoder:
    """llama.cpp's SPM encoder over one GGUF's vocabulary (tokens, scores, token types, flags)."""

    def __init__(self, meta: dict[str, Any]) -> None:
        tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
        scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
        self.scores = [float(s) for s in scores]
        self.tokens, self.types = tokens, [int(t) for t in types]
        self.to_id: dict[bytes, int] = {}
        for i, t in enumerate(tokens):  # a repeated text maps to its last id, as llama.cpp's map does
            self.to_id[t.encode("utf-8")] = i
        self.unk = meta.get("tokenizer.ggml.unknown_token_id")
        self.add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        special = [i for i, t in enumerate(types) if int(t) in (CONTROL, USER_DEFINED, UNKNOWN)]
        special.sort(key=lambda i: -len(tokens[i].encode("utf-8")))
        self.special = [(tokens[i], i) for i in special if tokens[i]]
        # Parsed even when specials are not: user-defined tokens, except those llama.cpp marks control by their
        # text (end-of-turn and FIM tokens: "control-looking token ... its type will be overridden").
        self.user_defined = {i for i, t in enumerate(types) if int(t) == USER_DEFINED and tokens[i] not in
                             CONTROL_LOOKING}
        self.rstrip: set[int] = set()
        self.lstrip: set[int] = set()
        name = str(meta.get("general.name") or "").lower()
        if "phi-3" in name or "phi3" in name:  # llama.cpp's per-model attributes (llama_vocab::impl::load)
            self.rstrip = set(special)
            by_text = {t: i for i, t in enumerate(tokens)}
            if "</s>" in by_text:
                self.rstrip.add(by_text["</s>"])
            for t in ("<unk>", "<s>", "<|endoftext|>"):
                self.rstrip.discard(by_text.get(t, -1))

    def opens_with_space(self, ids: list[int]) -> bool:
        """Whether the text of `ids` starts with a space: the first token that decodes to text (control and
        unknown tokens are skipped) starts with U+2581 or is the byte 0x20."""
        for i in ids:
            if 0 <= i < len(self.tokens) and self.types[i] not in (CONTROL, UNKNOWN):
                return self.tokens[i].startswith("\u2581") or self.tokens[i] in ("<0x20>", " ")
        return False

    # -- 1. special tokens ---------------------------------------------------------------------------
    def _fragments(self, text: str, parse_special: bool) -> list[str | int]:
        parts: list[str | int] = [text] if text else []
        for tok_text, tid in self.special:
            if not parse_special and tid not in self.user_defined:  # control / unknown text stays text
                continue
            out: list[str | int] = []
            for part in parts:
                if not isinstance(part, str) or tok_text not in part:
                    out.append(part)
                    continue
                rest = part
                while True:
                    at = rest.find(tok_text)
                    if at < 0:
                        if rest:
                            out.append(rest)
                        break
                    left = rest[:at]
                    if tid in self.lstrip:
                        left = left.rstrip(C_SPACE)
                    if left:
                        out.append(left)
                    out.append(tid)
                    rest = rest[at + len(tok_text):]
                    if tid in self.rstrip:
                        rest = rest.lstrip(C_SPACE)
            parts = out
        return parts

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        """llama_tokenize(text, add_special = false, parse_special): with parse_special false, text spelling a
        control or unknown token is encoded as text (user-defined tokens still match), as llama.cpp does."""
        out: list[int] = []
        prev_special = True
        for part in self._fragments(text, parse_special):
            if isinstance(part, int):
                out.append(part)
                prev_special = True
                continue
            raw = (" " if self.add_space_prefix and prev_special else "") + part
            self._encode_piece(raw.replace(" ", "\u2581").encode("utf-8"), out)
            prev_special = False
        return out

    # -- 3. pairwise merges by score -----------------------------------------------------------------
    def _encode_piece(self, b: bytes, out: list[int]) -> None:
        starts, sizes, prev, nxt = [], [], [], []
        off = 0
        while off < len(b):
            n = min(_utf8_len(b[off]), len(b) - off)
            starts.append(off)
            sizes.append(n)
            off += n
        count = len(starts)
        if not count:
            return
        prev = list(range(-1, count - 1))
        nxt = list(range(1, count)) + [-1]
        heap: list[tuple[float, int, int, int]] = []
        rev: dict[bytes, tuple[int, int]] = {}

        def add(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            piece = b[starts[left]:starts[left] + sizes[left] + sizes[right]]
            tid = self.to_id.get(piece)
            if tid is None:
                return
            heapq.heappush(heap, (-self.scores[tid], left, right, len(piece)))
            rev[piece] = (left, right)

        for i in range(1, count):
            add(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if sizes[left] == 0 or sizes[right] == 0 or sizes[left] + sizes[right] != size:
                continue
            sizes[left] += sizes[right]
            sizes[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add(prev[left], left)
            add(left, nxt[left])

        # -- 4. pieces back to tokens ------------------------------------------------------------------
        def resegment(i: int) -> None:
            piece = b[starts[i]:starts[i] + sizes[i]]
            tid = self.to_id.get(piece)
            if tid is not None:
                out.append(tid)
                return
            split = rev.get(piece)
            if split is None:
                for byte in piece:
                    out.append(self._byte_token(byte))
                return
            resegment(split[0])
            resegment(split[1])

        i = 0
        while i != -1:
            resegment(i)
            i = nxt[i]

    def _byte_token(self, byte: int) -> int:
        tid = self.to_id.get(f"<0x{byte:02X}>".encode())
        if tid is None:
            tid = self.to_id.get(bytes([byte]))
        if tid is None:
            if self.unk is None:
                raise ValueError(f"the vocabulary has no token for byte 0x{byte:02X} (no <0x{byte:02X}>, no unknown token)")
            tid = int(self.unk)
        return tid
