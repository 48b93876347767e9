"""Engine configuration and the command-line flags that fill it.

The CLI's `generate`, `chat`, `serve` and `bench` all take the same engine
flags; they are declared once here.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

import torch

import strata
from strata.engine.threads import parse_threads
from strata.errors import BadRequest
from strata.kv.expert_residency import POLICIES
from strata.kv.formats import FORMAT_NAMES
from strata.models.loader import resolve_device
from strata.models.quantize import WEIGHT_MODES
from strata.parallel.build import LocalSplit, RemoteSplit
from strata.parallel.plan import parse_devices

EXPERT_MISSES = ("copy", "mapped")  # --expert-misses


@dataclass
class EngineConfig:
    model: str | None = None  # .gguf file or Hugging Face folder; None = embedded default
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    weights: str = "auto"  # auto (int4/int8 on the CPU in bfloat16) | dense | int8 | int4
    parallel: int = 1  # lanes decoded together
    max_context: int = 0  # tokens one conversation may reach; 0 = the model's trained context,
    # capped by the memory the pool may take (engine/context.py); the engine's copy says the number
    kv_pool_tokens: int | None = None  # shared pool size in cells; None = lanes x max_context
    kv_chunk: int | None = None  # cells per pool chunk; None = chosen by pool_chunk_size()
    kv: str = "auto"  # cell format: auto (the compute dtype) | fp32 | fp16 | bf16 | int8 | q4_0 | k8v4
    kv_resident: int | None = None  # cells per layer kept on the device when streaming
    prefill_chunk: int = 512  # prompt tokens read per engine step and lane
    max_queued: int = 64  # requests waiting for a lane before QueueFull
    conversation_cache_mib: int = 0  # host RAM for parked conversations; 0 = off
    conversation_cache_slots: int = 8
    session_dir: str | None = None  # where session files may live; None = session files off
    threads: int | None = None  # CPU threads for torch and the C++ kernels; None (--threads auto):
    # the cores this process gets (engine/threads.py), fewer on the CPU while fewer run faster
    seed: int = 0  # base seed for sampling without a per-request seed
    prefix_reuse: bool = True  # reuse cached conversations' K/V (off: every prompt read from 0)
    pipeline: str = "auto"  # launch the next greedy decode step before post-processing this one:
    # auto (with CUDA-graph decode) | on | off
    prompt_graphs: bool = False  # on CUDA, a recurrent model's short one-lane prompt steps replay
    # CUDA graphs (engine/prompt_graphs.py); off until its GPU tests have run (docs/HYBRID.md)
    batch_invariant: str = "auto"  # CUDA products whose rows do not depend on the batch: on | off |
    # auto (on with --spec, whose drafted rows must round as the same tokens decoded alone; company
    # invariance among lanes costs 9-25% on the GPU, so it is asked for with `on`: docs/GPU.md)
    gpus: str | None = None  # layer split in this process over these devices: "0,1", "cpu,cpu"
    split: str | None = None  # layers per --gpus stage ("16,16"); None = by free memory
    remote_stage: str | None = None  # HOST:PORT of a worker (`strata stage`) running the later layers
    stage_key_file: str | None = None  # the key a main and its workers share
    split_at: int | None = None  # with --remote-stage: layers [0, L) stay in this process
    stage_timeout: float = 60.0  # seconds any link operation may take before the stage counts as lost
    prompt_cache: int = 0  # keep up to N conversations as checkpoints (with --remote-stage: the
    # worker keeps its part under ids); 0 = as --conversation-cache-* say
    ctx_checkpoints: int = 8  # a recurrent model's state checkpoints kept per conversation
    prompt_cache_min_step: int = 0  # and one every T prompt tokens read (0: only at cut points)
    experts_on: str = "device"  # a MoE model's routed experts: device (all resident) | host
    expert_cache: str | None = None  # device slots per layer with experts on the host: N | auto
    expert_policy: str = "lfru"  # which cached expert gives its slot up: lru | lfu | lfru
    expert_uploads: int | None = None  # experts copied into a layer's slots per step at most; the
    # misses past it are computed on the host (None: every miss is copied)
    expert_prefetch: bool = False  # each cached layer copies in the next one's predicted experts
    expert_misses: str = "copy"  # a cached step's missing experts: copy (in first) | mapped (read in place)
    chat_template: str | None = None  # Jinja text of --chat-template FILE; None = the model's own
    gpu_layers: int | None = None  # llama-server's -ngl: None or -1 = all; checked once loaded
    spec: int = 0  # drafted tokens a decoding lane may carry into a step (speculative.py); 0 = off
    spec_min_p: float = 0.0  # a draft stops before a token whose confidence is below this
    suffix_draft: bool = True  # the suffix proposer: drafts from the conversation and finished ones
    spec_model: str | None = None  # a small model with the same tokenizer drafting greedily
    mtp: bool = False  # the model's multi-token-prediction head drafts (engine/mtp.py); needs spec


DEFAULT_KV_CHUNK = 4096
MIN_AUTO_KV_CHUNK = 64  # a streamed pool's block: smaller chunks would split its blocks
CHUNKS_PER_LANE = 4


def batch_invariant_on(config: EngineConfig) -> bool:
    """--batch-invariant: auto is on with --spec, where a lane's own drafts share its steps and
    speculation promises the answer of the same tokens decoded one at a time. Among lanes it is
    a choice (`on`): measured on the GPU it costs a lone row its one-row kernels (about 18% of a
    one-lane step) and prompt reading a quarter of its speed (docs/GPU.md)."""
    if config.batch_invariant == "auto":
        return config.spec > 0
    return config.batch_invariant == "on"


def pool_chunk_size(config: EngineConfig) -> int:
    """Cells per pool chunk: --kv-chunk if given, else a size that lets every lane run.

    A chunk is reserved whole, so a shared pool of fewer chunks than lanes can
    never run all its lanes (--parallel 4 --kv-pool-tokens 8192 with 4096-cell
    chunks made two chunks: two lanes idle forever). Without --kv-chunk the
    chunk is the largest power of two from 4096 down to 64 cells (and at most
    --max-context) that gives each lane 4 chunks of the pool; failing that, the
    largest that gives each lane one; failing that, 64. Without
    --kv-pool-tokens every lane owns --max-context cells, so 4096 (or
    --max-context, if smaller) it is.
    """
    if config.max_context < 1:
        raise ValueError(f"pool_chunk_size needs a resolved --max-context, not {config.max_context}")
    if config.kv_chunk is not None:
        return min(config.kv_chunk, config.max_context)
    sizes = [c for c in (DEFAULT_KV_CHUNK >> i for i in range(7)) if c <= config.max_context]
    if not sizes:  # a context shorter than the smallest size: one chunk holds it
        return config.max_context
    if config.kv_pool_tokens is None:
        return sizes[0]
    lanes = max(1, config.parallel)
    for per_lane in (CHUNKS_PER_LANE, 1):
        for size in sizes:
            if config.kv_pool_tokens // size >= per_lane * lanes:
                return size
    return sizes[-1]


def cache_size(config: EngineConfig, bytes_per_cell: int, state_bytes: int = 0) -> tuple[int, int]:
    """(slots, bytes) of the conversation cache: --prompt-cache N gives N slots and, without
    --conversation-cache-mib, room for N whole contexts of `bytes_per_cell` (the layers this
    process keeps) and `state_bytes` (a recurrent model's saved states of one conversation);
    otherwise the --conversation-cache-* flags (0 bytes: no cache)."""
    mib = config.conversation_cache_mib
    if config.prompt_cache > 0:
        whole = config.max_context * bytes_per_cell + state_bytes
        budget = mib << 20 if mib > 0 else config.prompt_cache * whole
        return config.prompt_cache, budget
    return config.conversation_cache_slots, mib << 20


def describe_pool(lanes: int, chunks: int, chunk_cells: int, nbytes: int, kv: str, shared: bool) -> str:
    """The start-up line saying what the KV pool holds."""
    layout = "shared" if shared else "one range per lane"
    line = (f"KV pool: {lanes} lanes, {chunks} chunks of {chunk_cells} cells = {chunks * chunk_cells} "
            f"cells, {nbytes / 2**20:.1f} MiB ({kv}, {layout})")
    if chunks < lanes:
        line += f"; only {chunks} of {lanes} lanes can hold a conversation at once"
    return line


KV_CHOICES = ("auto", *FORMAT_NAMES)
# llama.cpp's -ctk/-ctv cache types Strata stores, and the (K, V) pairs a --kv format is.
# int8 keeps one scale per cell and head where ggml's q8_0 keeps one per 32 values; k8v4
# rotates V (Hadamard) before its q4_0 blocks (docs/KV_FORMATS.md).
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
CACHE_TYPE_PAIRS: dict[tuple[str, str], str] = {
    ("f32", "f32"): "fp32", ("f16", "f16"): "fp16", ("bf16", "bf16"): "bf16",
    ("q8_0", "q8_0"): "int8", ("q4_0", "q4_0"): "q4_0", ("q8_0", "q4_0"): "k8v4",
}
LLAMA_DEFAULT_CACHE_TYPE = "f16"  # what llama-server stores when -ctk or -ctv is left out


class EngineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that also checks the engine flags no single value can check alone
    (the -ctk/-ctv pair, -ngl beside --device), so those mistakes are usage errors too:
    one line, exit 2, before any model loads. Subcommands get it via parser_class."""

    def parse_known_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, rest = super().parse_known_args(args, namespace)
        try:
            engine_overrides(ns)
        except ValueError as e:
            self.error(str(e))
        return ns, rest


def kv_of_cache_types(kv: str, k: str | None, v: str | None) -> str:
    """The --kv format llama-server's -ctk/-ctv pair names (`kv` itself when neither is given);
    ValueError names what is wrong and what would be right."""
    if k is None and v is None:
        return kv
    pair = (k or LLAMA_DEFAULT_CACHE_TYPE, v or LLAMA_DEFAULT_CACHE_TYPE)
    fmt = CACHE_TYPE_PAIRS.get(pair)
    if fmt is None:
        pairs = ", ".join(f"{a}/{b} (--kv {f})" for (a, b), f in CACHE_TYPE_PAIRS.items())
        raise ValueError(f"-ctk {pair[0]} -ctv {pair[1]}: no Strata KV format stores that pair; "
                         f"the pairs that exist: {pairs}")
    if kv not in ("auto", fmt):
        raise ValueError(f"--kv {kv} contradicts -ctk {pair[0]} -ctv {pair[1]} (= --kv {fmt}); give one")
    return fmt


def device_of_gpu_layers(device: str, layers: int | None) -> str:
    """The --device llama-server's -ngl implies: 0 keeps every layer on the CPU, more asks for
    the GPU (`device` as given); ValueError when the two contradict."""
    if layers is None:
        return device
    if layers == 0:
        if device not in ("auto", "cpu"):
            raise ValueError(f"-ngl 0 keeps every layer on the CPU, but --device is {device}")
        return "cpu"
    if device == "cpu":
        raise ValueError(f"-ngl {layers} asks for layers on the GPU, but --device is cpu")
    return device


def mtp_flag_error(mtp: bool, spec: int, kv_resident: int | None, split: bool) -> str | None:
    """Why --mtp cannot go with the other flags, or None: its drafts need --spec, and its layer's
    K/V are neither streamed nor split."""
    if mtp and split:
        return "--mtp with a layer split (--gpus, --remote-stage) is not supported yet"
    if mtp and spec <= 0:
        return "--mtp drafts for speculative decoding: give --spec N (or auto) too"
    if mtp and kv_resident is not None:
        return "--mtp with --kv-resident is not supported yet: the MTP layer's K/V are not streamed"
    return None


def engine_overrides(ns: argparse.Namespace) -> dict[str, str]:
    """The EngineConfig values llama-server's spellings decide (--kv from -ctk/-ctv, --device from
    -ngl), computed from the parsed flags without changing them; ValueError for flags that
    contradict each other."""
    error = mtp_flag_error(getattr(ns, "mtp", False), getattr(ns, "spec", 0), getattr(ns, "kv_resident", None),
                           getattr(ns, "gpus", None) is not None or getattr(ns, "remote_stage", None) is not None)
    if error is not None:
        raise ValueError(error)
    return {"kv": kv_of_cache_types(getattr(ns, "kv", EngineConfig.kv), getattr(ns, "cache_type_k", None),
                                    getattr(ns, "cache_type_v", None)),
            "device": device_of_gpu_layers(getattr(ns, "device", EngineConfig.device),
                                           getattr(ns, "gpu_layers", None))}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare every engine flag on `parser` (defaults come from EngineConfig); llama-server's
    and vLLM's spellings are aliases (docs/SERVER.md, "Coming from llama-server or vLLM")."""
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", "-m", default=d.model,
                   help="a .gguf file or a Hugging Face model folder (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--device", type=device_arg, default=d.device, help="auto | cpu | cuda | cuda:N (default: auto)")
    g.add_argument("--n-gpu-layers", "-ngl", "--gpu-layers", dest="gpu_layers", type=gpu_layers_arg,
                   default=d.gpu_layers, metavar="N|all",
                   help="llama-server's spelling: 0 = --device cpu; all, -1 or at least the model's "
                        "layer count = every layer on the GPU (--device auto picks it); Strata keeps "
                        "a model whole on one device, so a part is refused (split: --gpus 0,cpu)")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (default: auto = bfloat16)")
    g.add_argument("--weights", default=d.weights, choices=list(WEIGHT_MODES),
                   help="weight storage: gguf (a GGUF file's quantized blocks kept as they are "
                        "and multiplied in place), dense (dequantized), int8 or int4 (weight-only "
                        "re-quantized, CPU); auto = gguf for a quantized GGUF file, else int8 on "
                        "the CPU in bfloat16, dense elsewhere")
    g.add_argument("--parallel", "-np", "--max-num-seqs", type=int, default=d.parallel,
                   help="lanes decoded together")
    g.add_argument("--max-context", "--ctx-size", "-c", "--max-model-len", type=context_arg,
                   default=d.max_context, metavar="N",
                   help="tokens one conversation may reach (default 0: the model's trained context, "
                        "capped so the KV pool fits the free memory; start-up says which)")
    g.add_argument("--kv-pool-tokens", type=int, default=d.kv_pool_tokens,
                   help="cells in one KV pool shared by all lanes (default: lanes x max-context)")
    g.add_argument("--kv-chunk", type=int, default=d.kv_chunk,
                   help="cells per pool chunk (default: 4096, smaller when --kv-pool-tokens would "
                        "otherwise give a lane fewer than 4 chunks; see pool_chunk_size)")
    g.add_argument("--kv", type=kv_arg, default=d.kv, metavar="{" + ",".join(KV_CHOICES) + "}",
                   help="KV cell format (default: auto = the compute dtype; docs/KV_FORMATS.md)")
    g.add_argument("--cache-type-k", "-ctk", dest="cache_type_k", default=None, choices=CACHE_TYPES,
                   help="llama-server's spelling of --kv, with -ctv: f16/f16 = fp16, bf16/bf16, "
                        "f32/f32 = fp32, q8_0/q8_0 = int8, q4_0/q4_0, q8_0/q4_0 = k8v4 (default f16)")
    g.add_argument("--cache-type-v", "-ctv", dest="cache_type_v", default=None, choices=CACHE_TYPES,
                   help="the V half of -ctk's pair")
    g.add_argument("--kv-resident", type=int, default=d.kv_resident,
                   help="stream K/V: keep this many cells per layer on the device, the rest in host RAM")
    g.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk,
                   help="prompt tokens read per step and lane")
    g.add_argument("--max-queued", type=int, default=d.max_queued,
                   help="requests that may wait for a lane")
    g.add_argument("--conversation-cache-mib", type=int, default=d.conversation_cache_mib,
                   help="host RAM (MiB) for parked conversations; 0 = off")
    g.add_argument("--conversation-cache-slots", type=int, default=d.conversation_cache_slots,
                   help="most parked conversations")
    g.add_argument("--session-dir", "--slot-save-path", default=d.session_dir, help="folder for session files")
    add_threads_argument(g)
    g.add_argument("--seed", "-s", type=int, default=d.seed, help="base seed for sampling")
    g.add_argument("--no-prefix-reuse", dest="prefix_reuse", action="store_false",
                   help="read every prompt from token 0 (no cached or parked K/V is reused)")
    g.add_argument("--pipeline", default=d.pipeline, choices=["auto", "on", "off"],
                   help="greedy decode: launch the next step before post-processing this one, so "
                        "the host's work overlaps the device's (auto: with CUDA-graph decode)")
    g.add_argument("--prompt-graphs", action="store_true", default=d.prompt_graphs,
                   help="on CUDA, replay a recurrent model's short one-lane prompt steps (a later "
                        "turn's message) from CUDA graphs (docs/HYBRID.md; not yet run on a GPU)")
    g.add_argument("--batch-invariant", default=d.batch_invariant, choices=["auto", "on", "off"],
                   help="on CUDA, compute every product so that a lane's output does not depend on "
                        "the other rows in its step (docs/GPU.md, 'Exactness on the GPU'); auto (the "
                        "default): on with --spec, so drafts never change the answer; on: also among "
                        "lanes, at a measured cost")
    t = parser.add_argument_group("chat template")
    t.add_argument("--chat-template", type=chat_template_arg, default=d.chat_template, metavar="FILE|NAME",
                   help="render chats with this Jinja template file (or inline template text, as "
                        "vLLM takes it, or one of llama-server's names: chatml, llama3, gemma, "
                        "mistral-v7, ...) instead of the model's own")
    t.add_argument("--chat-template-file", dest="chat_template", type=chat_template_arg, metavar="FILE",
                   help="llama-server's spelling of --chat-template FILE")
    t.add_argument("--jinja", action="store_true",
                   help="accepted for llama-server's sake: Strata always renders the model's Jinja template")
    r = parser.add_argument_group("recurrent layers (docs/HYBRID.md)")
    r.add_argument("--ctx-checkpoints", type=int, default=d.ctx_checkpoints, metavar="N",
                   help="a recurrent model's state checkpoints kept per conversation, so an edit or "
                        "a regenerate resumes from the nearest one instead of token 0 (0: none)")
    r.add_argument("--prompt-cache-min-step", type=int, default=d.prompt_cache_min_step, metavar="T",
                   help="also checkpoint every T prompt tokens read (0: only at the chat's cut points)")
    sp = parser.add_argument_group("speculative decoding (docs/SPECULATIVE.md)")
    sp.add_argument("--spec", type=spec_arg, default=d.spec, metavar="N|auto|off",
                    help="let a decoding lane carry up to N drafted tokens into a step, verified in "
                         f"the same forward (the answer does not change); auto = {AUTO_SPEC}; "
                         "default off")
    sp.add_argument("--spec-min-p", type=probability_arg, default=d.spec_min_p, metavar="P",
                    help="stop a draft before its first token whose confidence is below P (default 0)")
    sp.add_argument("--suffix-draft", type=int, choices=[0, 1], default=int(d.suffix_draft), metavar="0|1",
                    help="draft from where the conversation's last tokens occurred before, in it or in "
                         "finished conversations (default 1)")
    sp.add_argument("--spec-model", "--model-draft", "-md", dest="spec_model", default=d.spec_model,
                    metavar="FILE", help="a small model with the same tokenizer (.gguf or folder) that "
                                         "drafts greedily where the suffix proposer has nothing")
    sp.add_argument("--mtp", action="store_true", default=d.mtp,
                    help="draft with the model's multi-token-prediction head (Qwen3-Next folders that "
                         "carry mtp.* weights) where the suffix proposer has nothing; needs --spec")
    e = parser.add_argument_group("mixture of experts (docs/MOE.md)")
    e.add_argument("--experts-on", default=d.experts_on, choices=["device", "host"],
                   help="where a MoE model's routed experts live: device (all resident) or host "
                        "(pinned RAM, the hot ones cached on the device; implied by --expert-cache)")
    e.add_argument("--expert-cache", type=expert_cache_arg, default=d.expert_cache, metavar="N|auto",
                   help="experts of each layer kept in device slots, the rest in host RAM; auto: "
                        "as many as the free device memory holds after the KV pool")
    e.add_argument("--expert-policy", default=d.expert_policy, choices=list(POLICIES),
                   help="which cached expert gives its slot up (default: lfru; docs/MOE.md)")
    e.add_argument("--expert-uploads", type=count_arg, default=d.expert_uploads, metavar="N",
                   help="with --expert-cache: experts copied into a layer's slots per step at most; "
                        "the other misses (those with the fewest tokens) are computed on the host "
                        "meanwhile, with the host's kernels (default: every miss is copied); with "
                        "--expert-misses mapped: copies between steps a layer (default 2), the "
                        "misses read in place")
    e.add_argument("--expert-prefetch", action="store_true", default=d.expert_prefetch,
                   help="with --expert-cache: each layer predicts the next layer's experts (its "
                        "router on this layer's input) and copies them in while it computes "
                        "(default: off until measured; docs/MOE.md)")
    e.add_argument("--expert-misses", default=d.expert_misses, choices=list(EXPERT_MISSES),
                   help="with --expert-cache on a GPU: copy (a step reads its routing on the host and "
                        "copies its missing experts in first) or mapped (a step reads them in place "
                        "from pinned host memory over the bus, decides nothing on the host and keeps "
                        "CUDA graphs; the most used misses are copied in between steps, "
                        "--expert-uploads a layer and step, default 2; docs/MOE.md)")
    s = parser.add_argument_group("layer split (docs/STAGES.md)")
    s.add_argument("--gpus", type=gpus_arg, default=d.gpus,
                   help="split the model's layers over these devices in this process: GPU numbers "
                        "(0,1), cuda:N, or cpu (cpu,cpu runs the same code without a GPU)")
    s.add_argument("--split", default=d.split,
                   help="layers per --gpus stage, e.g. 16,16 (default: by each device's free memory)")
    add_stage_link_arguments(s, d)
    s.add_argument("--remote-stage", default=d.remote_stage, metavar="HOST:PORT",
                   help="run the layers from --split-at on in a worker (`strata stage`) at HOST:PORT")
    s.add_argument("--split-at", type=int, default=d.split_at, metavar="L",
                   help="with --remote-stage: layers [0, L) and the head stay in this process")
    s.add_argument("--prompt-cache", type=int, default=d.prompt_cache, metavar="N",
                   help="keep up to N conversations between turns (sets --conversation-cache-slots; "
                        "with --remote-stage each worker keeps its layers' part under an id, so only "
                        "ids cross the link)")


