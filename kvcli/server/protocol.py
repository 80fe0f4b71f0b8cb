"""OpenAI-compatible request bodies. Unknown fields are refused (extra="forbid") so a typo such as
`max_token` is a 400 instead of a silently ignored limit; fields kvcli cannot honour are refused by
name rather than accepted and ignored."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)  # OpenAI's default is 1
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # vLLM extension; -1 and 0 both mean off
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension (benchmarks use it for fixed output lengths)
    n: int = Field(default=1, ge=1, le=1)  # n > 1 would need one stream per sample; refused for now
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as by OpenAI
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0)  # no penalties in kvcli's sampler
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0)

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)


class CompletionRequest(_Sampling):
    # A string, or token ids (vLLM and llama.cpp accept both; `kvcli profile --endpoint` sends ids so
    # every server sees the same tokens). Batches of prompts are not supported.
    prompt: str | list[int]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: Literal[False] = False

    @model_validator(mode="after")
    def _nonempty(self) -> "CompletionRequest":
        if not self.prompt:
            raise ValueError("prompt is empty")
        if isinstance(self.prompt, list) and any(t < 0 for t in self.prompt):
            raise ValueError("prompt token ids must be >= 0")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
