"""`load_model`: a GGUF file or a Hugging Face folder in, a ready `DecoderModel` out.

The module is built on the meta device and each parameter is assigned the
tensor read from the file (memory-mapped, or dequantized on the target
device), so weights exist once, never as a random init plus a copy. Names,
shapes and types are all checked before the first tensor is read, so a bad
file fails fast with one ModelLoadError line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from strata.default_model import default_model_path
from strata.errors import ModelLoadError
from strata.models.architecture import Architecture
from strata.models.base import ModelConfig
from strata.models.block_install import blocks_fit, ffn_types, install_blocks
from strata.models.config import config_from_gguf, config_from_hf, gguf_architecture
from strata.models.generation_defaults import (
    ModelSampling,
    from_gguf_metadata,
    read_generation_config,
)
from strata.models.huge_pages import move_blocks_to_huge_pages
from strata.models.layers import DecoderModel
from strata.models.mtp import stored_mtp_layers
from strata.models.naming import Part, gguf_parts, hf_parts
from strata.models.quantize import quantize_weights, resolve_weight_mode
from strata.models.rope import trained_context
from strata.models.sources import GGUFSource, SafetensorsSource, WeightSource
from strata.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_DTYPE = torch.bfloat16  # batch-invariant matmul on the CPU: see docs/ARCHITECTURE.md

PartsOf = Callable[[str, int], list[Part]]
Opened = tuple[WeightSource, Architecture, ModelConfig, PartsOf, Callable[[], Tokenizer | None]]


@dataclass(frozen=True)
class Placement:
    """Where each part of the model is read to: a layer split's stages.

    `layers[i]` is layer i's device, `ends` the embedding's, final norm's and
    output head's; None leaves that part on the meta device, unread (a remote
    stage's worker reads only its own layers).
    """

    layers: tuple[torch.device | None, ...]
    ends: torch.device | None
    experts: torch.device | None = None  # where routed experts are read (host: an expert cache)

    def device_of(self, param_name: str) -> torch.device | None:
        if param_name.startswith("layers."):
            layer = self.layers[int(param_name.split(".")[1])]
            if layer is not None and self.experts is not None and ".mlp.experts." in param_name:
                return self.experts
            return layer
        return self.ends

    def main_device(self) -> torch.device:
        """The device that holds the ends, or else the first layer read here."""
        if self.ends is not None:
            return self.ends
        return next(d for d in self.layers if d is not None)


@dataclass
class LoadedModel:
    model: DecoderModel
    config: ModelConfig
    tokenizer: Tokenizer | None  # None when the file or folder carries no tokenizer
    identity: str  # sha256 of tensor names, shapes and types: ties session files to weights
    name: str  # file stem or folder name, as shown to API clients
    path: str
    device: torch.device
    dtype: torch.dtype
    weights: str = "dense"  # dense | gguf | int8 | int4
    file_bytes: int = 0  # the stored tensors' bytes (the whole file's, every stage's layers)
    sampling: ModelSampling = field(default_factory=ModelSampling)  # what the files recommend


def resolve_device(device: str | torch.device, path: str) -> torch.device:
    """ "auto" picks CUDA when present; asking for CUDA without it is a load error."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(path, f"device {device} was asked for but CUDA is not available")
    return dev


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return DEFAULT_DTYPE
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    path: str | None = None,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    progress: bool = True,
    weights: str = "dense",
    place: Callable[[ModelConfig], Placement] | None = None,
    experts_on_host: bool = False,
) -> LoadedModel:
    """Load a `.gguf` file or an HF folder (config.json + safetensors); None: the embedded default.

    The tokenizer comes from the GGUF metadata or the folder's tokenizer.json;
    a file without one (a random-weight benchmark file) gives tokenizer None,
    while a broken one is a ModelLoadError like any other bad input.
    `weights`: dense (exact dequantized weights), gguf (a GGUF file's blocks kept and multiplied
    in place, `blocks.py`), int8 / int4 (weight-only, see quantize.py) or auto (gguf for a
    quantized GGUF file where the device's block kernels take it; int8 / int4 on the CPU in
    bfloat16 otherwise). `place`: where each layer goes, for a layer
    split (None: everything on `device`), asked for once the model's configuration is read; its
    `layers` must have one entry per layer. `experts_on_host`: a MoE model's routed experts are
    read to host memory (for `--expert-cache`), everything else to its device.
    """
    path = str(default_model_path()) if path is None else str(path)
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(path, "no such file or folder")
    dev = resolve_device(device, path)
    dt = resolve_dtype(dtype)
    if p.is_dir():
        source, arch, cfg, parts_of, make_tokenizer = _open_folder(p)
    else:
        source, arch, cfg, parts_of, make_tokenizer = _open_gguf(p)
    tokenizer = make_tokenizer()  # before the weights: a bad tokenizer fails fast too
    placement = place(cfg) if place is not None else None
    if placement is not None:
        if len(placement.layers) != cfg.num_layers:
            raise ModelLoadError(path, f"a split of {len(placement.layers)} layers for a model of "
                                       f"{cfg.num_layers}")
        dev = placement.main_device()
    with torch.device("meta"):
        model = arch.model_class(cfg)
    placement = placement or Placement((dev,) * cfg.num_layers, dev)
    if experts_on_host:  # an expert cache's host side: `experts.install_expert_cache` after the load
        placement = dataclasses.replace(placement, experts=torch.device("cpu"))
    mode = resolve_weight_mode(weights, dev, dt, four_bit_source=_four_bit(source),
                               block_source=isinstance(source, GGUFSource) and blocks_fit(source, dev))
    if mode == "gguf":
        if not isinstance(source, GGUFSource):
            raise ModelLoadError(path, "--weights gguf keeps a GGUF file's blocks: this is not a GGUF file")
        install_blocks(model, source, parts_of, placement, dt)
    _fill(model, source, parts_of, path, placement, dt, progress)
    model.requires_grad_(False).eval()
    model.set_max_positions(trained_context(cfg))  # a yarn or dynamic model's stretched length
    identity = source.identity()
    if mode in ("int8", "int4"):
        quantize_weights(model, mode, dt)
    if mode == "gguf" and not experts_on_host and all(d.type == "cpu" for d in placement.layers):
        move_blocks_to_huge_pages(model)  # streamed faster than the file's 4 KiB pages
    if mode != "dense":
        identity += f"+{mode}"  # K/V computed with other weights: session files must not mix them
    return LoadedModel(
        model=model,
        config=cfg,
        tokenizer=tokenizer,
        identity=identity,
        name=p.name if p.is_dir() else p.stem,
        path=path,
        device=dev,
        dtype=dt,
        weights=mode,
        file_bytes=source.tensor_bytes(),
        sampling=read_generation_config(p) if p.is_dir() else _gguf_sampling(source),
    )


