"""OpenAI-compatible request bodies.

Types are strict: `"stream": "yes"` or `"max_tokens": true` is a 400, not a coercion, and a float that
is NaN or infinite is refused as not finite. Unknown fields are refused (extra="forbid"), so a typo
such as `max_token` is a 400 instead of a silently ignored limit. Every standard OpenAI parameter is
accepted at its default or null value (clients such as LangChain send `tools: null`, `logprobs: false`,
`response_format: {"type": "text"}` on every call); a value kvcli cannot honour is refused by name,
with the parameter in the error's `param`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvcli.config import MAX_LOGPROBS




class Unsupported(ValueError):
    """A standard parameter at a value kvcli cannot honour."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = None  # vLLM's: with include_usage, the usage so far on every chunk


class ResponseFormat(_Strict):
    type: str
    json_schema: dict[str, Any] | None = None


def _finite(ge: float | None = None, le: float | None = None, gt: float | None = None, default: Any = None):
    return Field(default=default, ge=ge, le=le, gt=gt, allow_inf_nan=False)


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = _finite(ge=0.0, le=100.0)  # null or absent: OpenAI's default, 1
    top_p: float | None = _finite(gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM extension; -1 and 0 both mean off
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    include_stop_str_in_output: bool | None = None  # vLLM extension
    ignore_eos: bool | None = None  # vLLM extension (benchmarks use it for fixed output lengths)
    n: int | None = Field(default=None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as by OpenAI
    presence_penalty: float | None = _finite(ge=-2.0, le=2.0)
    frequency_penalty: float | None = _finite(ge=-2.0, le=2.0)
    repetition_penalty: float | None = _finite(gt=0.0)  # vLLM extension
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None  # an int (completions) or a bool (chat): checked per endpoint
    min_tokens: int | None = Field(default=None, ge=0)  # vLLM extension
    # kvcli's own: special tokens typed in the prompt / message contents (`<|im_start|>`) are text
    # unless the request asks for them to be parsed as control tokens.
    parse_special_tokens: bool | None = False

    def unsupported(self) -> list[tuple[str, bool, str]]:
        """(param, refused?, why): the values kvcli cannot honour."""
        return [
            ("logit_bias", bool(self.logit_bias), "logit_bias is not supported (send null or {})"),
            ("min_tokens", bool(self.min_tokens), "min_tokens is not supported (send 0 or null)"),
        ]

    @model_validator(mode="after")
    def _check_unsupported(self) -> "_Sampling":
        for param, refused, why in self.unsupported():
            if refused:
                raise Unsupported(param, why)
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise Unsupported("stop_token_ids", "stop_token_ids must be >= 0")
        return self

    def penalties(self) -> dict[str, float]:
        """The penalty fields of kvcli's SamplingParams (null: off)."""
        return {"presence_penalty": self.presence_penalty or 0.0, "frequency_penalty": self.frequency_penalty or 0.0,
                "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty}

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)  # "" in a list: refused as alone


class CompletionRequest(_Sampling):
    # A string or token ids (vLLM and llama.cpp accept both; `kvcli profile --endpoint` sends ids so every
    # server sees the same tokens), or a batch of either (lm-eval's local-completions sends [[ids], ...]):
    # choice i * n + j is sample j of prompt i, as OpenAI numbers them.
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, bool, str]]:
        return [*super().unsupported(),
                ("best_of", (self.best_of or 1) != 1, "best_of > 1 is not supported (send 1 or null)"),
                ("suffix", bool(self.suffix), "suffix (insertion) is not supported (send null)"),
                ("logprobs", not (self.logprobs in (None, False) or
                              (type(self.logprobs) is int and 0 <= self.logprobs <= MAX_LOGPROBS)),
                 f"logprobs: the number of top tokens to return, 0..{MAX_LOGPROBS}, or null")]

    def logprob_count(self) -> int | None:
        # `is`, not `in (None, False)`: 0 == False, and logprobs 0 asks for each token's log probability alone
        return None if self.logprobs is None or self.logprobs is False else int(self.logprobs)

    def prompt_logprob_count(self) -> int | None:
        """echo with logprobs: the prompt's tokens are reported too, each given those before it."""
        return self.logprob_count() if self.echo else None

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt (a string, or token ids)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @model_validator(mode="after")
    def _nonempty(self) -> "CompletionRequest":
        if not self.prompt or any(not p for p in self.prompts):
            raise Unsupported("prompt", "prompt is empty")
        if any(isinstance(p, list) and any(t < 0 for t in p) for p in self.prompts):
            raise Unsupported("prompt", "prompt token ids must be >= 0")
        return self


