"""Request bodies of llama-server's native routes: /completion, /tokenize, /detokenize.

Field names and meanings follow llama.cpp's `tools/server/README.md`, so
scripts written for llama-server send the same bodies here. Strict like the
OpenAI models: an unknown or mistyped field is a 400 naming it, and the
llama.cpp samplers Strata does not have are refused unless neutral.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from strata.serve.errors import FieldError
from strata.serve.limits import LIMITS, check_stop_strings

SAMPLERS_MAX = 32  # names (or letters) in one sampler chain: llama.cpp's has 11 kinds


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class NativeCompletionRequest(_Strict):
    """`POST /completion`: a prompt as text, token ids, or both mixed in one list."""

    prompt: str | list[int | str] = Field(union_mode="left_to_right")
    n_predict: int = Field(-1, ge=-1)  # -1: until EOS or the context is full; 0: read the prompt only
    temperature: float | None = None  # <= 0 is greedy, as in llama.cpp
    top_k: int | None = Field(None, ge=-1)  # 0 and -1: off
    top_p: float | None = Field(None, ge=0.0, le=1.0)  # 1.0: off (0 keeps only the top token)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, gt=0.0)
    repeat_last_n: int | None = Field(None, ge=-1)  # Strata's penalty sees the whole context (-1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-1, le=2**64 - 1)  # -1: a random seed, as llama.cpp
    stop: list[str] | None = None
    stream: bool = False
    cache_prompt: bool = True  # Strata always reuses a cached prefix; false is served the same way
    id_slot: int = Field(-1, ge=-1)  # -1: the scheduler picks (the longest prefix); N: lane N
    n_probs: int = Field(0, ge=0, le=20)
    samplers: str | list[str] | None = Field(None, max_length=SAMPLERS_MAX)  # the chain (samplers.py)
    post_sampling_probs: bool = False
    return_tokens: bool = False
    ignore_eos: bool = False
    min_keep: int = Field(0, ge=0, le=0)  # llama.cpp's default; other values change nothing here
    model: str | None = None  # accepted as the OpenAI routes do: one model is served

    @model_validator(mode="after")
    def _check(self) -> "NativeCompletionRequest":
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise FieldError("prompt", "prompt must not be empty")
            if len(self.prompt) > 1 and all(isinstance(p, str) for p in self.prompt):
                raise FieldError("prompt", "several prompts in one request are not supported: "
                                           "send one prompt (a string, or a list mixing token ids and strings)")
        if self.post_sampling_probs:
            raise FieldError("post_sampling_probs", "post_sampling_probs is not supported: n_probs "
                                                    "reports the model's log-probabilities before sampling")
        penalised = self.repeat_penalty not in (None, 1.0)
        if penalised and self.repeat_last_n not in (None, -1):
            raise FieldError("repeat_last_n", f"repeat_last_n {self.repeat_last_n}: the repeat penalty "
                                              "here covers the whole context; send -1")
        check_stop_strings("stop", self.stop or [])
        return self


class TokenizeRequest(_Strict):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False

    @model_validator(mode="after")
    def _check(self) -> "TokenizeRequest":
        if not self.parse_special:
            raise FieldError("parse_special", "parse_special false is not supported: special tokens "
                                              "written in the text are always matched whole")
        return self


class DetokenizeRequest(_Strict):
    tokens: list[int] = Field(max_length=LIMITS.array_items)


# llama.cpp sampler fields without an implementation here: refused unless their value is neutral.
UNSUPPORTED_NATIVE: dict[str, list[Any]] = {
    "typical_p": [1.0, 1],
    "mirostat": [0],
    "dry_multiplier": [0.0, 0],
    "xtc_probability": [0.0, 0],
    "top_n_sigma": [-1.0, -1],
    "dynatemp_range": [0.0, 0],
    "grammar": [""],
    "json_schema": [],
    "lora": [[]],
    "n_indent": [0],
    "t_max_predict_ms": [0],
    "response_fields": [],
    "multimodal_data": [[]],
}

# Fields that cannot change an answer here (context shift, diagnostics): accepted and dropped.
IGNORED_NATIVE = frozenset({"n_keep", "n_discard", "timings_per_token"})
