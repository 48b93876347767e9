"""llama.cpp's `samplers` field (the sampler chain's order) checked against the order Strata computes.

llama-server builds each request's chain from `samplers`: a list of names
(`["top_k", "top_p", "min_p", "temperature"]`) or a string of their letters
(`"kpmt"`). A sampler left out is not applied; the order decides the result
where two samplers do not commute. Strata's sampler (strata/engine/sampling.py)
always applies penalties, then temperature, then top_k, top_p and min_p, so:

- a sampler left out of the list is switched off in the request (its field set
  to the value that changes nothing), as llama-server leaves it out; without
  `temperature` that is sampling at temperature 1, as there;
- the samplers Strata does not have (dry, typ_p, xtc, top_n_sigma) may be named:
  their own fields are refused unless neutral (`schemas_llama.UNSUPPORTED_NATIVE`),
  and a neutral one changes nothing wherever it stands;
- an order is accepted when it gives what Strata computes for this request's
  values, and refused with a 400 naming `samplers` otherwise: a sampler
  that changes nothing may stand anywhere, top_k and temperature commute, and
  greedy decoding (temperature 0) keeps the best token whatever filters run.
"""

from __future__ import annotations

import dataclasses

from strata.engine.sampling import has_penalties
from strata.engine.types import SamplingParams
from strata.serve.errors import ApiError

STRATA_ORDER = ("penalties", "temperature", "top_k", "top_p", "min_p")
NEUTRAL_HERE = ("dry", "typ_p", "xtc", "top_n_sigma")  # no sampler here; their fields must be neutral
LETTERS = {"e": "penalties", "d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma",
           "m": "min_p", "t": "temperature", "x": "xtc", "i": "infill", "a": "adaptive_p"}
ALIASES = {"nucleus": "top_p", "temp": "temperature", "typ": "typ_p", "typical": "typ_p", "typical_p": "typ_p"}
UNSUPPORTED = ("infill", "adaptive_p")  # samplers that change the answer and that Strata does not have


def _canonical(name: str) -> str | None:
    """llama.cpp's spelling rules: any case, `top-k`, `topk` and a few aliases."""
    low = name.lower().replace("-", "_")
    known = set(LETTERS.values())
    if low in known:
        return low
    if low in ALIASES:
        return ALIASES[low]
    squashed = {k.replace("_", ""): k for k in known}
    return squashed.get(low.replace("_", ""))


def parse_samplers(samplers: str | list[str]) -> list[str]:
    """The canonical names of a `samplers` value; a 400 for a name or letter llama.cpp has not."""
    if isinstance(samplers, str):
        unknown = [c for c in samplers if c not in LETTERS]
        if unknown:
            raise _refusal(f"unknown sampler letter {unknown[0]!r} (llama.cpp's: "
                           + ", ".join(f"{k}={v}" for k, v in LETTERS.items()) + ")")
        names = [LETTERS[c] for c in samplers]
    else:
        names = []
        for raw in samplers:
            name = _canonical(raw)
            if name is None:
                raise _refusal(f"unknown sampler {raw[:40]!r} (llama.cpp's: {', '.join(LETTERS.values())})")
            names.append(name)
    bad = [n for n in names if n in UNSUPPORTED]
    if bad:
        raise _refusal(f"the {bad[0]} sampler is not supported here")
    return names


def _active(params: SamplingParams) -> set[str]:
    """The samplers that change this request's tokens."""
    active = {"penalties"} if has_penalties(params) else set()
    if params.greedy or params.temperature != 1.0:
        active.add("temperature")  # greedy too: an argmax placed before the penalties ignores them
    if params.top_k > 0:
        active.add("top_k")
    if params.top_p < 1.0:
        active.add("top_p")
    if params.min_p > 0.0:
        active.add("min_p")
    return active


def _must_precede(params: SamplingParams, active: set[str]) -> list[tuple[str, str]]:
    """Pairs (a, b) of active samplers whose order Strata's result depends on: a goes first."""
    pairs = [("penalties", other) for other in STRATA_ORDER[1:] if other in active]
    if not params.greedy:  # sampled: the filters and a temperature other than 1 interact
        pairs += [("top_k", "top_p"), ("top_p", "min_p"), ("temperature", "top_p"), ("temperature", "min_p")]
    return [(a, b) for a, b in pairs if a in active and b in active]


def apply_samplers(params: SamplingParams, samplers: str | list[str] | None) -> SamplingParams:
    """`params` as the chain `samplers` names computes it (None: Strata's chain, unchanged);
    a 400 naming `samplers` when no order of Strata's gives that chain's result."""
    if samplers is None:
        return params
    names = parse_samplers(samplers)
    off = {"penalties": {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0},
           "temperature": {"temperature": 1.0}, "top_k": {"top_k": 0}, "top_p": {"top_p": 1.0},
           "min_p": {"min_p": 0.0}}
    left_out = {k: v for name, fields in off.items() if name not in names for k, v in fields.items()}
    params = dataclasses.replace(params, **left_out)
    active = _active(params)
    twice = [n for n in active if names.count(n) > 1]
    if twice:
        raise _refusal(f"{twice[0]} is named twice: Strata applies each sampler once")
    position = {n: names.index(n) for n in active}
    for first, then in _must_precede(params, active):
        if position[first] > position[then]:
            raise _refusal(f"{then} before {first} changes this request's result, and Strata applies "
                           f"{', '.join(STRATA_ORDER)} in that order (send e.g. {list(STRATA_ORDER)}, "
                           "or leave samplers out)")
    return params


def _refusal(message: str) -> ApiError:
    return ApiError(400, f"samplers: {message}", param="samplers", code="invalid_request")
