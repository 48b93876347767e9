"""The main's side of a remote stage: layers [L, end) run by a worker over an authenticated link.

`RemoteStage` is both a stage (`run`: send the step and its hidden states,
receive the worker chain's output) and a part of the split's pool
(`export_range` / `import_range`: the worker's raw runs travel over the
link, so parking and session files keep every layer's K/V on the main and
a parked conversation survives a worker restart).

Faults: any link error closes the link and raises `StageUnavailable` (the
API's 503); the requests of that step fail, the engine's lanes forget what
they cached (the worker's part of it is gone or unknown), and the next
request reconnects (`reconnect_if_lost`) and reads its prompt from token 0.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from strata.errors import BadRequest, StageUnavailable, StrataError
from strata.kv.formats import KvFormat, Storage
from strata.kv.step import SeqSpec, decode_step
from strata.kv.tables import ChunkTables
from strata.parallel.handshake import StageLinkError
from strata.parallel.link import Link, StageLinkTimeout, connect
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
    recv_runs,
    send_runs,
    table_rows,
)

log = logging.getLogger("strata.parallel")
RETRY_S = 1.0  # between attempts to reach a lost worker (requests meanwhile get 503 at once)


def split_address(address: str, any_port: bool = False) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 in brackets) -> (host, port); a bad one is a BadRequest naming it.
    `any_port`: port 0 (bind any free port) is allowed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 if any_port else 1) <= int(port) < 65536:
        raise BadRequest(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


class RemoteStage:
    """Layers [first_layer, num_layers) in a worker chain, over one link."""

    def __init__(self, address: str, key: bytes, hello: Hello, chunks: ChunkTables, fmt: KvFormat,
                 device: torch.device, timeout: float) -> None:
        self.address = address
        self.host, self.port = split_address(address)
        self.key = key
        self.hello = hello
        self.chunks = chunks
        self.fmt = fmt
        self.device = device
        self.timeout = timeout
        self.link: Link | None = None
        self._next_try = 0.0  # monotonic time before which no reconnection is tried
        self.changed = chunks.watch()  # lanes whose rows the worker has not seen
        self.stages: list[dict[str, Any]] = []
        self.connects = 0
        self.kept_parts = 0  # conversation parts the worker keeps now (the last keep list sent)
        self.steps = 0
        self.step_seconds = 0.0  # main's wall time of remote steps
        self.worker_seconds = 0.0  # the worker chain's own time on them
        self.decode_steps = 0
        self.decode_link_seconds = 0.0  # decode steps' wall time minus the worker chain's
        welcome = self._connect()
        self.layers = self.layer_range = range(hello.first_layer, welcome.num_layers)

    # ---- the link --------------------------------------------------------------
    def _connect(self) -> Welcome:
        try:
            link = connect(self.host, self.port, self.key, self.timeout, self.device)
        except StageLinkError as e:  # it names the address
            raise StageUnavailable(f"remote stage: {e}") from None
        try:
            link.send(self.hello)
            reply = link.recv(self.timeout * 10)  # the worker may be loading its layers
        except StageLinkError as e:
            link.close()
            raise StageUnavailable(f"remote stage {self.address}: {e}") from None
        if isinstance(reply, Refusal):
            link.close()
            raise StrataError(f"remote stage {self.address} refused: {reply.reason}")
        if not isinstance(reply, Welcome):
            link.close()
            raise StrataError(f"remote stage {self.address}: answered the hello with {type(reply).__name__}")
        self.link = link
        self.stages = reply.stages
        self.connects += 1
        self.changed.update(range(self.chunks.num_lanes))  # a new worker knows no rows
        self.kept_parts = 0
        log.info("remote stage %s: layers %d-%d on %s", self.address, self.hello.first_layer,
                 reply.num_layers - 1, ", ".join(str(s.get("device")) for s in reply.stages))
        return reply

    def _drop(self, e: Exception) -> StageUnavailable:
        log.warning("remote stage %s lost: %s", self.address, e)
        if self.link is not None:
            self.link.close()
            self.link = None
        return StageUnavailable(f"remote stage {self.address} is unavailable: {e}")

    def reconnect_if_lost(self) -> bool:
        """Check the link (a closed one shows at once); reconnect if it is down. True: the worker
        is a new one (or its state unknown), so nothing cached for its layers may be reused."""
        if self.link is not None:
            try:
                unexpected = self.link.recv(0)
            except StageLinkTimeout:
                return False  # alive and quiet
            except StageLinkError as e:
                self._drop(e)
            else:
                self._drop(StrataError(f"unexpected {type(unexpected).__name__} from the worker"))
        now = time.monotonic()
        if now < self._next_try:  # a worker that was just unreachable is not asked again at once
            return True
        try:
            self._connect()
        except StrataError as e:
            self._next_try = now + RETRY_S
            log.warning("%s", e)
        return True

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None

    def _live(self) -> Link:
        if self.link is None:
            raise StageUnavailable(f"remote stage {self.address} is not connected")
        return self.link

    def _done(self, link: Link, missing_ok: bool = False) -> Done:
        reply = link.recv(self.timeout)
        if not isinstance(reply, Done):
            raise StageLinkError(f"expected a reply, got {type(reply).__name__}")
        if reply.error is not None and not (missing_ok and reply.error == MISSING):
            raise StageLinkError(f"the worker failed: {reply.error}")
        return reply

    # ---- a stage ------------------------------------------------------------
    def run(self, h: torch.Tensor, positions: torch.Tensor, seqs: list[SeqSpec]) -> torch.Tensor:
        link = self._live()
        t0 = time.perf_counter()
        try:
            link.send(Step([s.lane for s in seqs], [s.start for s in seqs], [s.n for s in seqs],
                           table_rows(self.chunks, self.changed), [s.prompt for s in seqs],
                           [s.drafted for s in seqs]))
            link.send_tensor(h.to(link.tensor_device))
            done = self._done(link)
            out = link.recv_tensor(h.shape, h.dtype)
        except StageLinkError as e:
            raise self._drop(e) from None
        wall = time.perf_counter() - t0
        self.steps += 1
        self.step_seconds += wall
        self.worker_seconds += done.seconds
        if decode_step(seqs):  # the link's cost per decode step, apart from prompt reads
            self.decode_steps += 1
            self.decode_link_seconds += wall - done.seconds
        return out

    def decode(self, seqs: list[SeqSpec], tokens: list[int], h: torch.Tensor | None,
               device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """A decode step (the worker uses its own graphs for it); never the first stage."""
        assert h is not None, "a remote stage runs after the main's layers"
        return self.run(h, torch.tensor([s.start for s in seqs], dtype=torch.int64), seqs)

    def describe(self) -> dict[str, Any]:
        link = self.link
        return {"layers": [self.layers.start, self.layers.stop], "kind": "remote",
                "address": self.address, "connected": link is not None, "connects": self.connects,
                "workers": self.stages, "steps": self.steps, "kept_parts": self.kept_parts,
                "link_seconds_per_step": ((self.step_seconds - self.worker_seconds) / self.steps
                                          if self.steps else None),
                "link_seconds_per_decode_step": (self.decode_link_seconds / self.decode_steps
                                                 if self.decode_steps else None),
                "bytes_per_step": ((link.bytes_sent + link.bytes_received) / self.steps
                                   if link is not None and self.steps else None),
                "bytes_sent": link.bytes_sent if link is not None else 0,
                "bytes_received": link.bytes_received if link is not None else 0}

    # ---- a part of the pool ----------------------------------------------------
    def bytes_per_cell(self) -> int:
        return self.fmt.cell_bytes() * len(self.layers)

    def total_bytes(self) -> int:
        return sum(int(s.get("kv_bytes", 0)) for s in self.stages)

    def figures(self) -> dict | None:
        return None

    def export_range(self, lane: int, start: int, end: int) -> list[Storage]:
        link = self._live()
        try:
            link.send(Export(lane, start, end, table_rows(self.chunks, self.changed)))
            self._done(link)
            return recv_runs(link, self.fmt, len(self.layers), end - start)
        except StageLinkError as e:
            raise self._drop(e) from None

    def import_range(self, lane: int, start: int, runs: list[Storage]) -> None:
        if not runs:
            return
        n = next(iter(runs[0].values())).shape[0]
        link = self._live()
        try:
            link.send(Import(lane, start, n, table_rows(self.chunks, self.changed)))
            send_runs(link, runs)
            self._done(link)
        except StageLinkError as e:
            raise self._drop(e) from None

    # ---- kept conversation parts (--prompt-cache) ---------------------------------
    def keep(self, part: str, lane: int, n: int, keep: list[str]) -> None:
        """The worker keeps positions [0, n) of `lane` as `part`, then drops parts not in `keep`."""
        link = self._live()
        try:
            link.send(Keep(part, lane, n, keep, table_rows(self.chunks, self.changed)))
            self._done(link)
            self.kept_parts = len(set(keep))
        except StageLinkError as e:
            raise self._drop(e) from None

    def restore(self, part: str, lane: int, n: int, keep: list[str]) -> bool:
        """Write the first n cells of `part` into `lane`; False: the worker does not hold it."""
        link = self._live()
        try:
            link.send(Restore(part, lane, n, keep, table_rows(self.chunks, self.changed)))
            found = self._done(link, missing_ok=True).error is None
            self.kept_parts = len(set(keep))
            return found
        except StageLinkError as e:
            raise self._drop(e) from None

    def fetch(self, part: str, n: int) -> list[Storage]:
        """The raw runs of the first n cells of `part`, every layer down the worker chain."""
        link = self._live()
        try:
            link.send(Fetch(part, n))
            if self._done(link, missing_ok=True).error is not None:
                raise StrataError(f"remote stage {self.address} no longer holds that conversation")
            return recv_runs(link, self.fmt, len(self.layers), n)
        except StageLinkError as e:
            raise self._drop(e) from None

    def forget(self, keep: list[str]) -> None:
        link = self._live()
        try:
            link.send(Forget(keep))
            self._done(link)
            self.kept_parts = len(set(keep))
        except StageLinkError as e:
            raise self._drop(e) from None


def hello_for(first_layer: int, identity: str, fmt: KvFormat, chunks: ChunkTables, dtype: torch.dtype,
              hidden: int, keep_max: int, batch_invariant: bool) -> Hello:
    lanes, max_context, chunk, pool_tokens = chunks.geometry()
    return Hello(PROTOCOL, identity, first_layer, fmt.name, lanes, max_context, chunk, pool_tokens,
                 str(dtype).removeprefix("torch."), hidden, keep_max, batch_invariant)