def add_threads_argument(g: argparse._ArgumentGroup, governed: bool = True) -> None:
    """--threads; `strata stage` takes it too, without the governor."""
    fewer = ", and on a CPU device runs fewer while fewer decode faster (other processes on the cores)"
    g.add_argument("--threads", "-t", type=threads_arg, default=None, metavar="auto|N",
                   help="CPU threads for torch and the C++ kernels: N forces N; auto (default) takes "
                        "the CPUs of the affinity mask, at most the cgroup's CPU quota"
                        + (fewer if governed else ""))


AUTO_SPEC = 8  # --spec auto: the draft length measured best on the CPU (docs/PERFORMANCE.md)


def spec_arg(text: str) -> int:
    """--spec: a count of drafts, auto, or off (0)."""
    if text == "auto":
        return AUTO_SPEC
    if text == "off":
        return 0
    if text.isdigit() and int(text) <= 64:
        return int(text)
    raise argparse.ArgumentTypeError(f"choose from auto, off or a count of 0..64, not {text!r}")


def probability_arg(text: str) -> float:
    """A number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a number from 0 to 1, not {text!r}")
    return value


def kv_arg(text: str) -> str:
    """--kv: one of KV_CHOICES; llama.cpp's names for a format get a pointer to it."""
    if text in KV_CHOICES:
        return text
    same = {(k, v): f for (k, v), f in CACHE_TYPE_PAIRS.items() if k == v}
    hint = same.get((text, text))
    hint_text = f" (llama.cpp's {text} cache is --kv {hint}, or -ctk {text} -ctv {text})" if hint else ""
    raise argparse.ArgumentTypeError(f"choose from {', '.join(KV_CHOICES)}, not {text!r}{hint_text}")


