"""What a request that leaves sampling unsaid is sampled with: one resolution for the CLI and the server.

Layers, each over the one before:

1. Strata's base: the APIs' own defaults (temperature 1, no top_k, top_p or
   min_p, no penalties), as OpenAI, Anthropic and vLLM document them;
2. the model's recommendation (`strata/models/generation_defaults.py`):
   its `generation_config.json` or GGUF `general.sampling.*` keys.
   `--generation-config vllm` ignores it, `--generation-config FOLDER` reads
   that folder's `generation_config.json` instead (vLLM's spellings);
3. the command line's flags (`--temp`, `--top-k`, ... as llama-server spells them);
4. each request's own fields (`SamplingDefaults.params`).

`strata generate`, `strata chat` and `strata serve` all go through
`defaults_from_args`, so the same prompt with no sampling fields is sampled
alike by all three. The result is a value handed to where requests are built,
never a global.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata.engine.types import SamplingParams
from strata.models.generation_defaults import (
    GENERATION_CONFIG,
    ModelSampling,
    read_generation_config,
)

# The flag that sets each field, for messages and the start-up line.
FLAGS = {"temperature": "--temp", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
         "repetition_penalty": "--repeat-penalty", "presence_penalty": "--presence-penalty",
         "frequency_penalty": "--frequency-penalty"}
GENERATION_CONFIG_MODES = ("auto", "vllm")


@dataclass(frozen=True)
class SamplingDefaults:
    """The resolved defaults; `origins` says which fields came from the model or a flag."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    origins: tuple[tuple[str, str], ...] = ()  # (field, "model" or its flag), for the start-up line
    model_source: str = ""  # the file the model's values were read from
    ignored: tuple[str, ...] = ()  # the model's keys that name samplers Strata does not have

    def params(
        self,
        *,
        max_tokens: int,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        stop: list[str] | None = None,
        **engine_fields: Any,
    ) -> SamplingParams:
        """A request's SamplingParams: its own value where it gives one (not None), the default
        elsewhere. A negative top_k means off (-1 is OpenAI-compatible servers' spelling).
        `engine_fields` pass through as they are (seed, stop, logprobs, grammar, ...)."""
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingParams(
            **engine_fields,
            max_tokens=max_tokens,
            temperature=pick(temperature, self.temperature),
            top_p=pick(top_p, self.top_p),
            top_k=max(pick(top_k, self.top_k), 0),
            min_p=pick(min_p, self.min_p),
            repetition_penalty=pick(repetition_penalty, self.repetition_penalty),
            presence_penalty=pick(presence_penalty, self.presence_penalty),
            frequency_penalty=pick(frequency_penalty, self.frequency_penalty),
            stop=list(stop or []),
        )

    def describe(self) -> str:
        """One line for start-up: every value, and where those not at Strata's base came from."""
        origin = dict(self.origins)
        parts = []
        for name in FLAGS:
            value = getattr(self, name)
            where = origin.get(name)
            parts.append(f"{name} {value:g}" + (f" ({where})" if where else ""))
        line = "sampling defaults: " + ", ".join(parts)
        if self.model_source:
            line += f"; model: {self.model_source}"
        if self.ignored:
            line += f"; not applied (no such sampler here): {', '.join(self.ignored)}"
        return line


def resolve_defaults(model: ModelSampling, flags: dict[str, float | int | None] | None = None) -> SamplingDefaults:
    """Strata's base, then the model's values, then the flags given (None: not given)."""
    values: dict[str, Any] = {}
    origins: list[tuple[str, str]] = []
    for name, value in model.values().items():
        values[name] = value
        origins.append((name, "model"))
    for name, value in (flags or {}).items():
        if name not in FLAGS:
            raise ValueError(f"no sampling default named {name!r}")
        if value is not None:
            values[name] = value
            origins = [o for o in origins if o[0] != name] + [(name, FLAGS[name])]
    order = list(FLAGS)
    origins.sort(key=lambda o: order.index(o[0]))
    return SamplingDefaults(**values, origins=tuple(origins), model_source=model.source, ignored=model.ignored)


def model_sampling(mode: str, own: ModelSampling) -> ModelSampling:
    """--generation-config: auto = the model's own recommendation, vllm = none, a folder = its
    generation_config.json."""
    if mode == "auto":
        return own
    if mode == "vllm":
        return ModelSampling()
    return read_generation_config(Path(mode))


def defaults_from_args(args: argparse.Namespace, own: ModelSampling) -> SamplingDefaults:
    """The defaults the parsed flags name over `own`, the loaded model's recommendation."""
    flags = {name: getattr(args, name, None) for name in FLAGS}
    return resolve_defaults(model_sampling(getattr(args, "generation_config", "auto"), own), flags)


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"a number, not {text!r}")
    return value


def _ranged(low: float, high: float, what: str) -> Callable[[str], float]:
    def check(text: str) -> float:
        value = _number(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{what}, not {text!r}")
        return value
    return check


def top_k_arg(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a count of at least 0 (0: off), not {text!r}")
    return int(text)


def repeat_penalty_arg(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a number above 0 (1: off), not {text!r}")
    return value


def generation_config_arg(text: str) -> str:
    """--generation-config: auto, vllm, or a folder holding generation_config.json, checked while
    parsing."""
    if text in GENERATION_CONFIG_MODES or (Path(text) / GENERATION_CONFIG).is_file():
        return text
    raise argparse.ArgumentTypeError(f"choose from auto, vllm or a folder holding {GENERATION_CONFIG}, "
                                     f"not {text!r}")


def add_sampling_default_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The flags over the model's sampling defaults, shared by generate, chat and serve; left out,
    each field keeps the model's value (or Strata's base)."""
    unset = " (default: the model's, else {})"
    parser.add_argument("--temperature", "--temp", type=_ranged(0.0, math.inf, "a number of at least 0"),
                        default=None, help="0 = greedy" + unset.format(1))
    parser.add_argument("--top-p", type=_ranged(0.0, 1.0, "a number from 0 to 1"), default=None,
                        help="nucleus sampling; 1 = off" + unset.format(1))
    parser.add_argument("--top-k", type=top_k_arg, default=None, help="0 = off" + unset.format(0))
    parser.add_argument("--min-p", type=_ranged(0.0, 1.0, "a number from 0 to 1"), default=None,
                        help="relative to the most likely token; 0 = off" + unset.format(0))
    parser.add_argument("--repeat-penalty", dest="repetition_penalty", type=repeat_penalty_arg, default=None,
                        help="1 = off" + unset.format(1))
    parser.add_argument("--presence-penalty", type=_ranged(-2.0, 2.0, "a number from -2 to 2"), default=None,
                        help="0 = off (default 0)")
    parser.add_argument("--frequency-penalty", type=_ranged(-2.0, 2.0, "a number from -2 to 2"), default=None,
                        help="0 = off (default 0)")
    parser.add_argument("--generation-config", type=generation_config_arg, default="auto",
                        metavar="auto|vllm|FOLDER",
                        help="the sampling defaults' source: auto = the model's generation_config.json or "
                             "GGUF general.sampling.* keys; vllm = none (Strata's own); FOLDER = that "
                             "folder's generation_config.json")

