"""The sampling a model's own files recommend: `generation_config.json` or GGUF `general.sampling.*`.

Model authors ship the temperature, top_p, ... their model was tuned for; Hugging
Face folders carry them in `generation_config.json`, and llama.cpp's converter
copies them into a GGUF file's `general.sampling.*` keys. This module only
reads what the files say (None where they say nothing); which value a request
finally gets (the model's, a flag's, the request's own) is decided in
`strata/engine/sampling_defaults.py`. A value out of range is skipped with a
warning rather than failing the load: the weights are still good.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"

# gguf-py's Keys.General.SAMPLING_* as llama.cpp's converter writes them, by the field they fill.
GGUF_KEYS = {
    "temperature": "general.sampling.temp",
    "top_p": "general.sampling.top_p",
    "top_k": "general.sampling.top_k",
    "min_p": "general.sampling.min_p",
    "repetition_penalty": "general.sampling.penalty_repeat",
}
GGUF_PREFIX = "general.sampling."


@dataclass(frozen=True)
class ModelSampling:
    """What a model's files recommend; None where they say nothing."""

    temperature: float | None = None  # 0: greedy (generation_config's do_sample false)
    top_p: float | None = None
    top_k: int | None = None  # 0: off
    min_p: float | None = None
    repetition_penalty: float | None = None
    source: str = ""  # where the values were read ("" when nothing was)
    ignored: tuple[str, ...] = ()  # keys naming samplers Strata does not have (mirostat, xtc, ...)

    def values(self) -> dict[str, float | int]:
        """The fields the files set, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("source", "ignored") and getattr(self, f.name) is not None}


def _valid(name: str, value: Any) -> float | int | None:
    """`value` as the field's type when it is in the field's range, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if name == "top_k":  # llama.cpp's files say -1 for off
        return max(int(value), 0) if value == int(value) else None
    ok = {"temperature": value >= 0, "top_p": 0 < value <= 1, "min_p": 0 <= value <= 1,
          "repetition_penalty": value > 0}[name]
    return round(float(value), 6) if ok else None  # GGUF stores float32: 0.6 reads 0.6000000238


def _checked(raw: dict[str, Any], source: str) -> dict[str, float | int]:
    out = {}
    for name, value in raw.items():
        good = _valid(name, value)
        if good is None:
            log.warning("%s: %s %r is not a usable value; the default is used instead", source, name, value)
        else:
            out[name] = good
    return out


def from_generation_config(raw: dict[str, Any], source: str = GENERATION_CONFIG) -> ModelSampling:
    """The sampling fields of a parsed generation_config.json. `do_sample: false` means greedy
    (transformers decodes greedily then, whatever temperature says); the repetition penalty
    still applies to greedy decoding, as in transformers."""
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    found = {n: raw[n] for n in names if raw.get(n) is not None}
    if raw.get("do_sample") is False:
        found = {"temperature": 0.0, **({"repetition_penalty": found["repetition_penalty"]}
                                         if "repetition_penalty" in found else {})}
    values = _checked(found, source)
    return ModelSampling(**values, source=source if values else "")  # type: ignore[arg-type]


def read_generation_config(folder: Path) -> ModelSampling:
    """A folder's generation_config.json; nothing when it has none or it cannot be read."""
    path = folder / GENERATION_CONFIG
    if not path.is_file():
        return ModelSampling()
    try:
        raw = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        log.warning("%s: not readable JSON (%s); the model's sampling defaults are not used", path, e)
        return ModelSampling()
    if not isinstance(raw, dict):
        return ModelSampling()
    return from_generation_config(raw, str(path))


def from_gguf_metadata(meta: dict[str, Any], source: str = "GGUF metadata") -> ModelSampling:
    """The `general.sampling.*` keys of a GGUF file; the ones without a Strata sampler (mirostat,
    xtc, the sampler sequence, penalty_last_n) are listed in `ignored`."""
    found = {name: meta[key] for name, key in GGUF_KEYS.items() if key in meta}
    known = set(GGUF_KEYS.values())
    ignored = tuple(sorted(k.removeprefix(GGUF_PREFIX) for k in meta
                           if k.startswith(GGUF_PREFIX) and k not in known))
    values = _checked(found, source)
    return ModelSampling(**values, source=source if values else "", ignored=ignored)  # type: ignore[arg-type]
