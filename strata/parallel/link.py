"""One authenticated link between two Strata processes: typed control messages and tensors.

The handshake (`handshake.py`) runs on a TCP socket that stays open as the
control channel, so a peer that dies shows at once as end of file. Tensors go
over a two-rank torch.distributed group built for this link alone (never the
global default group: one process may hold several links), on a one-time
TCPStore the worker opens on the address the main reached it at, under a
random prefix. Gloo carries CPU tensors; when both ends have CUDA an NCCL
group on the same store carries CUDA tensors. The main is rank 0.

Refusal happens inside the handshake, before any group is formed: the
worker's `accept(refuse=...)` asks its policy once the main has proved the
key, and a reason sends an authenticated refusal that makes the main's
`connect` raise `StageLinkError("worker refused: REASON")`.

Nothing is encrypted (see `bind_notice`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import secrets
import select
import socket
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
from torch.distributed import ProcessGroupGloo

from strata.parallel import handshake
from strata.parallel.handshake import Rendezvous, StageLinkError, read_exact, send_all
from strata.parallel.messages import HEADER, MAX_MESSAGE, decode, encode, frame, frame_length

_CPU = torch.device("cpu")


class StageLinkTimeout(StageLinkError):
    """Nothing arrived within the time asked for; the link or listener is still usable."""


def _address(addr: tuple) -> str:
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _local_host(sock: socket.socket) -> str:
    """The address this end of `sock` uses, as IPv4 when a dual-stack socket shows it mapped."""
    host = sock.getsockname()[0]
    mapped = ipaddress.ip_address(host.split("%")[0])
    if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped is not None:
        return str(mapped.ipv4_mapped)
    return host


def _shut(sock: socket.socket) -> None:
    """Close `sock`, first waking a thread blocked in its recv, select or accept (close does not)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected, or already shut
    sock.close()


def _first_line(e: Exception) -> str:
    """An error from torch as one line, without the C++ source location it starts with."""
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\] ", "", line)[:300]


def _gloo_group(store: dist.Store, rank: int, local_host: str,
                timeout: timedelta) -> ProcessGroupGloo:
    """A gloo backend bound to the address this end's control socket uses (not the hostname's).

    `_Options` is torch's settings record for a backend, filled field by field (as
    `torch.distributed.new_group` fills it): the binding has no constructor that takes devices.
    """
    opts = ProcessGroupGloo._Options()
    opts._devices = [ProcessGroupGloo.create_device(hostname=local_host)]
    opts._timeout = timeout
    opts._threads = 2
    return ProcessGroupGloo(store, rank, 2, opts)


def _nccl_group(store: dist.Store, rank: int, timeout: timedelta) -> C10dBackend:
    """An NCCL backend on the same store; its communicator forms at the first send or receive."""
    from torch.distributed import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()  # torch's settings record, as for gloo above
    opts._timeout = timeout
    return ProcessGroupNCCL(store, rank, 2, opts)


