"""The conversation behind `kvcli chat`: messages, the chat template, fitting the conversation into the
context, and one record per turn with the figures read from the engine's snapshots. No I/O here: the
REPL (repl.py) prints what this returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from kvcli.config import SamplingParams
from kvcli.engine.request import Request
from kvcli.metrics.snapshot import Snapshot
from kvcli.model.tokenizer import fold_system_prompt
from kvcli.options import EngineOptions


@dataclass(frozen=True)
class ChatArgs:
    system: str | None
    params: SamplingParams  # per reply; turn i samples with seed + i
    truncate: bool
    model: str | None
    quant: str
    options: EngineOptions
    live: bool = False  # the full dashboard while a reply streams (a terminal only)


@dataclass
class TurnRecord:
    user: str
    reply: str
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str | None
    interrupted: bool
    seconds: float
    ttft_s: float | None
    decode_tok_s: float
    kv_blocks: int
    prefix_hit_tokens: int  # prompt tokens found in the prefix cache this turn
    prefill_tokens_saved: int  # prompt tokens this turn did not have to compute
    dropped_tokens: int = 0  # bounded cache (--kv-window): conversation tokens the KV did not keep


@dataclass(frozen=True)
class Fit:
    """The prompt for a turn, or why it was not sent; `notice` also reports dropped turns."""

    ids: list[int] | None
    notice: str | None = None
    error: bool = False  # the notice is an error (shown in red), not a limit


def turn_record(user: str, reply: str, prompt: list[int], req: Request, before: Snapshot, after: Snapshot,
                *, interrupted: bool, seconds: float, kv_blocks: int, dropped_tokens: int = 0) -> TurnRecord:
    """A turn's figures: the request's own timings and the engine counters' change over the turn
    (chat runs one request at a time, so the change is this turn's)."""
    times = req.token_times
    decode_tps = (len(times) - 1) / (times[-1] - times[0]) if len(times) >= 2 and times[-1] > times[0] else 0.0
    ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
    computed = after.prompt_tokens - before.prompt_tokens
    return TurnRecord(
        user=user, reply=reply, prompt_tokens=len(prompt), generated_tokens=len(req.output_token_ids),
        finish_reason="interrupted" if interrupted else req.finish_reason, interrupted=interrupted,
        seconds=round(seconds, 3), ttft_s=None if ttft is None else round(ttft, 3),
        decode_tok_s=round(decode_tps, 2), kv_blocks=kv_blocks,
        prefix_hit_tokens=after.prefix_hit_tokens - before.prefix_hit_tokens,
        # Recomputed tokens (a preempted request) can make `computed` exceed the prompt: nothing saved.
        prefill_tokens_saved=max(0, len(prompt) - computed), dropped_tokens=dropped_tokens)


@dataclass
class Conversation:
    """What the model sees (the system prompt apart from the user/assistant messages), and the turns
    since the last reset."""

    system: str | None
    template: Any  # the tokenizer's apply_chat_template(messages, add_generation_prompt=True)
    messages: list[dict] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    dropped_turns: int = 0  # turns dropped by --truncate since the last reset
    total_turns: int = 0  # over the whole session
    total_prompt: int = 0
    total_hits: int = 0
    # The template has no system role (Gemma 2's raises on one): the system prompt opens the first user
    # message instead, as llama.cpp merges it for such templates and Gemma 3's own template does.
    system_inline: bool = False

    def __post_init__(self) -> None:
        if self.system:
            probe = [{"role": "user", "content": "x"}]
            try:
                self.template([{"role": "system", "content": self.system}, *probe], add_generation_prompt=True)
            except Exception:
                try:
                    self.template(probe, add_generation_prompt=True)
                    self.system_inline = True
                except Exception:  # the template rejects plain messages too: fit() reports it per turn
                    pass

    @property
    def system_notice(self) -> str | None:
        """One line for the user when the system prompt could not be sent as a system message."""
        if not self.system_inline:
            return None
        return "this model's chat template has no system role: the system prompt opens the first user message"

    def _messages(self, history: list[dict], user: dict | None) -> list[dict]:
        msgs = [{"role": m["role"], "content": m["content"]} for m in history]
        if user is not None:
            msgs.append(dict(user))
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + msgs
        return fold_system_prompt(msgs) if self.system_inline else msgs

    def prompt(self, history: list[dict], user: dict | None = None) -> list[int]:
        return list(self.template(self._messages(history, user), add_generation_prompt=True))

    def context_tokens(self) -> int:
        """Prompt tokens of the conversation as it stands (0 when the template rejects it)."""
        if not (self.messages or self.system):
            return 0
        try:
            return len(self.prompt(self.messages))
        except Exception:  # a model's Jinja template may reject a conversation
            return 0

    def system_tokens(self) -> int:
        """Prompt tokens of the system prompt as the template renders it (what the sinks must cover). Without
        one, those the template puts before any user text of its own accord (SmolLM2's and Qwen's default system
        prompt, Llama 3.1's date block): the tokens two one-message conversations share."""
        if not self.system:
            try:
                a, b = (list(self.template([{"role": "user", "content": t}], add_generation_prompt=False))
                        for t in ("a", "z"))
            except Exception:
                return 0
            return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        role = "user" if self.system_inline else "system"
        try:
            return len(self.template([{"role": role, "content": self.system}], add_generation_prompt=False))
        except Exception:
            return 0

    def fit(self, user: dict, max_len: int, max_tokens: int, truncate: bool, bounded: bool = False) -> Fit:
        """The prompt ids for the conversation plus `user`, leaving room for max_tokens; drops the
        oldest turns when `truncate`. `bounded` (a --kv-window cache): any length goes, the KV keeps the
        sinks and the window."""
        room = max_len - max_tokens
        try:
            ids = self.prompt(self.messages, user)
            if len(ids) <= room or bounded:
                return Fit(ids)
            alone = self.prompt([], user)
        except Exception as ex:  # a model's Jinja template may reject a conversation; never crash
            return Fit(None, f"cannot apply the chat template: {ex}; not sent", error=True)
        if len(alone) > room:
            return Fit(None, f"message too long: {len(alone):,} prompt tokens + --max-tokens {max_tokens} exceed "
                             f"the {max_len:,}-token context; not sent")
        if not truncate:
            return Fit(None, f"context full: this turn needs {len(ids):,} prompt tokens + --max-tokens {max_tokens} "
                             f"> the {max_len:,}-token context; /reset to start over (or run with --truncate); "
                             f"not sent")
        starts = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        for k in range(1, len(starts) + 1):
            cut = starts[k] if k < len(starts) else len(self.messages)
            ids = self.prompt(self.messages[cut:], user)
            if len(ids) <= room:
                del self.messages[:cut]
                self.dropped_turns += k
                return Fit(ids, f"context full: dropped the {k} oldest turn{'s' if k != 1 else ''} to fit "
                                f"({len(ids):,} prompt tokens + --max-tokens {max_tokens} <= {max_len:,})")
        return Fit(None, "context full; not sent")  # unreachable: dropping every turn leaves the message alone

    def add(self, user: dict, rec: TurnRecord) -> None:
        """Keeps the exchange; an interrupted reply is kept as shown and marked (as chat UIs do)."""
        self.messages.append(user)
        msg: dict = {"role": "assistant", "content": rec.reply}
        if rec.interrupted:
            msg["interrupted"] = True
        self.messages.append(msg)
        self.turns.append(rec)
        self.total_turns += 1
        self.total_prompt += rec.prompt_tokens
        self.total_hits += rec.prefix_hit_tokens

    def reset(self) -> int:
        """Clears the conversation (the system prompt stays); returns the turns cleared."""
        n = len(self.turns)
        self.messages.clear()
        self.turns.clear()
        self.dropped_turns = 0
        return n

    def transcript(self, model: str, params: SamplingParams, max_model_len: int, truncate: bool) -> dict:
        """What /save writes."""
        return {
            "model": model,
            "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "system": self.system,
            "settings": {"max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
                         "top_k": params.top_k, "seed": params.seed, "max_model_len": max_model_len,
                         "truncate": truncate},
            "messages": self.messages,
            "dropped_turns": self.dropped_turns,
            "turns": [asdict(t) for t in self.turns],
        }