def context_arg(text: str) -> int:
    """--max-context: 0 (the model's trained context, as llama-server's -c 0) or a token count."""
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"choose 0 (the model's trained context) or a number of tokens, "
                                     f"not {text!r}")


def device_arg(text: str) -> str:
    """--device: auto, cpu, cuda or cuda:N, spelled right before the model loads (whether the
    GPU exists is the loader's question)."""
    try:
        ok = text == "auto" or torch.device(text).type in ("cpu", "cuda")
    except RuntimeError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"choose from auto, cpu, cuda, cuda:N, not {text!r}")
    return text


def gpu_layers_arg(text: str) -> int:
    """-ngl: all, auto or -1 (every layer, as -1), or a count of layers."""
    if text in ("all", "auto", "-1"):
        return -1
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"choose from all, -1 or a number of layers, not {text!r}")


def check_gpu_layers(config: EngineConfig, num_layers: int) -> None:
    """-ngl N below the model's layer count asks for part of it on the GPU, which Strata has no
    way to do on one device: refused rather than silently putting all of it there."""
    n = config.gpu_layers
    if n is not None and 0 < n < num_layers:
        raise BadRequest(f"-ngl {n}: the model has {num_layers} layers and Strata keeps them on one "
                         f"device (-ngl all, or -ngl 0 for the CPU; a split: --gpus 0,cpu --split)",
                         "gpu_layers")


