"""`strata stage`: a worker that runs a model's later layers for one main at a time.

The worker listens; a main that proves the shared key (`handshake.py`) and
says `Hello` gets the worker's layers [first_layer, end) loaded (kept for
the next main with the same split), a pool part of the main's geometry whose
chunk tables mirror the main's rows, and then one operation at a time:
a step's layers, or the raw runs of a range of cells out or in. With
`--next HOST:PORT --split-at M` the worker is a relay: it runs [first_layer,
M) and forwards the rest to the next worker, linked again after each main's
hello so the next worker checks the real geometry.

While one main is served, another is refused once it has proved the key
(one log line each side). When the main goes (end of file on the link, or
a tensor timeout) the worker drops its pool and the link to its next
worker, and waits for the next main.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from strata.errors import StrataError
from strata.kv.formats import Storage, make_format
from strata.kv.step import SeqSpec, decode_step, step_positions
from strata.kv.tables import ChunkTables
from strata.memory import available_ram
from strata.models.loader import LoadedModel, Placement, load_model, resolve_device, resolve_dtype
from strata.parallel.build import PoolShape, part_on
from strata.parallel.handshake import StageLinkError
from strata.parallel.link import Link, Listener, bind_notice
from strata.parallel.protocol import (
    MISSING,
    PROTOCOL,
    Done,
    Export,
    Fetch,
    Forget,
    Hello,
    Import,
    Keep,
    Refusal,
    Restore,
    Step,
    Welcome,
    apply_rows,
    recv_runs,
    send_runs,
)
from strata.parallel.remote import RemoteStage, split_address
from strata.parallel.stages import GraphsFactory, LocalStage

log = logging.getLogger("strata.stage")


@dataclass(frozen=True)
class WorkerOptions:
    model: str | None  # the same file as the main's (None: the embedded default)
    device: str
    dtype: str
    weights: str
    kv_resident: int | None  # stream this worker's K/V (--kv-resident), its own choice
    listen: str  # HOST:PORT
    key: bytes
    next_address: str | None = None  # a relay's next worker
    split_at: int | None = None  # a relay's last layer + 1 (with next_address)
    timeout: float = 60.0  # every tensor operation and every reply; see docs/STAGES.md


MAX_KEPT = 64  # conversation parts one worker keeps at most, whatever its RAM


def keep_limit_error(keep_max: int, part_bytes: int, ram: int | None) -> str | None:
    """Why a worker cannot promise to keep `keep_max` parts of up to `part_bytes` each, or None."""
    if keep_max <= 0:
        return None
    if keep_max > MAX_KEPT:
        return f"--prompt-cache {keep_max - 1} asks for {keep_max} kept parts; a worker keeps at most {MAX_KEPT}"
    if ram is None:
        return "this worker cannot read its available RAM, so it keeps no conversation parts"
    if keep_max * part_bytes > ram // 2:
        return (f"{keep_max} kept parts of up to {part_bytes / 2**20:.0f} MiB each need more than half "
                f"of this worker's {ram / 2**30:.1f} GiB of available RAM")
    return None


def _short(identity: str) -> str:
    """A model identity for a log line: the hash's start and the weight mode it carries."""
    digest, plus, mode = identity.partition("+")
    return digest[:16] + plus + mode


class _Serving:
    """What one main's session holds: the stage, its pool part, a relay's next link, kept parts."""

    def __init__(self, stage: LocalStage, nxt: RemoteStage | None, hidden: int, dtype: torch.dtype) -> None:
        self.stage = stage
        self.next = nxt
        self.hidden = hidden
        self.dtype = dtype
        self.parts: dict[str, list[Storage]] = {}  # this worker's layers of each kept conversation

    def prune(self, keep: list) -> None:
        wanted = set(keep)
        for part in [p for p in self.parts if p not in wanted]:
            del self.parts[part]

    @property
    def layers(self) -> int:
        return len(self.stage.layers) + (len(self.next.layers) if self.next is not None else 0)

    def close(self) -> None:
        if self.next is not None:
            self.next.close()


