"""The engine: a library API over one loop of schedule, run, post-process.

`Engine.generate` queues a request and returns a handle at once; the loop
thread admits requests to lanes, runs one batched forward per step for all
busy lanes, samples, detokenizes and publishes events to the handles.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
from collections import deque
from concurrent.futures import Future
from functools import partial
from typing import Any, Callable

import torch

from strata.engine.checkpoints import Checkpoints
from strata.engine.config import (
    EngineConfig,
    batch_invariant_on,
    cache_size,
    check_gpu_layers,
    describe_pool,
    expert_slots,
    mtp_flag_error,
    pool_chunk_size,
    split_of,
)
from strata.engine.context import PastTrained, resolve_context
from strata.engine.controls import banned_ids, biased, controls_error
from strata.engine.conversation_cache import ConversationCache
from strata.engine.draft_model import DraftModelProposer, check_same_vocabulary
from strata.engine.grammar import Grammars
from strata.engine.masks import GrammarMasks
from strata.engine.mtp import MtpProposer, mtp_pool_layers
from strata.engine.parking import Parking
from strata.engine.pipeline import Launched, continuation, plain_greedy
from strata.engine.request import Request, RequestHandle
from strata.engine.runner import Runner, graphs_factory
from strata.engine.sampling import has_penalties, make_generator, sample
from strata.engine.scheduler import Lane, Scheduler, Step
from strata.engine.sessions import SessionFiles, SessionResult
from strata.engine.speculative import STEP_ROWS, Proposer, SpecConfig, Speculator, SuffixProposer
from strata.engine.stats import describe_memory, memory_figures, pool_and_lane_figures
from strata.engine.stop import StopMatcher
from strata.engine.suffix import SharedCorpus
from strata.engine.threads import CpuThreads, find_cores, release_openmp_pool
from strata.engine.types import FinishReason, PromptProgress, SamplingParams, StreamEvent
from strata.errors import (
    BadRequest,
    ContextTooLong,
    LaneBusy,
    ModelLoadError,
    QueueFull,
    StageUnavailable,
    StrataError,
)
from strata.knobs import knob_values
from strata.kv.formats import make_format
from strata.kv.state import StatePool
from strata.kv.tables import TablePool
from strata.memory import device_memory
from strata.models import load_model
from strata.models.blocks import weight_bytes
from strata.models.expert_refill import ExpertRefill
from strata.models.experts import (
    CacheStats,
    auto_slots,
    describe_cache,
    expert_bytes,
    install_expert_cache,
)
from strata.models.moe import graph_safe
from strata.models.rope import is_scaled
from strata.parallel.build import PoolShape, part_on
from strata.parallel.split_pool import SplitPool
from strata.tokenizer import IncrementalDetokenizer
from strata.uploads import upload

log = logging.getLogger("strata.engine")
EXPERT_RESERVE = 2 << 30  # device bytes --expert-cache auto leaves for activations and graphs

_KV_AUTO = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def first_logit_rows(sample: list[int]) -> list[int]:
    """Each step sequence's first row in the step's logits (sequences sample `sample[i]` rows)."""
    rows, r = [], 0
    for wanted in sample:
        rows.append(r)
        r += int(wanted)
    return rows


class Engine:
    def __init__(self, config: EngineConfig, loaded: Any = None, spec_model: Any = None) -> None:
        """Start the loop thread; it loads the model (unless given one) and builds the pool.
        `spec_model`: the loaded --spec-model (else it is loaded from config.spec_model).

        All torch work happens on that one thread: on the CPU, a second thread
        running torch ops keeps its own OpenMP team, and two teams on two cores
        made decoding three times slower (measured).
        """
        self.config = config
        self.spec_model = spec_model
        if config.parallel < 1:
            raise BadRequest(f"--parallel must be at least 1, got {config.parallel}", "parallel")
        if config.ctx_checkpoints < 0 or config.prompt_cache_min_step < 0:
            raise BadRequest("--ctx-checkpoints and --prompt-cache-min-step must be at least 0",
                             "ctx_checkpoints")
        if config.max_context < 0:
            raise BadRequest(f"--max-context must be 0 (the model's trained context) or a number of "
                             f"tokens, not {config.max_context}", "max_context")
        if config.threads is not None and config.threads < 1:
            raise BadRequest(f"--threads must be at least 1, got {config.threads}", "threads")
        mtp_error = mtp_flag_error(config.mtp, config.spec, config.kv_resident,
                                   config.gpus is not None or config.remote_stage is not None)
        if mtp_error is not None:
            raise BadRequest(mtp_error, "mtp")
        self._inbox: deque[Request] = deque()
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._requests = 0
        self.steps = 0
        self.pipelined_steps = 0  # steps launched before the previous one was post-processed
        self.step_errors = 0
        ready: Future = Future()
        self._thread = threading.Thread(target=self._main, args=(loaded, ready),
                                        name="strata-engine", daemon=True)
        self._thread.start()
        ready.result()  # re-raises a load error here, in the caller's thread
        release_openmp_pool()  # the caller's idle OpenMP workers would slow the engine's (threads.py)

    def _main(self, loaded: Any, ready: Future) -> None:
        try:
            self._setup(loaded)
        except BaseException as e:  # noqa: BLE001 - handed to the constructor's caller
            ready.set_exception(e)
            return
        ready.set_result(None)
        self._loop()

    def _setup(self, loaded: Any) -> None:
        config = self.config
        self.expert_stats: CacheStats | None = None  # --expert-cache's counters
        self.expert_refill: ExpertRefill | None = None  # --expert-misses mapped: between steps
        self.cpu_threads = CpuThreads(find_cores(), config.threads, torch.set_num_threads)
        split = split_of(config)
        if split is not None and loaded is not None:
            raise BadRequest("a layer split loads the model itself: pass no loaded model", "gpus")
        slots = expert_slots(config)
        if slots is not None and split is not None:
            raise BadRequest("--expert-cache / --experts-on host with a layer split is not supported yet",
                             "expert_cache")
        self.loaded = loaded or load_model(config.model, config.device, config.dtype,
                                           weights=config.weights,
                                           place=split.place if split is not None else None,
                                           experts_on_host=slots is not None)
        if self.loaded.tokenizer is None:
            raise ModelLoadError(self.loaded.path, "the model carries no tokenizer")
        self.model_config = self.loaded.config
        check_gpu_layers(config, self.model_config.num_layers)
        # before graphs are captured and a remote stage is greeted (it follows the main)
        self.batch_invariant = batch_invariant_on(config)
        self.loaded.model.set_batch_invariant(self.batch_invariant)
        self.tokenizer = self.loaded.tokenizer
        if config.chat_template is not None:  # a copy: a loaded model passed in may be shared
            self.tokenizer = copy.copy(self.tokenizer)
            self.tokenizer.use_chat_template(config.chat_template)
        self.model_name = self.loaded.name
        mc = self.model_config
        self.device = next(self.loaded.model.parameters()).device
        self.dtype = next(self.loaded.model.parameters()).dtype
        kv_name = _KV_AUTO[self.dtype] if config.kv == "auto" else config.kv
        fmt = make_format(kv_name, mc.num_kv_heads, mc.head_dim)
        # -c 0 (the default): the trained context, capped by memory; the engine's config says the number
        self.context = resolve_context(config, self.loaded.model, fmt.cell_bytes())
        self.config = config = dataclasses.replace(config, max_context=self.context.tokens)
        self.past_trained = PastTrained(self.context.trained, is_scaled(mc))
        if self.loaded.model.max_positions < config.max_context:
            self.loaded.model.set_max_positions(config.max_context)
        chunk = pool_chunk_size(config)
        shape = PoolShape(fmt, config.parallel, config.max_context, chunk, config.kv_pool_tokens,
                          config.kv_resident)
        self.pool: TablePool
        state_shapes = self.loaded.model.state_layers()
        self.states: StatePool | None = None  # a recurrent model's per-lane state (kv/state.py)
        if mc.sliding_layers and split is not None:
            raise BadRequest(f"{self.model_name} has sliding-window layers: a layer split of it is not "
                             "supported yet", "gpus")
        if state_shapes and split is not None:
            raise BadRequest(f"{self.model_name} has recurrent layers: a layer split of it is not "
                             "supported yet", "gpus")
        if split is not None:  # one pool over the stages' parts, one runner through them
            self.pool, self.runner = split.build(self.loaded.model, self.loaded.identity, shape,
                                                 mc.attn_scale, graphs_factory())
            for i, st in enumerate(self.runner.describe_stages()):
                log.info("stage %d: layers %d-%d on %s, KV %.1f MiB", i, st["layers"][0], st["layers"][1] - 1,
                         st.get("device") or st.get("address"), st.get("kv_bytes", 0) / 2**20)
        else:  # K/V in (pinned) host RAM with --kv-resident, N cells per layer on the device
            pool_layers = self.loaded.model.pool_layers()  # not the layers with fixed-size state
            if config.mtp:  # the MTP head's layer keeps its K/V beside the model's
                pool_layers += mtp_pool_layers(self.loaded.model, self.model_name)
            self.pool = part_on(shape, pool_layers, self.device, None)
            if slots is not None:  # the experts take what the pool leaves
                self._cache_experts(slots)
            if state_shapes:
                self.states = StatePool(state_shapes, config.parallel, self.device,
                                        self.loaded.model.state_dtypes(),
                                        trash=self.device.type == "cuda")  # graphs pad with it
            self.runner = Runner(self.loaded.model, self.pool, mc.attn_scale, self.device,
                                 graphs=graph_safe(self.loaded.model), states=self.states,
                                 windowed=any(mc.window(i) is not None for i in pool_layers),
                                 rows_per_lane=1 + max(config.spec, 0), keep_hidden=config.mtp,
                                 hooks=self.expert_refill, prompt_graphs=config.prompt_graphs)
            if self.device.type == "cpu":  # a step's time is its threads' work: the governor can judge
                self.cpu_threads.govern()
        if config.prompt_graphs and getattr(self.runner, "prompt_graphs", None) is None:
            log.warning("--prompt-graphs has no effect here: it takes a recurrent model (Qwen3-Next) on one "
                        "CUDA device with decode graphs (not with --mtp, --kv-resident or a layer split)")
        log.info("%s", self.cpu_threads.describe())
        log.info("%s", describe_pool(config.parallel, self.pool.num_chunks, chunk, self.pool.total_bytes(),
                                     fmt.name, self.pool.shared))
        log.info("%s", describe_memory(memory_figures(self.loaded, self.pool)))
        self.conversations: ConversationCache | None = None
        parking = None
        kept = self.pool.kept if isinstance(self.pool, SplitPool) else None
        self.checkpoints: Checkpoints | None = None
        state_bytes = 0  # a parked conversation's saved states, at most
        if self.states is not None:  # a conversation resumes from its state or a checkpoint
            self.checkpoints = Checkpoints(self.states, config.ctx_checkpoints, config.prompt_cache_min_step)
            state_bytes = (config.ctx_checkpoints + 1) * self.states.bytes_per_lane()
            log.info("layer state (recurrent or window): %d layers, %.1f MiB a lane; %d checkpoints a conversation",
                     len(state_shapes), self.states.bytes_per_lane() / 2**20, config.ctx_checkpoints)
        slots, budget = cache_size(config, kept.local_bytes_per_cell() if kept else self.pool.bytes_per_cell(),
                                   state_bytes)
        if budget > 0:
            self.conversations = ConversationCache(budget, slots)
            parking = Parking(self.pool, self.conversations, kept, self.checkpoints)
        self.scheduler = Scheduler(self.pool, config.parallel, config.prefill_chunk,
                                   prefix_reuse=config.prefix_reuse, parking=parking,
                                   checkpoints=self.checkpoints,
                                   cuts_within_steps=self.checkpoints is not None
                                   and self.loaded.model.cuts_within_steps())
        if config.pipeline not in ("auto", "on", "off"):
            raise BadRequest(f"--pipeline must be auto, on or off, not {config.pipeline!r}")
        # overlapping pays where the forward runs asynchronously (CUDA graphs); elsewhere it only
        # costs a wasted step per stopped lane, so `auto` leaves it off
        self.pipeline = config.pipeline == "on" or (config.pipeline == "auto" and self.runner.graphs is not None)
        if self.states is not None:  # a wasted step would carry the state past the lane's tokens
            self.pipeline = False
        self.mtp = (MtpProposer(self.loaded.model, self.pool, self.runner.context, mc.attn_scale,
                                config.spec_min_p) if config.mtp else None)  # fed after every step
        self.speculator = self._speculator()
        if self.mtp is not None:  # the MTP head reads each step's hidden rows after it, before the next
            self.pipeline = False
        self.stop_ids = set(self.tokenizer.stop_token_ids)
        self.sessions = SessionFiles(self.scheduler, config.session_dir, self.loaded.identity, mc.vocab_size)
        # the server checks grammars (`engine.grammars.check`) from its threads before submitting
        self.grammars = Grammars(self.tokenizer, mc.vocab_size)
        self.masks = GrammarMasks(self.grammars.vocab_size, pin=self.device.type == "cuda")

    def _speculator(self) -> Speculator | None:
        """--spec N: drafts for decoding lanes (speculative.py) from the suffix proposer, the
        model's MTP head (--mtp) and the --spec-model, in that order; None when off."""
        config = self.config
        if config.spec < 0 or not 0.0 <= config.spec_min_p <= 1.0:
            raise BadRequest("--spec must be at least 0 and --spec-min-p in [0, 1]", "spec")
        spec = SpecConfig(config.spec, config.spec_min_p,
                          step_rows=STEP_ROWS.get(self.device.type, STEP_ROWS["cuda"]))
        drafter = config.spec_model or self.spec_model is not None
        if spec.n == 0 or not (config.suffix_draft or drafter or self.mtp is not None):
            return None
        proposers: list[Proposer] = []
        if config.suffix_draft:
            proposers.append(SuffixProposer(SharedCorpus(spec.shared_tokens), spec.min_p))
        if self.mtp is not None:
            proposers.append(self.mtp)
        if drafter:
            draft = self.spec_model or load_model(config.spec_model, str(self.device), config.dtype,
                                                  weights=config.weights)
            check_same_vocabulary(draft.tokenizer, self.tokenizer, draft.path)
            proposers.append(DraftModelProposer(draft, config.parallel, config.max_context, spec.min_p))
        log.info("speculative decoding: up to %d drafts a lane, %d decode rows a step, from %s "
                 "(min confidence %.2f)", spec.n, spec.step_rows, ", ".join(p.name for p in proposers),
                 spec.min_p)
        return Speculator(spec, proposers)

    def _cache_experts(self, slots: str) -> None:
        """--expert-cache: the experts loaded to the host get N device slots per layer (auto:
        what the free device memory holds, less a reserve for activations and graphs)."""
        model = self.loaded.model
        _, layers, experts = expert_bytes(model)
        if not layers:
            log.warning("--expert-cache: %s has no routed experts; nothing is cached", self.loaded.name)
            return
        if slots == "auto":
            free, total = device_memory(self.device)
            if free is None or self.device.type == "cpu":  # the host is the device: all of them
                n = experts
            else:
                n = auto_slots(model, free, max(EXPERT_RESERVE, int((total or 0) * 0.05)))
        else:
            n = int(slots)
        self.expert_stats = CacheStats()
        # mapped: decode steps of up to `parallel` lanes of 1 + spec rows, padded as graphs pad them
        config = self.config
        mapped = 2 * config.parallel * (1 + max(config.spec, 0)) if config.expert_misses == "mapped" else 0
        self.expert_refill = install_expert_cache(model, n, self.device, self.expert_stats, self.config.expert_policy,
                                                  self.config.expert_uploads, self.config.expert_prefetch, mapped)
        log.info("%s", describe_cache(model, self.device))

    # ---- public API ---------------------------------------------------------
    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None) -> RequestHandle:
        """Queue a request; its events (or its refusal) come from the returned handle."""
        params = params or SamplingParams()
        with self._lock:
            self._requests += 1
            n = self._requests
        handle = RequestHandle(f"req-{n}")
        handle._wake = self._wake.set
        error = self._validate(prompt_ids, params)
        if error is not None:
            handle.fail(error)
            return handle
        gen = None if params.greedy else make_generator(params.seed, self.config.seed * 1_000_003 + n, self.device)
        req = Request(list(prompt_ids), params, handle, gen)
        with self._lock:
            if self._closed:
                handle.fail(StrataError("the engine is shut down"))
                return handle
            self._inbox.append(req)
        self._wake.set()
        return handle

    def complete(self, prompt_ids: list[int], params: SamplingParams | None = None) -> StreamEvent:
        """Blocking convenience: the whole result as one event."""
        return self.generate(prompt_ids, params).result()

    def summary(self) -> str:
        """One line saying what runs: the model, where and how its weights are held, the KV pool,
        the conversation cache and any per-lane layer state (the server prints it at start-up)."""
        mc, pool = self.model_config, self.pool
        weights = sum(weight_bytes(self.loaded.model).values())
        dtype = str(self.dtype).removeprefix("torch.")
        invariant = ", batch-invariant products" if self.batch_invariant and self.device.type == "cuda" else ""
        parts = [f"{self.model_name} ({mc.arch}, {mc.num_layers} layers) on {self.device}, {dtype}{invariant}, "
                 f"weights {self.loaded.weights} {weights / 2**30:.2f} GiB",
                 f"KV {pool.fmt.name}: {self.config.parallel} lanes, {pool.total_cells} cells in "
                 f"{pool.num_chunks} chunks of {pool.chunk_size}, {pool.total_bytes() / 2**20:.1f} MiB",
                 self.context.describe()]
        if self.states is not None:
            parts.append(f"layer state {self.states.total_bytes() / 2**20:.1f} MiB, "
                         f"{self.config.ctx_checkpoints} checkpoints a conversation")
        cache = self.conversations
        parts.append(f"conversation cache {cache.budget_bytes / 2**20:.0f} MiB, {cache.slots} slots"
                     if cache is not None else "conversation cache off")
        return "; ".join(parts)

    @property
    def wants_cut_points(self) -> bool:
        """Whether requests should name their prompt's cut points (`SamplingParams.cut_points`):
        a recurrent model checkpoints its state there."""
        return self.checkpoints is not None and self.config.ctx_checkpoints > 0

    @property
    def alive(self) -> bool:
        """Whether the loop thread is running (health checks read this)."""
        return self._thread.is_alive() and not self._closed

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` in the engine loop between steps; its result or error comes in the Future."""
        fut: Future = Future()
        with self._lock:
            if self._closed:
                fut.set_exception(StrataError("the engine is shut down"))
                return fut
            self._calls.append((fn, fut))
        self._wake.set()
        return fut

    def save_session(self, lane: int, filename: str) -> SessionResult:
        """Save lane `lane`'s conversation to `filename` under --session-dir."""
        return self.call(lambda: self.sessions.save(lane, filename)).result()

    def restore_session(self, lane: int, filename: str) -> SessionResult:
        """Restore `filename` from --session-dir into idle lane `lane` (read and checked in this thread)."""
        loaded = self.sessions.read(filename)  # file I/O off the engine thread
        return self.call(lambda: self.sessions.install(lane, loaded)).result()

    def erase_slot(self, lane: int) -> int:
        """Forget idle lane `lane`'s conversation (llama-server's slot erase), so the next
        request reads its prompt from token 0; returns the tokens dropped. Not parked: an
        erase is asked for to be rid of the K/V. A busy lane raises LaneBusy."""
        def erase() -> int:
            lanes = self.scheduler.lanes
            if not 0 <= lane < len(lanes):
                raise BadRequest(f"no lane {lane}: lanes are 0..{len(lanes) - 1}", "id_slot")
            target = lanes[lane]
            if target.request is not None:
                raise LaneBusy(f"lane {lane} is busy: a request is using it; erase an idle lane", "id_slot")
            return self.scheduler.forget(target)
        return self.call(erase).result()

    def parked(self) -> list[dict[str, int]]:
        """The parked conversations, least recently used first: id, tokens, bytes."""
        def rows() -> list[dict[str, int]]:
            cache = self.conversations
            if cache is None:
                return []
            return [{"id": eid, "n_tokens": cache.entry(eid).kv.n_cells,
                     "bytes": cache.entry(eid).nbytes()} for eid in cache.entry_ids()]
        return self.call(rows).result()

    def save_parked_session(self, entry_id: int, filename: str) -> SessionResult:
        """Save a parked conversation to `filename` under --session-dir."""
        return self.call(lambda: self.sessions.save_parked(self.conversations, entry_id, filename)).result()

    def stats(self) -> dict[str, Any]:
        """The figures the server's /metrics and /v1/state show (strata/engine/stats.py)."""
        figures = pool_and_lane_figures(self.scheduler, self.pool)
        figures["queue_length"] += len(self._inbox)
        figures.update(
            steps=self.steps, pipelined_steps=self.pipelined_steps, step_errors=self.step_errors,
            grammar_rows=self.masks.counters.rows, grammar_wait_s=self.masks.counters.wait_s,
            grammar_mask_s=self.masks.counters.mask_s,
            conversation_cache=(self.conversations.stats().as_dict()
                                if self.conversations is not None else None),
            stages=self.runner.describe_stages(), knobs=knob_values(),
            **memory_figures(self.loaded, self.pool), **self.cpu_threads.figures(),
            expert_cache=self.expert_stats.figures() if self.expert_stats is not None else None,
            checkpoints=self.checkpoints.stats.as_dict() if self.checkpoints is not None else None,
            speculation=self.speculator.figures() if self.speculator is not None else None)
        return figures

    def cancel_all(self) -> None:
        """Cancel every request, queued or running (the server is stopping): each ends within a
        step with a `cancelled` finish, so its client gets a last event instead of a cut line."""
        with self._lock:
            handles = [req.handle for req in self._inbox]
        for handle in handles:
            handle.cancel()

        def running() -> None:
            sched = self.scheduler
            for req in list(sched.waiting) + [lane.request for lane in sched.lanes if lane.request]:
                req.handle.cancel()

        self.call(running)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.masks.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- validation -----------------------------------------------------------
    def _validate(self, prompt: list[int], params: SamplingParams) -> Exception | None:
        if not prompt:
            return BadRequest("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt):
            return BadRequest(f"prompt token ids must be in [0, {vocab})", "prompt")
        if len(prompt) >= self.config.max_context:
            return ContextTooLong(len(prompt), self.config.max_context)
        if params.max_tokens < 0:
            return BadRequest("max_tokens must be at least 0", "max_tokens")
        return controls_error(params, vocab)

    # ---- the loop ---------------------------------------------------------------
    def _loop(self) -> None:
        inflight: Launched | None = None
        while True:
            with self._lock:
                closed = self._closed
                incoming = list(self._inbox)
                self._inbox.clear()
                calls = list(self._calls)
                self._calls.clear()
            if closed:
                if inflight is not None:
                    self._complete(inflight)
                self._shutdown(calls)
                self.runner.close()
                return
            self._run_calls(calls)
            self._enqueue(incoming)
            self._cancel_requested()
            if inflight is not None:
                # the next step goes to the device before this one is post-processed (with drafting
                # on, only while no lane of the step would draft: a draft needs the last token)
                nxt = self._continue(inflight) if self.pipeline and self._drafts_rest(inflight) else None
                if nxt is not None and self.speculator is not None:
                    self.speculator.rested(nxt.reqs)
                self._complete(inflight)
                inflight = nxt
                if inflight is not None:
                    continue
            if self.scheduler.waiting and self.runner.reconnect_if_lost():
                self.scheduler.forget_idle()  # a new worker holds none of the lanes' K/V
            self._admit()
            if self.speculator is not None:
                self._draft()
            step, stuck = self.scheduler.plan()
            for lane in stuck:
                self._truncate(lane)
            if not step.seqs:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            inflight = self._launch(step, partial(self.runner.forward, step.seqs, step.tokens, step.sample))
            if inflight is not None and (inflight.ids is None or not self.pipeline):
                self._complete(inflight)
                inflight = None

    def _drafts_rest(self, launched: Launched) -> bool:
        """Whether the step after `launched` would carry no drafts whatever its tokens are."""
        return self.speculator is None or self.speculator.rests(launched.reqs)

    def _draft(self) -> None:
        """Drafts for the decoding lanes' next step, within what their limits leave (the bonus
        token after the drafts must still fit max_tokens, and every position the context) and
        within the step's row budget, lanes whose drafts held lately first."""
        assert self.speculator is not None
        lanes = [lane for lane in self.scheduler.lanes
                 if lane.request is not None and not lane.request.prefilling and lane.pending is not None]
        rooms = [min(lane.request.params.max_tokens - len(lane.request.output) - 1,  # type: ignore[union-attr]
                     self.config.max_context - 2 - len(lane.tokens)) for lane in lanes]
        drafts = self.speculator.plan([(lane.request, room) for lane, room in zip(lanes, rooms)])  # type: ignore[misc]
        for lane, d in zip(lanes, drafts):
            lane.carry(d)

    def _launch(self, step: Step, forward: Callable[[], torch.Tensor]) -> Launched | None:
        """Run a step's forward; a greedy decode step also gets its tokens, left on the device."""
        try:
            masks = self.masks.start(step)  # before the forward: the two overlap
            started = self.cpu_threads.clock()
            launched = Launched(step, [lane.request for lane in step.lanes], forward(), masks=masks)
            if self.states is not None:
                launched.cuts = self.states.take_cuts()
            launched.take_greedy_ids()
            self.cpu_threads.step_done(started, step.seqs)  # may set the next step's thread count
            self.steps += 1
            return launched
        except Exception as e:  # fail this step's requests; the engine keeps serving
            self._fail_step(step, e)
            return None

    def _continue(self, prev: Launched) -> Launched | None:
        """Launch the decode step after `prev` before `prev`'s tokens reach the host (pipeline.py)."""
        nxt = continuation(prev, self.scheduler, self.config.max_context)
        if nxt is None:
            return None
        step, ids = nxt
        self.pipelined_steps += 1
        return self._launch(step, partial(self.runner.decode_from, step.seqs, ids))

    def _complete(self, launched: Launched) -> None:
        try:
            self._postprocess(launched)
            if self.mtp is not None:  # the MTP head reads the rows the step kept
                self.mtp.ingest(launched.step, launched.reqs, self.runner.hidden)
        except Exception as e:  # fail this step's requests; the engine keeps serving
            self._fail_step(launched.step, e)

    def _fail_step(self, step: Step, e: Exception) -> None:
        self.step_errors += 1
        if isinstance(e, StageUnavailable):  # the requests get a 503; the link is retried later
            log.warning("engine step failed: %s", e)
            error: StrataError = e
        else:
            log.exception("engine step failed")
            error = StrataError(f"internal error in the engine step: {e}")
        for lane in step.lanes:
            if lane.request is not None:
                lane.request.handle.fail(error)
                self.scheduler.release_lane(lane, keep_cache=False)
        if isinstance(e, StageUnavailable):
            self.scheduler.forget_idle()

    @staticmethod
    def _run_calls(calls: list[tuple[Callable[[], Any], Future]]) -> None:
        for fn, fut in calls:
            try:
                fut.set_result(fn())
            except Exception as e:  # reported to the caller, the loop goes on
                fut.set_exception(e)

    def _enqueue(self, incoming: list[Request]) -> None:
        waiting = self.scheduler.waiting
        free = len(self.scheduler.free_lanes())  # requests that will take a lane at once never wait
        for req in incoming:
            if len(waiting) - free >= self.config.max_queued:
                self.scheduler.counters.refusals += 1
                req.handle.fail(QueueFull(f"{len(waiting) - free} requests are already waiting "
                                          f"(--max-queued {self.config.max_queued})"))
            else:
                waiting.append(req)

    def _cancel_requested(self) -> None:
        waiting = self.scheduler.waiting
        for req in [r for r in waiting if r.handle.cancelled]:
            waiting.remove(req)
            req.handle.publish(self._event(req, "", [], FinishReason.CANCELLED))
        for lane in self.scheduler.lanes:
            if lane.request is not None and lane.request.handle.cancelled:
                self._finish(lane, FinishReason.CANCELLED)

    def _admit(self) -> None:
        sched = self.scheduler
        while (req := sched.next_admissible()) is not None:  # a request pinned to a busy lane waits
            try:
                if req.params.grammar is not None:  # an invalid grammar fails here, before a lane changes
                    req.matcher = self.grammars.matcher(req.params.grammar)
                sched.admit(req)
            except StrataError as e:
                req.handle.fail(e)
                continue
            req.detok = IncrementalDetokenizer(self.tokenizer, req.prompt)
            req.stopper = StopMatcher(req.params.stop)
            if req.params.progress:
                req.handle.publish(self._progress(req))

    def _postprocess(self, launched: Launched) -> None:
        """Account the step's input tokens, then sample and accept its output tokens."""
        step = launched.step
        lanes_sampled: list[Lane] = []
        rows: list[int] = []
        verifying: list[tuple[Lane, int, Request]] = []  # lanes that fed drafts, their first logits row
        first = first_logit_rows(step.sample)
        for i, (seq, lane, wanted, req) in enumerate(zip(step.seqs, step.lanes, step.sample, launched.reqs)):
            if req is None or lane.request is not req:
                continue  # the request ended (or was cancelled) after this step was launched
            if req.prefilling:
                start = req.cursor
                lane.tokens.extend(req.prompt[req.cursor : req.cursor + seq.n])
                req.cursor += seq.n
                if self.checkpoints is not None:
                    for inside, state in sorted(launched.cuts.get(lane.index, {}).items()):
                        self.checkpoints.save(lane.index, start + inside, state)  # cut inside the step
                    if req.cursor in req.cuts:
                        self.checkpoints.save(lane.index, req.cursor)
                if not wanted and req.params.progress:
                    req.handle.publish(self._progress(req))
            else:
                lane.keep_pending()
            self.past_trained.see(len(lane.tokens), req.handle.id)
            if wanted > 1:
                verifying.append((lane, first[i], req))
            elif wanted:
                lanes_sampled.append(lane)
                rows.append(i)
        for lane, row, req in verifying:
            self._verify(lane, launched.logits, row, req)
        words = None
        if launched.masks is not None:  # lanes whose matcher failed end here, without a token
            words, failed = self.masks.wait(launched.masks, lanes_sampled, rows)
            for lane, error in failed:
                self._grammar_failed(lane, error)
            live = [k for k, lane in enumerate(lanes_sampled) if lane.request is not None]
            lanes_sampled, rows = [lanes_sampled[k] for k in live], [rows[k] for k in live]
        if not lanes_sampled:
            return
        if launched.host is not None:  # a greedy decode step: its tokens are on their way
            all_tokens = launched.host_ids()
            tokens = [all_tokens[i] for i in rows]
            logprobs: list[Any] = [None] * len(rows)
        else:
            tokens, logprobs = self._sample(launched, lanes_sampled, rows, words)
        for lane, tok, lp in zip(lanes_sampled, tokens, logprobs):
            self._accept(lane, tok, lp)

    def _sample(self, launched: Launched, lanes: list[Lane], rows: list[int],
                words: torch.Tensor | None) -> tuple[list[int], list[Any]]:
        """Tokens and logprobs of the step's rows `rows`, after the requests' controls."""
        reqs: list[Request] = [lane.request for lane in lanes]  # type: ignore[misc]
        first = first_logit_rows(launched.step.sample)
        keep = [first[i] for i in rows]
        logits = launched.logits
        if keep != list(range(logits.shape[0])):
            logits = logits[upload(keep, logits.device)]
        return self._pick(logits, reqs, words, launched, rows)

    def _pick(self, logits: torch.Tensor, reqs: list[Request], words: torch.Tensor | None = None,
              launched: Launched | None = None, rows: list[int] | None = None) -> tuple[list[int], list[Any]]:
        """Tokens and logprobs of `logits` (one row per request) after the requests' controls; with
        `words`, the grammar masks of `launched`'s step rows `rows` apply."""
        vocab = logits.shape[1]
        scores = biased(logits, [r.params.logit_bias for r in reqs],
                        [banned_ids(r.params, len(r.output), self.stop_ids, vocab) for r in reqs])
        if words is not None and launched is not None and launched.masks is not None:
            scores = self.masks.apply(logits.float() if scores is None else scores, launched.masks,
                                      words, rows)  # type: ignore[arg-type]
        histories = ([r.prompt + r.output for r in reqs] if any(has_penalties(r.params) for r in reqs)
                     else [[]] * len(reqs))
        result = sample(logits, [r.params for r in reqs], histories, [r.generator for r in reqs],
                        [len(r.prompt) for r in reqs], scores=scores)
        return result.tokens.tolist(), result.logprobs

    def _verify(self, lane: Lane, logits: torch.Tensor, row: int, req: Request) -> None:
        """Sample a lane's fed run row by row, keeping each draft its row's token equals; the first
        token that differs, or the one after the last draft, becomes the lane's pending token.

        Each token goes through `_accept` (stops, limits, events) as if decoded alone; rows past
        the first mismatch are never sampled, so a seeded request draws the same noise as
        without drafts. Rejected drafts' K/V lies past `lane.tokens`: rolled back by length; a
        state model's layer state goes back to after the last kept row (`StatePool.rewind`)."""
        drafts = lane.take_drafts()
        rows = logits[row : row + len(drafts) + 1]
        ids = rows.argmax(dim=-1).tolist() if plain_greedy(req) else None  # one sync for the run
        accepted = 0
        for j in range(len(drafts) + 1):
            tok, lp = (ids[j], None) if ids is not None else self._one(req, rows[j : j + 1])
            self._accept(lane, tok, lp)
            if lane.request is not req or j == len(drafts) or tok != drafts[j]:
                break
            lane.keep_pending()  # the draft (now the pending token) was fed: its K/V is in the pool
            accepted += 1
        if self.states is not None:  # the pending token and the accepted drafts stay
            self.states.rewind(lane.index, accepted + 1)
        self.speculator.verified(req, len(drafts), accepted)  # type: ignore[union-attr]

    def _one(self, req: Request, logits: torch.Tensor) -> tuple[int, Any]:
        tokens, logprobs = self._pick(logits, [req])
        return tokens[0], logprobs[0]

    def _accept(self, lane: Lane, tok: int, lp: Any) -> None:
        req = lane.request
        assert req is not None
        p = req.params
        if p.max_tokens == 0:  # the prompt is read and stays in the lane; its sampled token is dropped
            self._publish_and_finish(lane, "", [], FinishReason.LENGTH, [])
            return
        logprobs = [lp.with_text(self.tokenizer.token_text)] if lp is not None else []
        if tok in self.stop_ids and not p.ignore_eos or tok in p.stop_token_ids:
            req.output.append(tok)
            self._publish_and_finish(lane, self._flush(req), [tok], FinishReason.STOP, logprobs)
            return
        req.output.append(tok)
        text, stopped = req.detok.push(tok), None  # type: ignore[union-attr]
        if len(req.output) >= p.min_tokens:  # stop strings count from the min_tokens-th token's text on
            text, stopped = req.stopper.push(text)  # type: ignore[union-attr]
        if stopped is not None:
            self._publish_and_finish(lane, text, [tok], FinishReason.STOP, logprobs, stop=stopped)
            return
        matcher = req.matcher
        if matcher is not None:
            if not matcher.consume_token(tok):
                self._grammar_failed(lane, matcher.get_error(), text, [tok], logprobs)
                return
            if matcher.is_stopped():
                # the grammar is complete and allows nothing more: as if EOS came next
                self._publish_and_finish(lane, text + self._flush(req), [tok], FinishReason.STOP, logprobs)
                return
        at_limit = len(req.output) >= p.max_tokens
        at_context = len(lane.tokens) + 1 >= self.config.max_context
        if at_limit or at_context:
            self._publish_and_finish(lane, text + self._flush(req), [tok], FinishReason.LENGTH, logprobs)
            return
        lane.pending = tok
        req.handle.publish(self._event(req, text, [tok], None, logprobs=logprobs))

    @staticmethod
    def _flush(req: Request) -> str:
        """The text still held by the detokenizer and the stop matcher, at the end of a request."""
        tail = req.stopper.push(req.detok.flush())[0]  # type: ignore[union-attr]
        return tail + req.stopper.flush()  # type: ignore[union-attr]

    def _grammar_failed(self, lane: Lane, error: str, text: str = "", toks: list[int] | None = None,
                        logprobs: list | None = None) -> None:
        """A matcher error (llguidance rejected its own mask or state): the request ends `stop`."""
        req = lane.request
        assert req is not None
        log.warning("request %s: grammar matcher failed, ending it: %s", req.handle.id, error.strip())
        self._publish_and_finish(lane, text + self._flush(req), toks or [], FinishReason.STOP,
                                 logprobs or [])

    def _progress(self, req: Request) -> StreamEvent:
        """A prompt-progress event: how much of the prompt is read (for `params.progress`)."""
        event = self._event(req, "", [], None)
        event.progress = PromptProgress(total=len(req.prompt), cached=req.cached, processed=req.cursor)
        return event

    def _publish_and_finish(self, lane: Lane, text: str, toks: list[int], reason: FinishReason,
                            logprobs: list, stop: str | None = None, truncated: bool = False) -> None:
        req = lane.request
        assert req is not None
        ev = self._event(req, text, toks, reason, logprobs=logprobs, stop=stop, truncated=truncated)
        self.scheduler.release_lane(lane, keep_cache=not truncated)
        if self.speculator is not None:
            self.speculator.finished(req)
        req.finish = reason
        req.handle.publish(ev)

    def _finish(self, lane: Lane, reason: FinishReason) -> None:
        req = lane.request
        assert req is not None
        # a half-read prompt's K/V is still a valid prefix: the lane keeps it
        self._publish_and_finish(lane, "", [], reason, [])

    def _truncate(self, lane: Lane) -> None:
        """A decoding lane that cannot grow ends `length` with `truncated`; its chunks go back."""
        self.scheduler.counters.truncations += 1
        self._publish_and_finish(lane, "", [], FinishReason.LENGTH, [], truncated=True)

    def _event(self, req: Request, text: str, toks: list[int], reason: FinishReason | None,
               logprobs: list | None = None, stop: str | None = None, truncated: bool = False) -> StreamEvent:
        return StreamEvent(
            text=text, token_ids=toks, finish_reason=reason, truncated=truncated,
            prompt_tokens=len(req.prompt), completion_tokens=len(req.output),
            cached_tokens=req.cached, logprobs=logprobs or [], stop_string=stop,
        )

    def _shutdown(self, calls: list[tuple[Callable[[], Any], Future]]) -> None:
        for _, fut in calls:
            fut.set_exception(StrataError("the engine is shutting down"))
        for req in list(self.scheduler.waiting):
            req.handle.fail(StrataError("the engine is shutting down"))
        self.scheduler.waiting.clear()
        for lane in self.scheduler.lanes:
            if lane.request is not None:
                self._finish(lane, FinishReason.CANCELLED)