class TextPart(_Strict):
    type: str
    text: str | None = None
    # other part types (image_url, input_audio, file) carry their own fields: refused by type below
    model_config = ConfigDict(extra="allow", strict=True)


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # on role "tool"
    tool_calls: list[dict[str, Any]] | None = None  # on role "assistant": only none or []
    refusal: str | None = None
    function_call: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _text_only(self) -> "ChatMessage":
        if isinstance(self.content, list):
            for p in self.content:
                if p.type != "text" or p.text is None:
                    raise Unsupported("messages", f"content part type {p.type!r} is not supported (text only)")
        if self.tool_calls:
            raise Unsupported("messages", "assistant tool_calls are not supported (no tool calling in kvcli)")
        if self.function_call is not None:
            raise Unsupported("messages", "function_call is not supported (no tool calling in kvcli)")
        if self.content is None and self.role != "assistant":
            raise Unsupported("messages", f"a {self.role} message needs content")
        return self

    def as_template_message(self) -> dict[str, str]:
        """What the chat template sees: parts joined by newlines (as vLLM), developer as system (the
        templates of open models know no developer role), name kept where given."""
        if isinstance(self.content, list):
            text = "\n".join(p.text or "" for p in self.content)
        else:
            text = self.content or ""
        msg = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    add_generation_prompt: bool | None = True  # vLLM extension
    continue_final_message: bool | None = False  # vLLM extension

    def unsupported(self) -> list[tuple[str, bool, str]]:
        no_tools = "tool calling is not supported by kvcli serve"
        return [*super().unsupported(),
                ("logprobs", self.logprobs not in (None, False, True), "logprobs: true, false or null"),
                ("top_logprobs", bool(self.top_logprobs) and self.logprobs is not True,
                 "top_logprobs needs logprobs: true"),
                ("tools", bool(self.tools), f"{no_tools} (send null or [])"),
                ("tool_choice", self.tool_choice not in (None, "none", "auto"),
                 f"{no_tools} (tool_choice: send null, \"none\" or \"auto\" without tools)"),
                ("functions", bool(self.functions), f"{no_tools} (send null or [])"),
                ("function_call", self.function_call not in (None, "none", "auto"), f"{no_tools}"),
                ("response_format", self.response_format is not None and self.response_format.type != "text",
                 "response_format: only {\"type\": \"text\"} is supported (no constrained decoding)"),
                ("store", bool(self.store), "store: kvcli keeps no completions (send false or null)"),
                ("modalities", self.modalities not in (None, [], ["text"]), "modalities: text only"),
                ("audio", self.audio is not None, "audio output is not supported (send null)"),
                ("prediction", self.prediction is not None, "predicted outputs are not supported (send null)"),
                ("reasoning_effort", self.reasoning_effort is not None,
                 "reasoning_effort: this model does not reason (send null)"),
                ("web_search_options", self.web_search_options is not None, "web search is not supported"),
                ("service_tier", self.service_tier not in (None, "auto", "default"),
                 "service_tier: only \"auto\" or \"default\""),
                ("add_generation_prompt", self.add_generation_prompt is False, "add_generation_prompt: only true"),
                ("continue_final_message", bool(self.continue_final_message),
                 "continue_final_message is not supported"),
                ("verbosity", self.verbosity not in (None, "medium"), "verbosity: only \"medium\" or null")]

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs is True else None


class InputText(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(_Strict):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def as_template_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class TextConfig(_Strict):
    format: ResponseFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(_Strict):
    """OpenAI's Responses API, for text: `input` as a string or a list of messages (text parts),
    `instructions` as a system message ahead of them. Nothing is stored (no previous_response_id)."""

    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = _finite(ge=0.0, le=100.0)
    top_p: float | None = _finite(gt=0.0, le=1.0)
    stream: bool | None = False
    store: bool | None = None  # OpenAI's default is true; kvcli keeps nothing either way
    metadata: dict[str, str] | None = None
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    service_tier: str | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)  # kvcli's (not in OpenAI's Responses API)
    parse_special_tokens: bool | None = False

    @model_validator(mode="after")
    def _check_unsupported(self) -> "ResponsesRequest":
        no_tools = "tool calling is not supported by kvcli serve"
        fmt = self.text.format if self.text is not None else None
        checks = [
            ("tools", bool(self.tools), f"{no_tools} (send null or [])"),
            ("tool_choice", self.tool_choice not in (None, "none", "auto"), no_tools),
            ("text", fmt is not None and fmt.type != "text", "text.format: only {\"type\": \"text\"}"),
            ("reasoning", bool(self.reasoning and any(v is not None for v in self.reasoning.values())),
             "reasoning: this model does not reason (send null)"),
            ("truncation", self.truncation not in (None, "disabled"), "truncation: only \"disabled\""),
            ("top_logprobs", bool(self.top_logprobs), "top_logprobs is not supported (send 0 or null)"),
            ("include", bool(self.include), "include: nothing extra can be included (send null or [])"),
            ("previous_response_id", self.previous_response_id is not None,
             "previous_response_id: kvcli stores no responses; send the whole conversation as input"),
            ("conversation", self.conversation is not None, "conversation: kvcli stores no conversations"),
            ("background", bool(self.background), "background responses are not supported"),
            ("prompt", self.prompt is not None, "prompt templates are not supported"),
            ("service_tier", self.service_tier not in (None, "auto", "default"),
             "service_tier: only \"auto\" or \"default\""),
        ]
        for param, refused, why in checks:
            if refused:
                raise Unsupported(param, why)
        if isinstance(self.input, list) and not self.input:
            raise Unsupported("input", "input is empty")
        return self

    def messages(self) -> list[dict[str, str]]:
        msgs = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        if isinstance(self.input, str):
            return [*msgs, {"role": "user", "content": self.input}]
        return [*msgs, *(m.as_template_message() for m in self.input)]
