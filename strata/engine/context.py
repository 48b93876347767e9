"""The context a conversation may reach (--max-context), and the warning past the trained one.

Without -c (or with llama-server's -c 0) the context is the model's trained
one (`models/rope.py: trained_context`), capped so that the KV pool fits:
without --kv-pool-tokens every lane holds max-context cells from the start,
so a model trained for 131,072 tokens would otherwise ask for more memory
than most machines have. The cap is the memory each device has free once
the weights are loaded, less a headroom for activations and graphs; a
context given by the user is taken as it is. The choice and its reason
become part of the start-up summary.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from strata.engine.config import EngineConfig, pool_chunk_size
from strata.errors import BadRequest
from strata.memory import device_memory
from strata.models.blocks import weight_bytes
from strata.models.rope import is_scaled, trained_context

HEADROOM_BYTES = 1 << 30  # at least this much of a device stays free for activations and graphs
HEADROOM_SHARE = 0.10  # or this share of its total memory, if more
MIN_CONTEXT = 256  # a default context shorter than this is refused rather than chosen

log = logging.getLogger("strata.engine")


@dataclass(frozen=True)
class Room:
    """One device's share of the KV pool: the bytes it may give the pool, the bytes a cell of its
    layers takes."""

    device: str
    free_bytes: int
    bytes_per_cell: int


@dataclass(frozen=True)
class ContextChoice:
    """The context chosen, the model's trained one, and why they differ (None: they do not,
    or -c said so within the trained context)."""

    tokens: int
    trained: int
    reason: str | None = None

    def describe(self) -> str:
        """The start-up summary's part: "max context 8192 (trained 8192)"."""
        tail = f"; {self.reason}" if self.reason else ""
        return f"max context {self.tokens} (trained {self.trained}{tail})"


def headroom(total: int | None) -> int:
    """Bytes of a device of `total` bytes that no default pool takes."""
    return max(HEADROOM_BYTES, int((total or 0) * HEADROOM_SHARE))


def choose_context(config: EngineConfig, trained: int, rooms: Sequence[Room]) -> ContextChoice:
    """--max-context as given (a positive number), else the trained context, capped by
    --kv-pool-tokens or, without it, by what the rooms hold for lanes x context cells.

    A pure function of its arguments, so the sizing is tested without the memory it sizes
    (the engine has refused a negative --max-context before)."""
    if config.max_context > 0:
        past = config.max_context > trained
        return ContextChoice(config.max_context, trained,
                             "past the trained context: answers may degrade beyond it" if past else None)
    if config.kv_pool_tokens is not None:  # the pool is sized by its flag; a lane fits in it
        if config.kv_pool_tokens < trained:
            return ContextChoice(config.kv_pool_tokens, trained,
                                 f"capped by --kv-pool-tokens {config.kv_pool_tokens}")
        return ContextChoice(trained, trained)
    lanes = max(1, config.parallel)
    tight = min(rooms, key=lambda r: r.free_bytes // r.bytes_per_cell, default=None)
    if tight is None or tight.free_bytes // tight.bytes_per_cell >= lanes * trained:
        return ContextChoice(trained, trained)
    fits = max(0, tight.free_bytes) // tight.bytes_per_cell // lanes
    chunk = pool_chunk_size(dataclasses.replace(config, max_context=max(1, fits)))
    tokens = fits // chunk * chunk  # a lane's cells are whole chunks: no rounding up past the room
    why = (f"{tight.device} has {_size(tight.free_bytes)} for the KV pool, {lanes} lanes x "
           f"{tight.bytes_per_cell / 2**10:.1f} KiB a token")
    if tokens < min(MIN_CONTEXT, trained):
        raise BadRequest(f"no KV pool of a useful context fits: {why}; give --max-context N, "
                         f"--kv-pool-tokens N or fewer --parallel lanes", "max_context")
    return ContextChoice(tokens, trained, f"capped by memory: {why}")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{max(0, n) / 2**20:.0f} MiB"


def pool_rooms(model: torch.nn.Module, pool_layers: Sequence[int], cell_bytes: int, streamed: bool,
               weights: dict[str, int]) -> list[Room]:
    """The rooms of a model's pool layers now: each device holding some (a layer split's devices;
    a remote stage's layers are left to its worker), or the host alone for a streamed pool.

    A device's room is its free memory less the headroom; on the CPU less the weights there
    too, since a memory-mapped file's pages count as available RAM."""
    counts: dict[str, int] = {}
    for i in pool_layers:
        dev = model.layers[i].input_layernorm.weight.device
        if dev.type != "meta":
            key = "cpu" if streamed else str(dev)
            counts[key] = counts.get(key, 0) + 1
    rooms = []
    for dev, layers in counts.items():
        free, total = device_memory(torch.device(dev))
        if free is None:
            continue
        left = free - headroom(total) - (weights.get(dev, 0) if dev == "cpu" else 0)
        rooms.append(Room(dev, left, cell_bytes * layers))
    return rooms


class PastTrained:
    """One warning, the first time a conversation grows past the model's trained context (as
    llama-server warns of a context past the training one): only a -c above it allows that."""

    def __init__(self, trained: int, scaled: bool) -> None:
        self.trained = trained
        self.scaled = scaled
        self.warned = False

    def see(self, tokens: int, request_id: str) -> None:
        """A conversation of `tokens` tokens now (checked on every step: one comparison)."""
        if tokens <= self.trained or self.warned:
            return
        self.warned = True
        how = "with its rope scaling" if self.scaled else "without rope scaling"
        log.warning("request %s reached %d tokens, past the %d the model was trained for (%s): "
                         "answers may degrade from here; this is said once", request_id, tokens,
                         self.trained, how)


def resolve_context(config: EngineConfig, model: torch.nn.Module, cell_bytes: int) -> ContextChoice:
    """The context of an engine over loaded `model` whose cells take `cell_bytes` a layer: the
    rooms are measured only when the default needs them; a -c past the trained context is
    warned of once, here."""
    trained = trained_context(model.config)
    rooms: list[Room] = []
    if config.max_context == 0 and config.kv_pool_tokens is None:
        rooms = pool_rooms(model, model.pool_layers(), cell_bytes, config.kv_resident is not None,
                           weight_bytes(model))
    choice = choose_context(config, trained, rooms)
    if choice.tokens > trained:
        log.warning("--max-context %d is past the %d tokens the model was trained for%s: answers may "
                    "degrade beyond them", choice.tokens, trained,
                    "" if is_scaled(model.config) else " (it has no rope scaling)")
    return choice
