"""Request bodies of the Anthropic endpoints (/v1/messages, /v1/messages/count_tokens).

Strict like the OpenAI models: unknown fields and wrong types are a 400 that
names the field. `cache_control` on blocks is accepted because prompt caching
is automatic here (the engine reuses any cached prefix), so the hint is
already honoured.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from strata.serve.errors import FieldError
from strata.serve.limits import LIMITS, check_stop_strings


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _by_type(*models: type[_Strict]) -> Any:
    """A union chosen by the "type" field, tagged "type=x" so error paths can drop the tag."""

    def tag(value: Any) -> str | None:
        return f"type={value.get('type')}" if isinstance(value, dict) else None

    members = tuple(Annotated[m, Tag(f"type={get_args(m.model_fields['type'].annotation)[0]}")] for m in models)
    return Annotated[Union[members], Discriminator(tag)]  # noqa: UP007 (a runtime-built union)


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = Field(None, max_length=0)


class ThinkingBlock(_Strict):
    """An assistant's earlier thinking, sent back by clients in multi-turn conversations."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ToolUseBlock(_Strict):
    """A call an earlier assistant turn made."""

    type: Literal["tool_use"]
    id: str
    name: str = Field(max_length=LIMITS.tool_name)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    """A tool's answer to a call, in a user turn: text, or a list of text blocks."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content)


_BLOCK_TYPES = {"text", "thinking", "redacted_thinking", "tool_use", "tool_result"}
_ASSISTANT_ONLY = {"thinking", "redacted_thinking", "tool_use"}


class RedactedThinkingBlock(_Strict):
    """Thinking the client cannot read; nothing of it reaches the template."""

    type: Literal["redacted_thinking"]
    data: str


Block = _by_type(TextBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock, ToolResultBlock)


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]  # type: ignore[valid-type]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            for i, block in enumerate(data["content"]):
                kind = block.get("type") if isinstance(block, dict) else None
                if not isinstance(kind, str) or kind not in _BLOCK_TYPES:
                    raise ValueError(
                        f"content[{i}]: block type {kind!r:.80} is not supported "
                        f"({', '.join(sorted(_BLOCK_TYPES))})"
                    )
                if kind in _ASSISTANT_ONLY and data.get("role") != "assistant":
                    raise ValueError(f"content[{i}]: {kind} blocks may only appear in assistant turns")
                if kind == "tool_result" and data.get("role") != "user":
                    raise ValueError(f"content[{i}]: tool_result blocks may only appear in user turns")
        return data

    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content

    def text(self) -> str:
        return "".join(b.text for b in self.blocks() if isinstance(b, TextBlock))

    def thinking(self) -> str | None:
        parts = [b.thinking for b in self.blocks() if isinstance(b, ThinkingBlock)]
        return "".join(parts) if parts else None


class ToolDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None  # inputs always follow the schema here when a call is forced
    input_examples: list[dict[str, Any]] | None = None  # not shown to the model


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_for_tool(self) -> "ToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise FieldError("name", "tool_choice type 'tool' needs a name, and only it")
        return self


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class OutputConfig(_Strict):
    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # no effort control here


class ThinkingEnabled(_Strict):
    """Thinking with a hard budget: the block is closed when it reaches budget_tokens."""

    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(_Strict):
    """Thinking on, its length left to the model."""

    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(_Strict):
    type: Literal["disabled"]


class Metadata(_Strict):
    user_id: str | None = None  # recorded in the request log line


class PromptFields(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1, max_length=LIMITS.messages)
    system: str | list[TextBlock] | None = None
    thinking: _by_type(ThinkingEnabled, ThinkingAdaptive, ThinkingDisabled) | None = None  # type: ignore[valid-type]
    cache_control: CacheControl | None = None  # caching is automatic: every prefix is reusable
    tools: list[ToolDef] | None = Field(None, max_length=LIMITS.tools)
    tool_choice: ToolChoice | None = None

    @model_validator(mode="after")
    def _check_tools(self) -> "PromptFields":
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise FieldError("tools", "tool names must be unique")
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise FieldError("tool_choice.name", f"tool_choice names {choice.name!r:.80}, which is not in tools")
        if choice is not None and choice.type == "any" and not names:
            raise FieldError("tool_choice", "tool_choice 'any' needs at least one tool")
        return self

    def system_text(self) -> str | None:
        if self.system is None:
            return None
        if isinstance(self.system, str):
            return self.system
        return "".join(b.text for b in self.system)

    def enable_thinking(self) -> bool | None:
        """The template switch: None leaves the template's own default."""
        if self.thinking is None:
            return None
        return not isinstance(self.thinking, ThinkingDisabled)

    def omit_thinking(self) -> bool:
        """display: "omitted" sends thinking blocks without their text."""
        return getattr(self.thinking, "display", None) == "omitted"


class MessagesRequest(PromptFields):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> "MessagesRequest":
        check_stop_strings("stop_sequences", self.stop_sequences or [])
        forced = self.tool_choice is not None and self.tool_choice.type in ("any", "tool")
        if forced and self.output_format() is not None:
            raise FieldError("output_config.format", "an output format cannot be combined with a forced tool call")
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            raise FieldError(
                "thinking.budget_tokens",
                f"thinking.budget_tokens ({self.thinking.budget_tokens}) must be less than "
                f"max_tokens ({self.max_tokens})"
            )
        return self


    def output_format(self) -> dict[str, Any] | None:
        """The JSON schema the answer's text must follow, if any."""
        fmt = self.output_config.format if self.output_config is not None else None
        return None if fmt is None else fmt.json_schema


class CountTokensRequest(PromptFields):
    pass


# Known Anthropic fields without an implementation here: refused unless neutral.
UNSUPPORTED_MESSAGES: dict[str, list[Any]] = {
    "mcp_servers": [[]],
    "container": [],
    "context_management": [],
    "inference_geo": [],
    "diagnostics": [],
}

# Fields that cannot change an answer here: accepted, logged at debug level, dropped.
IGNORED_ANTHROPIC = frozenset({"service_tier", "speed", "user_profile_id", "workspace_id"})