def _gguf_sampling(source: WeightSource) -> ModelSampling:
    return from_gguf_metadata(source.file.metadata) if isinstance(source, GGUFSource) else ModelSampling()


FOUR_BIT = {"Q4_0", "Q4_1", "Q4_K"}


def _four_bit(source: WeightSource) -> bool:
    """Whether most of a GGUF file's feed-forward weights are stored with 4 bits."""
    if not isinstance(source, GGUFSource):
        return False
    kinds = ffn_types(source)
    return bool(kinds) and sum(k.name in FOUR_BIT for k in kinds) * 2 > len(kinds)


def _open_folder(p: Path) -> Opened:
    path = str(p)
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(
            path, "folder has no config.json (a model folder needs config.json and *.safetensors)"
        )
    try:
        raw = json.loads(cfg_file.read_text())
    except (ValueError, OSError) as e:
        raise ModelLoadError(str(cfg_file), f"not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(str(cfg_file), "not a JSON object")
    arch, cfg = config_from_hf(path, raw)
    cfg.eos_token_ids = list(dict.fromkeys(cfg.eos_token_ids + _generation_eos(p)))
    source = SafetensorsSource(p)
    if arch.mtp:  # a multi-token-prediction head, where the weights carry one
        cfg.mtp_layers = stored_mtp_layers(raw, source.names())

    def tokenizer() -> Tokenizer | None:
        return Tokenizer.from_folder(p) if (p / "tokenizer.json").is_file() else None

    return source, arch, cfg, lambda name, rows: hf_parts(name, rows, cfg, arch), tokenizer


def _generation_eos(p: Path) -> list[int]:
    """generation_config.json often lists end-of-turn ids that config.json lacks."""
    f = p / "generation_config.json"
    try:
        eos = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
    except (ValueError, OSError, AttributeError):
        return []
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


def _open_gguf(p: Path) -> Opened:
    path = str(p)
    source = GGUFSource(path)
    meta = source.file.metadata
    gguf_architecture(path, meta)  # an unsupported architecture fails before any tensor is read
    factors = None
    if "rope_freqs.weight" in source.names():
        source.check("rope_freqs.weight")
        factors = source.load("rope_freqs.weight", torch.device("cpu"), torch.float32).tolist()
    arch, cfg = config_from_gguf(path, meta, source.names(), factors)
    if factors is not None and len(factors) != cfg.head_dim // 2:
        raise ModelLoadError(
            path,
            f"tensor rope_freqs.weight has {len(factors)} entries, expected {cfg.head_dim // 2}",
        )

    def tokenizer() -> Tokenizer | None:
        if "tokenizer.ggml.tokens" not in meta:
            return None
        return Tokenizer.from_gguf_metadata(meta, path)

    stored = source.names()
    return source, arch, cfg, lambda name, rows: gguf_parts(name, rows, cfg, arch, stored), tokenizer


def _fill(
    model: DecoderModel,
    source: WeightSource,
    parts_of: PartsOf,
    path: str,
    placement: Placement,
    dtype: torch.dtype,
    progress: bool,
) -> None:
    """Check every needed tensor, then read them one by one into the meta-built model."""
    available = source.names()
    plan: dict[str, list[Part]] = {}
    state: dict[str, torch.Tensor] = {}
    for pname, param in model.named_parameters():
        if placement.device_of(pname) is None:
            state[pname] = param  # stays on the meta device: another stage holds it
            continue
        parts = parts_of(pname, param.shape[0])
        for part in parts:
            if part.name not in available:
                raise ModelLoadError(path, f"missing tensor {part.name}")
            want = (part.rows, *param.shape[1:])
            got = tuple(source.shape(part.name))
            if got != want and not (part.reshape and math.prod(got) == math.prod(want)):
                raise ModelLoadError(
                    path, f"tensor {part.name} has shape {list(got)}, the config needs {list(want)}"
                )
            source.check(part.name)
        plan[pname] = parts
    bar = tqdm(
        plan.items(),
        desc=f"loading {Path(path).name}",
        unit="tensor",
        file=sys.stderr,
        disable=not progress or not sys.stderr.isatty(),  # a log file gets the log's lines instead
        leave=False,
    )
    for pname, parts in bar:
        pieces = []
        device = placement.device_of(pname)
        assert device is not None
        for part in parts:
            t = source.load(part.name, device, torch.float32 if part.exact else dtype)
            if part.reshape:
                t = t.reshape(part.rows, *model.get_parameter(pname).shape[1:])
            t = part.fix(t) if part.fix is not None else t
            pieces.append(t.to(dtype) if part.exact else t)
        joined = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        for part in parts:
            joined = part.join(joined) if part.join is not None else joined
        state[pname] = joined
    kept = set(model.state_dict())  # persistent buffers: the blocks `install_blocks` read already
    state.update((n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in kept)
    model.load_state_dict(state, strict=True, assign=True)