class Link:
    """One end of a formed link; built by `connect` or `Listener.accept`.

    One thread may send while another receives; `timeout` bounds every tensor
    operation and every send. After a `StageLinkError` other than
    `StageLinkTimeout`, the channel it came from (messages or tensors) keeps
    raising it: close the link.
    """

    def __init__(self, sock: socket.socket, store: dist.Store, groups: dict[str, C10dBackend],
                 rank: int, tensor_device: torch.device, timeout: float, max_message: int) -> None:
        self._sock = sock
        self._store = store  # NCCL reads it when its communicator forms; it lives with the link
        self._groups = groups
        self._rank = rank
        self._timeout = timedelta(seconds=timeout)
        self._max_message = max_message
        self._send_lock = threading.Lock()
        self._message_fault: str | None = None
        self._tensor_fault: str | None = None
        self._closed = False
        self.peer = _address(sock.getpeername())
        self.tensor_device = tensor_device
        self.timeout = timeout
        self.bytes_sent = 0
        self.bytes_received = 0

    def _usable(self, fault: str | None) -> None:
        if self._closed:
            raise StageLinkError("the link is closed")
        if fault is not None:
            raise StageLinkError(fault)

    def send(self, msg: object) -> None:
        """Send one registered message."""
        self._usable(self._message_fault)
        data = frame(encode(msg), self._max_message)
        with self._send_lock:
            try:
                send_all(self._sock, data, "a message")
            except StageLinkError as e:
                self._message_fault = str(e)
                raise
            self.bytes_sent += len(data)

    def recv(self, timeout: float | None = None) -> object:
        """The next message; waits up to `timeout` seconds for it to start (None: forever).

        Raises `StageLinkTimeout` when none started (the link stays usable) and
        `StageLinkError("peer closed the link ...")` when the peer is gone.
        """
        self._usable(self._message_fault)
        try:
            ready, _, _ = select.select([self._sock], [], [], timeout)
        except (OSError, ValueError):
            raise StageLinkError("the link is closed") from None
        if not ready:
            raise StageLinkTimeout(f"no message from {self.peer} within {timeout:g} s")
        try:
            n = frame_length(read_exact(self._sock, HEADER.size, "a message"), self._max_message)
            data = read_exact(self._sock, n, "a message")
        except StageLinkError as e:
            self._message_fault = str(e)
            raise
        self.bytes_received += HEADER.size + n
        return decode(data)

    def _group(self, device: torch.device) -> C10dBackend:
        kind = "nccl" if device.type == "cuda" else "gloo"
        if kind not in self._groups:
            raise StageLinkError(f"tensors on {device} cannot travel this link (it carries "
                                 f"{self.tensor_device.type} tensors)")
        return self._groups[kind]

    def _run(self, op: Callable[[], dist.Work], what: str) -> None:
        """Start a send or receive and wait for it, at most `timeout`; a failure sticks."""
        try:
            done = op().wait(self._timeout)
        except RuntimeError as e:  # gloo raises at once when it sees the peer's socket close
            done, detail = False, _first_line(e)
        else:
            detail = f"timed out after {self.timeout:g} s"
        if not done:
            self._tensor_fault = f"{what} {self.peer} failed: {detail}"
            raise StageLinkError(self._tensor_fault)

    def send_tensor(self, t: torch.Tensor) -> None:
        """Send a tensor; the peer must `recv_tensor` the same shape and dtype."""
        self._usable(self._tensor_fault)
        t = t.contiguous()
        group = self._group(t.device)
        self._run(lambda: group.send([t], 1 - self._rank, 0), "sending a tensor to")
        self.bytes_sent += t.numel() * t.element_size()

    def recv_tensor(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
                    device: torch.device | None = None) -> torch.Tensor:
        """Receive a tensor of this shape and dtype onto `device` (default: `tensor_device`)."""
        self._usable(self._tensor_fault)
        t = torch.empty(shape, dtype=dtype, device=device or self.tensor_device)
        group = self._group(t.device)
        self._run(lambda: group.recv([t], 1 - self._rank, 0), "receiving a tensor from")
        self.bytes_received += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        """Shut the groups down and close the socket (the peer sees end of file); idempotent."""
        if self._closed:
            return
        self._closed = True
        healthy = self._message_fault is None and self._tensor_fault is None
        for group in self._groups.values():
            try:  # abort does not wait for operations a dead peer will never finish
                group.shutdown() if healthy else group.abort()
            except RuntimeError:
                pass  # a group whose peer is gone may fail to shut down; it is dropped either way
        self._groups = {}
        self._store = None
        _shut(self._sock)

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def gpu_id(device: torch.device) -> bytes | None:
    """16 bytes naming the physical GPU of a CUDA device (None for the CPU)."""
    if device.type != "cuda":
        return None
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return hashlib.sha256(uuid.encode()).digest()[: handshake.GPU_ID_BYTES]


def _form(sock: socket.socket, store: dist.Store, rendezvous: Rendezvous, rank: int,
          device: torch.device, timeout: float, max_message: int) -> Link:
    """Both ends: the link's groups on the rendezvous (this blocks until the peer joins)."""
    span = timedelta(seconds=timeout)
    local_host = _local_host(sock)
    try:
        groups: dict[str, C10dBackend] = {"gloo": _gloo_group(
            dist.PrefixStore(f"{rendezvous.token}/gloo", store), rank, local_host, span)}
        if rendezvous.cuda:
            groups["nccl"] = _nccl_group(
                dist.PrefixStore(f"{rendezvous.token}/nccl", store), rank, span)
    except RuntimeError as e:
        raise StageLinkError(f"forming the process group failed: {_first_line(e)}") from None
    tensor_device = device if rendezvous.cuda else _CPU
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # messages are small and awaited
    return Link(sock, store, groups, rank, tensor_device, timeout, max_message)


