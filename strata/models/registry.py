"""The supported architectures, by name. Adding one: a module plus one line here."""

from __future__ import annotations

from strata.models import gemma3, llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, qwen3_next
from strata.models.architecture import Architecture

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        llama.ARCH,
        qwen2.ARCH,
        qwen3.ARCH,
        mixtral.ARCH,
        qwen2_moe.ARCH,
        qwen3_moe.ARCH,
        gemma3.ARCH,
        qwen3_next.ARCH,
    )
}


def supported() -> str:
    """The names, for error messages."""
    return ", ".join(sorted(ARCHITECTURES))


def by_gguf_name(name: str) -> Architecture | None:
    return ARCHITECTURES.get(name)


def by_hf_model_type(model_type: str) -> Architecture | None:
    for arch in ARCHITECTURES.values():
        if model_type in arch.hf_model_types:
            return arch
    return None