def chat_template_arg(text: str) -> str:
    """--chat-template FILE|NAME (or vLLM's inline Jinja text): the template's text, compiled
    before the model loads. A name is one of llama-server's (`tokenizer/named_templates.py`)
    where no file of that name exists."""
    from strata.tokenizer.chat_template import compile_template
    from strata.tokenizer.named_templates import NAMED, named_template

    inline = "{{" in text or "{%" in text
    named = None if inline or os.path.exists(text) else named_template(text)
    if named is not None:
        return named
    if not inline:
        try:
            with open(text, encoding="utf-8") as f:
                source = f.read()
        except OSError as e:
            raise argparse.ArgumentTypeError(
                f"cannot read {text!r} ({e.strerror}); give a Jinja template file, the template "
                f"text itself, or one of the names {', '.join(sorted(NAMED))}; without the flag "
                "the model's own template is used") from None
        except UnicodeDecodeError:
            raise argparse.ArgumentTypeError(f"{text!r} is not UTF-8 text") from None
    try:
        compile_template(text if inline else source)
    except BadRequest as e:
        raise argparse.ArgumentTypeError(f"{'the template' if inline else repr(text)}: {e}") from None
    return text if inline else source


def gpus_arg(text: str) -> str:
    """--gpus: every device named must exist, checked before the model loads."""
    try:
        parse_devices(text)
    except BadRequest as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--gpus: ")) from None
    return text


