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


class FunctionCall(_Strict):
    name: str = Field(max_length=LIMITS.tool_name)
    arguments: str  # JSON text, as the API sends it


class ToolCallIn(_Strict):
    """A call an earlier assistant turn made, sent back with the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None  # an assistant's earlier thinking, for templates that keep it
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this result answers
    # What an SDK's response message carries when a client sends it back as it came.
    refusal: str | None = None
    annotations: list[Any] | None = Field(None, max_length=0)
    audio: None = None
    function_call: None = None

    @model_validator(mode="before")
    @classmethod
    def _known_role(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("role") == "function":
            raise ValueError("role 'function' (the deprecated function calling) is not supported: "
                             "use tools and role 'tool'")
        return data

    @model_validator(mode="after")
    def _fields_of_role(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise FieldError("tool_calls", "only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise FieldError("tool_call_id", "a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none means no arguments
    strict: bool | None = None  # calls always follow the schema here (grammar-enforced when forced)


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field("response", max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """`text`, `json_object` (any object; llama.cpp's `schema` extension narrows it) or `json_schema`."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    object_schema: dict[str, Any] | None = Field(None, alias="schema")

    @model_validator(mode="after")
    def _schema_for_type(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError("json_schema", "type json_schema needs a json_schema object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise FieldError("json_schema", f"json_schema is not used with type {self.type}")
        return self

    def answer_schema(self) -> dict[str, Any] | bool | None:
        """The schema the answer must follow; None for plain text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return self.object_schema or {"type": "object"}
        assert self.json_schema is not None
        spec = self.json_schema.json_schema
        return {"type": "object"} if spec is None else spec


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
    # llama.cpp and vLLM extensions that map onto what the engine does
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=LIMITS.stop_strings)
    logit_bias: dict[str, float] | None = Field(None, max_length=LIMITS.logit_bias)
    cache_prompt: bool = True  # reuse of a cached prefix is always on; false is still served from it
    return_progress: bool = False  # llama.cpp: stream prompt_progress while the prompt is read
    include_stop_str_in_output: bool = False  # vLLM: the stop string that ended the answer is kept

    @model_validator(mode="after")
    def _check_extras(self) -> "SamplingFields":
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise FieldError("logit_bias", f"logit_bias keys are token ids, got {key!r:.40}")
            if not -100.0 <= value <= 100.0:
                raise FieldError("logit_bias", f"logit_bias values must be in [-100, 100], got {value}")
        if self.return_progress and not self.stream:
            raise FieldError("return_progress", "return_progress is only allowed when stream is true")
        return self

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
    add_generation_prompt: bool = True  # vLLM: false continues without opening a new turn
    tools: list[ToolDef] | None = Field(None, max_length=LIMITS.tools)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> "ChatCompletionRequest":
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise FieldError("tools", "tool names must be unique")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError("tool_choice.function.name",
                             f"tool_choice names {choice.function.name!r:.80}, which is not in tools")
        if choice == "required" and not names:
            raise FieldError("tool_choice", "tool_choice 'required' needs at least one tool")
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise FieldError("response_format", "response_format cannot be combined with a forced tool call")
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
    "functions": [[]],
    "function_call": ["none", "auto"],
    "modalities": [["text"]],
    "audio": [],
    "prediction": [],
    "web_search_options": [],
    "reasoning_effort": [],
    "verbosity": [],
    "echo": [False],
    "continue_final_message": [False],
    "truncate_prompt_tokens": [],
    "typical_p": [1.0, 1],
    "mirostat": [0],
    "dry_multiplier": [0.0, 0],
    "xtc_probability": [0.0, 0],
    "top_n_sigma": [-1.0, -1],
    "skip_special_tokens": [True],
    "spaces_between_special_tokens": [True],
    "return_tokens_as_token_ids": [False],
}

UNSUPPORTED_COMPLETIONS: dict[str, list[Any]] = {
    "n": [1],
    "best_of": [1],
    "echo": [False],
    "suffix": [""],
    **{k: v for k, v in UNSUPPORTED_CHAT.items() if k in (
        "typical_p", "mirostat", "dry_multiplier", "xtc_probability", "top_n_sigma",
        "skip_special_tokens", "spaces_between_special_tokens", "return_tokens_as_token_ids",
        "truncate_prompt_tokens")},
}

# Fields clients send that cannot change an answer here: accepted, logged at debug level, dropped.
IGNORED_OPENAI = frozenset({
    "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier",  # OpenAI bookkeeping
    "keep_alive",  # Ollama: the model stays loaded anyway
    "id_slot", "n_keep", "timings_per_token", "post_sampling_probs",  # llama.cpp scheduling/diagnostics
    "priority", "request_id", "cache_salt",  # vLLM scheduling
})
