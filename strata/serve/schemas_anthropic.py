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


_BLOCK_TYPES = {"text", "thinking"}


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[_by_type(TextBlock, ThinkingBlock)]  # type: ignore[valid-type]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            for i, block in enumerate(data["content"]):
                kind = block.get("type") if isinstance(block, dict) else None
                if not isinstance(kind, str) or kind not in _BLOCK_TYPES:
                    raise ValueError(
                        f"content[{i}]: block type {kind!r:.80} is not supported (text and thinking only)"
                    )
                if kind != "text" and data.get("role") != "assistant":
                    raise ValueError(f"content[{i}]: {kind} blocks may only appear in assistant turns")
        return data

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content if isinstance(b, TextBlock))

    def thinking(self) -> str | None:
        if isinstance(self.content, str):
            return None
        parts = [b.thinking for b in self.content if isinstance(b, ThinkingBlock)]
        return "".join(parts) if parts else None


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

    @model_validator(mode="after")
    def _check(self) -> "MessagesRequest":
        check_stop_strings("stop_sequences", self.stop_sequences or [])
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            raise FieldError(
                "thinking.budget_tokens",
                f"thinking.budget_tokens ({self.thinking.budget_tokens}) must be less than "
                f"max_tokens ({self.max_tokens})"
            )
        return self


class CountTokensRequest(PromptFields):
    pass


# Known Anthropic fields without an implementation here: refused unless neutral.
UNSUPPORTED_MESSAGES: dict[str, list[Any]] = {
    "tools": [[]],
    "tool_choice": [{"type": "none"}, {"type": "auto"}],
    "mcp_servers": [[]],
    "container": [],
    "context_management": [],
    "service_tier": ["auto", "standard_only"],
    "speed": ["standard"],
    "output_config": [{}],
    "inference_geo": [],
    "diagnostics": [],
    "user_profile_id": [],
    "workspace_id": [],
}