class StageWorker:
    def __init__(self, options: WorkerOptions, graphs: GraphsFactory | None = None) -> None:
        """`graphs`: the decode-graph capture of the worker's stage (`engine/graphs.py`)."""
        if (options.next_address is None) != (options.split_at is None):
            raise StrataError("a relay needs both --next and --split-at")
        self.options = options
        self.graphs = graphs
        self.device = resolve_device(options.device, str(options.model))
        self.dtype = resolve_dtype(options.dtype)
        host, port = split_address(options.listen, any_port=True)
        self.listener = Listener(host, port, options.key, options.timeout, self.device)
        self.address = f"{host}:{self.listener.port}"
        notice = bind_notice(host)
        if notice is not None:
            log.warning("%s", notice)
        self._links: queue.Queue[Link] = queue.Queue()
        self._busy = threading.Lock()
        self._serving_peer: str | None = None
        self._loaded: tuple[int, LoadedModel] | None = None
        self._serving: _Serving | None = None
        self._stop = threading.Event()
        self.mains = 0  # mains served so far (tests read it)

    @property
    def port(self) -> int:
        return self.listener.port

    def parts_held(self) -> list[str]:
        """Ids of the conversation parts kept for the main being served (none between mains)."""
        serving = self._serving
        return list(serving.parts) if serving is not None else []

    # ---- accepting -----------------------------------------------------------------
    def serve_forever(self) -> None:
        """Accept mains on a thread; serve them one at a time on this one (it owns torch)."""
        threading.Thread(target=self._accept_loop, name="strata-stage-accept", daemon=True).start()
        log.info("stage worker listening on %s (%s)", self.address, self.device)
        while not self._stop.is_set():
            try:
                link = self._links.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self._serve(link)
            finally:
                link.close()
                self._serving_peer = None
                self._busy.release()

    def stop(self) -> None:
        self._stop.set()
        self.listener.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            claimed: list[bool] = []

            def refuse() -> str | None:
                if not self._busy.acquire(blocking=False):
                    return f"this worker already serves a main ({self._serving_peer})"
                claimed.append(True)
                return None

            try:
                link = self.listener.accept(None, refuse=refuse)
            except (StageLinkError, OSError) as e:
                if claimed:
                    self._busy.release()
                if self._stop.is_set():
                    return
                log.warning("stage link refused: %s", e)
                continue
            self._serving_peer = link.peer
            self._links.put(link)

    # ---- one main -------------------------------------------------------------------
    def _serve(self, link: Link) -> None:
        try:
            hello = link.recv(self.options.timeout)
        except StageLinkError as e:
            log.warning("main %s: no hello: %s", link.peer, e)
            return
        try:
            serving = self._welcome(link, hello)
        except StrataError as e:
            log.warning("main %s refused: %s", link.peer, e)
            try:
                link.send(Refusal(str(e)))
            except StageLinkError:
                pass
            return
        self.mains += 1
        self._serving = serving
        log.info("serving main %s: layers %d-%d", link.peer, hello.first_layer,
                 hello.first_layer + serving.layers - 1)
        try:
            while True:
                msg = link.recv(None)
                self._handle(link, serving, msg)
        except StageLinkError as e:
            log.info("main %s gone (%s); its pool part is dropped", link.peer, e)
        finally:
            self._serving = None
            serving.close()

    def _welcome(self, link: Link, hello: object) -> _Serving:
        if not isinstance(hello, Hello):
            raise StrataError(f"expected a hello, got {type(hello).__name__}")
        if hello.protocol != PROTOCOL:
            raise StrataError(f"the main speaks stage protocol {hello.protocol}, this worker {PROTOCOL}")
        dtype_name = str(self.dtype).removeprefix("torch.")
        if hello.dtype != dtype_name:
            raise StrataError(f"the main computes in {hello.dtype}, this worker in {dtype_name} (--dtype)")
        last = self.options.split_at
        loaded = self._load(hello.first_layer, last)
        if loaded.identity != hello.model:
            raise StrataError(f"other model: the main has {_short(hello.model)}, this worker "
                              f"{_short(loaded.identity)} ({loaded.path}; --weights must match too)")
        cfg = loaded.config
        if hello.hidden != cfg.hidden_size:
            raise StrataError(f"hidden size {hello.hidden} from the main, the model has {cfg.hidden_size}")
        stop = last if last is not None else cfg.num_layers
        try:
            fmt = make_format(hello.kv_format, cfg.num_kv_heads, cfg.head_dim)
            chunks = ChunkTables(hello.lanes, hello.max_context, hello.chunk, hello.pool_tokens)
            shape = PoolShape(fmt, hello.lanes, hello.max_context, hello.chunk, hello.pool_tokens,
                              self.options.kv_resident)
            pool = part_on(shape, range(hello.first_layer, stop), self.device, chunks)
        except (ValueError, RuntimeError) as e:  # a bad format, or more pool than memory
            raise StrataError(f"cannot hold the main's pool: {str(e).splitlines()[0]}") from None
        limit = keep_limit_error(hello.keep_max, hello.max_context * pool.bytes_per_cell(), available_ram())
        if limit is not None:
            raise StrataError(limit)
        if loaded.model.max_positions < hello.max_context:
            loaded.model.set_max_positions(hello.max_context)
        loaded.model.set_batch_invariant(hello.batch_invariant)  # before its graphs are captured
        stage = LocalStage(loaded.model, pool, cfg.attn_scale, hello.max_context, self.graphs)
        nxt = None
        if self.options.next_address is not None:
            nxt = RemoteStage(self.options.next_address, self.options.key,
                              dataclasses.replace(hello, first_layer=stop), chunks, fmt,
                              self.device, self.options.timeout)
        serving = _Serving(stage, nxt, cfg.hidden_size, self.dtype)
        mine = {**stage.describe(), "kind": "worker", "address": self.address}
        stages = [mine] + (nxt.stages if nxt is not None else [])
        link.send(Welcome(PROTOCOL, cfg.num_layers, stages))
        return serving

    def _load(self, first: int, last: int | None) -> LoadedModel:
        """The model's layers [first, last or end) on this worker's device (kept between mains)."""
        if self._loaded is not None and self._loaded[0] == first:
            return self._loaded[1]
        self._loaded = None  # the previous split's layers go before the new ones load

        def place(cfg) -> Placement:
            stop = last if last is not None else cfg.num_layers
            if not 0 < first < stop <= cfg.num_layers:
                raise StrataError(f"layers {first}-{stop - 1} are not a later part of the model's "
                                  f"{cfg.num_layers} layers")
            return Placement(tuple(self.device if first <= i < stop else None
                                   for i in range(cfg.num_layers)), None)

        loaded = load_model(self.options.model, self.device, self.dtype, progress=False,
                            weights=self.options.weights, place=place)
        self._loaded = (first, loaded)
        return loaded

    # ---- operations ----------------------------------------------------------------
    def _handle(self, link: Link, s: _Serving, msg: object) -> None:
        t0 = time.perf_counter()
        pool = s.stage.pool
        if isinstance(msg, (Step, Export, Import, Keep, Restore)):
            try:
                apply_rows(pool.chunks, msg.rows)
            except (ValueError, TypeError) as e:
                raise StageLinkError(f"a bad table row: {e}") from None
        if isinstance(msg, Step):
            if not (len(msg.lanes) == len(msg.starts) == len(msg.ns) == len(msg.prompt) == len(msg.drafted)) \
                    or not msg.ns:
                raise StageLinkError("a step with mismatched sequences")
            seqs = [SeqSpec(int(a), int(b), int(c), bool(d), bool(e))
                    for a, b, c, d, e in zip(msg.lanes, msg.starts, msg.ns, msg.prompt, msg.drafted)]
            h = link.recv_tensor((sum(s.n for s in seqs), s.hidden), s.dtype)
            try:
                out = self._step(s, h, seqs)
            except Exception as e:  # noqa: BLE001 - reported to the main, which fails the step
                log.exception("stage step failed")
                link.send(Done(f"{type(e).__name__}: {e}", time.perf_counter() - t0))
                return
            out = out.to(link.tensor_device)  # to the CPU for gloo: this waits for the step
            if out.is_cuda:
                torch.cuda.current_stream(out.device).synchronize()
            link.send(Done(None, time.perf_counter() - t0))
            link.send_tensor(out)
        elif isinstance(msg, Export):
            try:
                runs = pool.export_range(msg.lane, msg.start, msg.end)
                if s.next is not None:
                    runs += s.next.export_range(msg.lane, msg.start, msg.end)
            except StrataError as e:
                link.send(Done(str(e), time.perf_counter() - t0))
                return
            link.send(Done(None, time.perf_counter() - t0))
            send_runs(link, runs)
        elif isinstance(msg, Import):
            runs = recv_runs(link, pool.fmt, s.layers, msg.n)
            mine = len(s.stage.layers)
            try:
                pool.import_range(msg.lane, msg.start, runs[:mine])
                if s.next is not None:
                    s.next.import_range(msg.lane, msg.start, runs[mine:])
            except StrataError as e:
                link.send(Done(str(e), time.perf_counter() - t0))
                return
            link.send(Done(None, time.perf_counter() - t0))
        elif isinstance(msg, (Keep, Restore, Fetch, Forget)):
            self._kept(link, s, msg, t0)
        else:
            raise StageLinkError(f"unexpected {type(msg).__name__} from the main")

    def _kept(self, link: Link, s: _Serving, msg: Keep | Restore | Fetch | Forget, t0: float) -> None:
        """The operations on kept parts; each forwards to a relay's next worker too."""
        pool, nxt = s.stage.pool, s.next
        error = None
        runs: list[Storage] = []
        try:
            if isinstance(msg, Keep):
                s.parts[msg.part] = pool.export_range(msg.lane, 0, msg.n)
                if nxt is not None:
                    nxt.keep(msg.part, msg.lane, msg.n, msg.keep)
                s.prune(msg.keep)
            elif isinstance(msg, Restore):
                part = s.parts.get(msg.part)
                if part is None or next(iter(part[0].values())).shape[0] < msg.n:
                    error = MISSING
                else:
                    pool.import_range(msg.lane, 0, [{k: t[: msg.n] for k, t in st.items()} for st in part])
                    if nxt is not None and not nxt.restore(msg.part, msg.lane, msg.n, msg.keep):
                        error = MISSING
                    s.prune(msg.keep)
            elif isinstance(msg, Fetch):
                part = s.parts.get(msg.part)
                if part is None:
                    error = MISSING
                else:
                    runs = [{k: t[: msg.n] for k, t in st.items()} for st in part]
                    if nxt is not None:
                        runs += nxt.fetch(msg.part, msg.n)
            else:
                s.prune(msg.keep)
                if nxt is not None:
                    nxt.forget(msg.keep)
        except StrataError as e:  # the relay's next worker failed
            error = str(e)
        link.send(Done(error, time.perf_counter() - t0))
        if error is None and isinstance(msg, Fetch):
            send_runs(link, runs)

    @torch.inference_mode()
    def _step(self, s: _Serving, h: torch.Tensor, seqs: list[SeqSpec]) -> torch.Tensor:
        positions = step_positions(seqs)
        if decode_step(seqs):  # a decode step: through the stage's graphs where it has them
            out = s.stage.decode(seqs, [0] * len(seqs), h)
        else:
            out = s.stage.run(h, positions, seqs)
        if s.next is not None:
            out = s.next.run(out, positions, seqs)
        return out