def version_text() -> str:
    return f"strata {strata.__version__}"


def count_arg(text: str) -> int:
    """A count of 0 or more."""
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"must be a count (0 or more), not {text!r}")


def expert_cache_arg(text: str) -> str:
    """--expert-cache: auto or a positive count."""
    if text == "auto" or (text.isdigit() and int(text) > 0):
        return text
    raise argparse.ArgumentTypeError(f"must be auto or a positive number of slots, not {text!r}")


def expert_slots(config: EngineConfig) -> str | None:
    """The expert cache asked for: None (experts on the device), "auto" or a count as text;
    checked before the model loads (a config built in code skips argparse)."""
    if config.experts_on not in ("device", "host"):
        raise BadRequest(f"--experts-on must be device or host, not {config.experts_on!r}", "experts_on")
    if config.expert_policy not in POLICIES:
        raise BadRequest(f"--expert-policy must be one of {', '.join(POLICIES)}, not {config.expert_policy!r}",
                         "expert_policy")
    if config.expert_uploads is not None and config.expert_uploads < 0:
        raise BadRequest(f"--expert-uploads must be 0 or more, not {config.expert_uploads}", "expert_uploads")
    if config.expert_misses not in EXPERT_MISSES:
        raise BadRequest(f"--expert-misses must be one of {', '.join(EXPERT_MISSES)}, not {config.expert_misses!r}",
                         "expert_misses")
    if config.expert_misses == "mapped" and config.expert_prefetch:
        raise BadRequest("--expert-misses mapped copies between steps from the routing it logs; it does "
                         "not take --expert-prefetch", "expert_misses")
    if config.expert_cache is not None:
        try:
            slots = expert_cache_arg(str(config.expert_cache))
        except argparse.ArgumentTypeError as e:
            raise BadRequest(f"--expert-cache {e}", "expert_cache") from None
        return _mapped_on_a_gpu(config, slots)
    if config.experts_on != "host" and config.expert_uploads is not None:
        raise BadRequest("--expert-uploads caps an expert cache's copies: give --expert-cache too",
                         "expert_uploads")
    if config.experts_on != "host" and config.expert_misses != "copy":
        raise BadRequest("--expert-misses says how an expert cache reads its misses: give --expert-cache too",
                         "expert_misses")
    if config.experts_on != "host" and config.expert_prefetch:
        raise BadRequest("--expert-prefetch fills an expert cache's slots: give --expert-cache too",
                         "expert_prefetch")
    return _mapped_on_a_gpu(config, "auto") if config.experts_on == "host" else None


