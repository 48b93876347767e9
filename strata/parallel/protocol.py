"""The messages a main and a remote stage exchange, and the protocol version.

After the link's handshake (`handshake.py`) the main sends `Hello`; the
worker answers `Welcome` or `Refusal` (other protocol, other model, more
pool than it can hold). Then each operation is one message from the main,
the tensors it announces, and one reply (`Done`, then the tensors it
announces). Every message that touches cells carries the chunk-table rows
that changed since the main's last message (`rows`: `[lane, reserved,
*row]`), so the worker's tables mirror the main's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kv.formats import KvFormat, Storage
from strata.kv.tables import ChunkTables
from strata.parallel.link import Link
from strata.parallel.messages import message

PROTOCOL = 3  # 3: a step says which sequences are prompt pieces and which drafted runs


@message("hello")
@dataclass(frozen=True)
class Hello:
    protocol: int
    model: str  # the model's identity (the tensor hash session files use)
    first_layer: int  # the worker runs layers [first_layer, its model's last)
    kv_format: str
    lanes: int
    max_context: int
    chunk: int
    pool_tokens: int | None
    dtype: str  # of the hidden states
    hidden: int
    keep_max: int  # conversation parts the worker is asked to keep (--prompt-cache); 0: none
    batch_invariant: bool  # the worker's products as the main's (`DecoderModel.set_batch_invariant`)


@message("welcome")
@dataclass(frozen=True)
class Welcome:
    protocol: int
    num_layers: int  # the model's; the worker chain runs [first_layer, num_layers)
    stages: list  # per stage down the chain: {"layers": [a, b], "device": ..., "kv_bytes": ...}


@message("refusal")
@dataclass(frozen=True)
class Refusal:
    reason: str


@message("step")
@dataclass(frozen=True)
class Step:
    """The step's sequences; the hidden states [tokens, hidden] follow as a tensor."""

    lanes: list
    starts: list
    ns: list
    rows: list
    prompt: list  # per sequence: a prompt piece (`SeqSpec.prompt`: prompt rows even when one long)
    drafted: list  # per sequence: a drafted run (`SeqSpec.drafted`: every token a decode row)


@message("export")
@dataclass(frozen=True)
class Export:
    """Send back the raw runs of positions [start, end) of a lane, layer by layer, run by run."""

    lane: int
    start: int
    end: int
    rows: list


@message("import")
@dataclass(frozen=True)
class Import:
    """Write the n cells of raw runs that follow (layer by layer, run by run) from `start` on."""

    lane: int
    start: int
    n: int
    rows: list


@message("keep")
@dataclass(frozen=True)
class Keep:
    """Keep positions [0, n) of a lane as part `part` (a parked conversation's worker side), then
    drop every part not in `keep`."""

    part: str
    lane: int
    n: int
    keep: list
    rows: list


@message("restore")
@dataclass(frozen=True)
class Restore:
    """Write the first n cells of part `part` into a lane; `Done.error` is MISSING if it is gone."""

    part: str
    lane: int
    n: int
    keep: list
    rows: list


@message("fetch")
@dataclass(frozen=True)
class Fetch:
    """Send back the first n cells of part `part` as raw runs (a session file of a parked one)."""

    part: str
    n: int


@message("forget")
@dataclass(frozen=True)
class Forget:
    """Drop every part not in `keep`."""

    keep: list


MISSING = "no such part"  # the error a worker answers for a part it does not hold


@message("done")
@dataclass(frozen=True)
class Done:
    """The reply to an operation; on success the tensors it returns follow."""

    error: str | None
    seconds: float  # the worker chain's time on the operation


def table_rows(chunks: ChunkTables, changed: set[int]) -> list:
    """The rows of the lanes in `changed` (then emptied), as `[lane, reserved, *row]` lists."""
    rows = [[lane, chunks.reserved[lane], *chunks.tables[lane].tolist()] for lane in sorted(changed)]
    changed.clear()
    return rows


def apply_rows(chunks: ChunkTables, rows: list) -> None:
    """Mirror rows sent by `table_rows` (a bad row raises ValueError)."""
    for lane, reserved, *row in rows:
        if not 0 <= lane < chunks.num_lanes:
            raise ValueError(f"a table row for lane {lane} of {chunks.num_lanes}")
        chunks.set_row(lane, row, reserved)


def send_runs(link: Link, runs: list[Storage]) -> None:
    """Raw runs of several layers, each run a tensor, in the format's run order."""
    for st in runs:
        for t in st.values():
            link.send_tensor(t.contiguous())


def recv_runs(link: Link, fmt: KvFormat, n_layers: int, n: int) -> list[Storage]:
    """What `send_runs` sent: n cells of `n_layers` layers of format `fmt`, on the CPU."""
    return [{r.name: link.recv_tensor((n, *r.shape), r.dtype, torch.device("cpu")) for r in fmt.runs()}
            for _ in range(n_layers)]