def connect(host: str, port: int, key: bytes, timeout: float = 10.0,
            device: str | torch.device = "cpu", max_message: int = MAX_MESSAGE) -> Link:
    """Main side: reach a worker, run the handshake, form the groups (rank 0).

    `device` is where this end's hidden states live; CUDA tensors travel by
    NCCL only when the worker's device is CUDA too (`Link.tensor_device`).
    """
    where = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout)
    except TimeoutError:
        raise StageLinkError(f"{where}: timed out connecting") from None
    except OSError as e:
        raise StageLinkError(f"{where}: cannot connect: {e.strerror or e}") from None
    try:
        rendezvous = handshake.main_handshake(sock, key, gpu_id(torch.device(device)))
        try:
            store = dist.TCPStore(sock.getpeername()[0], rendezvous.port, 2, False,
                                  timedelta(seconds=timeout))
        except RuntimeError as e:
            raise StageLinkError(f"cannot reach the worker's store: {_first_line(e)}") from None
        return _form(sock, store, rendezvous, 0, torch.device(device), timeout, max_message)
    except StageLinkError as e:
        sock.close()
        raise StageLinkError(f"{where}: {e}") from None


def _open_store(host: str, timeout: float) -> tuple[dist.TCPStore, int]:
    """A one-time TCPStore (world size 2) listening only on `host`, on a free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, 0), family=family)
    port = listener.getsockname()[1]
    fd = listener.detach()  # the store owns the socket from here on
    try:
        store = dist.TCPStore(host, port, 2, True, timedelta(seconds=timeout),
                              wait_for_workers=False, master_listen_fd=fd)
    except RuntimeError as e:
        os.close(fd)
        raise StageLinkError(f"cannot open the rendezvous store: {_first_line(e)}") from None
    return store, port


class Listener:
    """Worker side: a bound socket that admits one authenticated main per `accept`."""

    def __init__(self, host: str, port: int, key: bytes, timeout: float = 10.0,
                 device: str | torch.device = "cpu", max_message: int = MAX_MESSAGE) -> None:
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            dualstack = host == "::" and socket.has_dualstack_ipv6()  # "::" means IPv4 too
            self._sock = socket.create_server((host, port), family=family,
                                              dualstack_ipv6=dualstack)
        except OSError as e:
            raise StageLinkError(f"{host}:{port}: cannot listen: {e.strerror or e}") from None
        self._key = key
        self._device = torch.device(device)
        self._max_message = max_message
        self.timeout = timeout
        self.port: int = self._sock.getsockname()[1]

    def accept(self, timeout: float | None = None,
               refuse: Callable[[], str | None] | None = None) -> Link:
        """The next main that proves the key, with the link formed (rank 1).

        Waits up to `timeout` for a connection (None: forever; then
        `StageLinkTimeout`). Once the main has proved the key, `refuse()` is
        asked; a reason turns it away and raises. A failed handshake raises
        `StageLinkError` naming the peer; the listener stays usable either way.
        """
        self._sock.settimeout(timeout)
        try:
            conn, addr = self._sock.accept()
        except TimeoutError:
            raise StageLinkTimeout(f"no connection within {timeout:g} s") from None
        except OSError:
            raise StageLinkError("the listener is closed") from None
        conn.settimeout(self.timeout)
        try:
            return self._admit(conn, refuse)
        except StageLinkError as e:
            conn.close()
            raise StageLinkError(f"{_address(addr)}: {e}") from None

    def _admit(self, conn: socket.socket, refuse: Callable[[], str | None] | None) -> Link:
        nonce_w = handshake.greet(conn)
        nonce_m, main_gpu = handshake.check_main(conn, self._key, nonce_w)
        reason = refuse() if refuse is not None else None
        if reason is not None:
            handshake.answer(conn, self._key, nonce_w, nonce_m, handshake.refuse_body(reason))
            raise StageLinkError(f"refused: {reason}")
        mine = gpu_id(self._device)
        # NCCL between two GPUs; two processes on one GPU (or a CPU end) pass tensors by gloo
        cuda = mine is not None and main_gpu is not None and main_gpu != mine
        store, port = _open_store(_local_host(conn), self.timeout)
        rendezvous = Rendezvous(port, secrets.token_hex(handshake.TOKEN_BYTES), cuda)
        handshake.answer(conn, self._key, nonce_w, nonce_m,
                         handshake.accept_body(rendezvous, cuda))
        return _form(conn, store, rendezvous, 1, self._device, self.timeout, self._max_message)

    def close(self) -> None:
        """Stop listening; a thread waiting in `accept` gets `StageLinkError`."""
        _shut(self._sock)

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bind_notice(host: str) -> str | None:
    """None for a loopback bind; otherwise the warning to print: the link is not encrypted."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return None
    return (f"warning: the stage link listens on {host or 'every interface'}. Its handshake "
            "authenticates both ends with the shared key, but nothing is encrypted: control "
            "messages and tensor traffic (torch.distributed) travel in the clear, as in vLLM's "
            "multi-node setup. Use a private network or a tunnel (SSH, WireGuard).")
