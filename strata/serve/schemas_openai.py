"""Request bodies of the OpenAI endpoints.

Strict models (no type coercion, unknown fields refused) so that a typo in a
parameter name is a 400, not a silently different request. Known OpenAI
fields this server does not implement are listed in the UNSUPPORTED tables and
refused unless their value is neutral.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from strata.serve.errors import FieldError
from strata.serve.limits import LIMITS, check_stop_strings


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _only_text(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "text"):
            raise ValueError(f"content part type {data.get('type')!r} is not supported (only 'text')")
        return data


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None  # an assistant's earlier thinking, for templates that keep it

    @model_validator(mode="before")
    @classmethod
    def _no_tools(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if data.get("role") in ("tool", "function"):
                raise ValueError(f"role {data['role']!r} is not supported: tool calling is not implemented")
            if data.get("tool_calls"):
                raise ValueError("tool_calls are not supported: tool calling is not implemented")
            if "tool_calls" in data and not data["tool_calls"]:
                data = {k: v for k, v in data.items() if k != "tool_calls"}
        return data

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SamplingFields(_Strict):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 and 0 both mean off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what a torch generator accepts
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # recorded in the request log line

    @model_validator(mode="after")
    def _check_stream_and_stop(self) -> "SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        check_stop_strings("stop", self.stop_list())
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=LIMITS.messages)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs to be true")
        return self

    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] = Field(union_mode="left_to_right")
    logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _one_prompt(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise FieldError("prompt", "a list of several prompts is not supported: one prompt per request")
        if isinstance(self.prompt, list) and not self.prompt:
            raise FieldError("prompt", "prompt must not be empty")
        return self


# OpenAI's completions API defaults max_tokens to 16; keep that so clients see the same lengths.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# Known OpenAI fields without an implementation here: refused unless their value is neutral.
UNSUPPORTED_CHAT: dict[str, list[Any]] = {
    "n": [1],
    "tools": [[]],
    "tool_choice": ["none", "auto"],
    "parallel_tool_calls": [True, False],  # only meaningful with tools, which are refused
    "functions": [[]],
    "function_call": ["none", "auto"],
    "logit_bias": [{}],
    "response_format": [{"type": "text"}],
    "modalities": [["text"]],
    "audio": [],
    "prediction": [],
    "web_search_options": [],
    "store": [False],
    "metadata": [{}],
    "service_tier": ["auto", "default"],
    "reasoning_effort": [],
    "verbosity": [],
    "prompt_cache_key": [],
    "safety_identifier": [],
}

UNSUPPORTED_COMPLETIONS: dict[str, list[Any]] = {
    "n": [1],
    "best_of": [1],
    "echo": [False],
    "suffix": [""],
    "logit_bias": [{}],
}