def _mapped_on_a_gpu(config: EngineConfig, slots: str) -> str:
    """`slots`, once `--expert-misses mapped` is known to have a GPU to read host memory from."""
    if config.expert_misses == "mapped" and resolve_device(config.device, str(config.model)).type != "cuda":
        raise BadRequest(f"--expert-misses mapped reads host memory from a GPU; the device is {config.device}",
                         "expert_misses")
    return slots


def threads_arg(text: str) -> int | None:
    try:
        return parse_threads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_stage_link_arguments(g: argparse._ArgumentGroup, d: EngineConfig) -> None:
    """The link flags a main and a worker (`strata stage`) share."""
    g.add_argument("--stage-key-file", default=d.stage_key_file, metavar="FILE",
                   help="a file holding the key (16 bytes or more) a main and its workers share")
    g.add_argument("--stage-timeout", type=float, default=d.stage_timeout, metavar="SECONDS",
                   help="longest a link operation may take before the stage counts as lost (default: 60)")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig named by parsed flags (flags not declared keep their defaults)."""
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    return EngineConfig(**{**values, **engine_overrides(args)})


def split_of(config: EngineConfig) -> LocalSplit | RemoteSplit | None:
    """The split the engine flags ask for (checked before the model loads), or None."""
    if config.gpus is not None and config.remote_stage is not None:
        raise BadRequest("--gpus and --remote-stage cannot be combined yet", "gpus")
    if config.gpus is not None:
        return LocalSplit(config.gpus, config.split)
    if config.remote_stage is not None:
        return RemoteSplit(config.remote_stage, config.stage_key_file, config.split_at,
                           config.stage_timeout, resolve_device(config.device, str(config.model)),
                           config.prompt_cache)
    if config.split is not None or config.split_at is not None:
        raise BadRequest("--split goes with --gpus, --split-at with --remote-stage", "split")
    return None
