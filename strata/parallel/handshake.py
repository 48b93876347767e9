"""The stage link's shared key and its mutual HMAC-SHA256 handshake over one TCP socket.

Neither end reads anything but fixed-size handshake fields from the other until
the other has proved the key, and both ends mix a fresh nonce of their own into
the proof they check, so a recorded handshake replayed on a new connection
fails. The flow, worker first (it is the one listening):

    worker: MAGIC + VERSION + nonce_w
    main:   nonce_m + flags_m + HMAC(key, "strata-main" + nonce_w + nonce_m + flags_m)
    worker: b"K" and close when that proof is wrong, else a verdict body
            (b"A" + flags_w + store port + token, or b"R" + reason)
            + HMAC(key, "strata-worker" + nonce_m + nonce_w + body)

The verdict's MAC proves the worker to the main and covers the rendezvous (or
the refusal), so nobody without the key can redirect the main's process group.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
from dataclasses import dataclass

from strata.errors import StrataError

MAGIC = b"STRATA-STAGE"
VERSION = 1
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
MIN_KEY_BYTES = 16
TOKEN_BYTES = 16
CUDA_FLAG = 1
GPU_ID_BYTES = 16  # which GPU the main computes on: NCCL needs the two ends on different ones
ACCEPTED, REFUSED, BAD_KEY = b"A", b"R", b"K"
_ACCEPT_BODY = struct.Struct(">BH16s")  # flags, store port, token (after the b"A")
_MAX_REASON_BYTES = 255


class StageLinkError(StrataError):
    """The link to a stage peer failed or was refused; the message is one line saying why."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the two ends form their process groups: the worker's store port and a one-time prefix.

    `cuda` is true when both ends said they have CUDA, so an NCCL group is formed too.
    """

    port: int
    token: str
    cuda: bool


def read_key(path: str) -> bytes:
    """The key file's bytes, stripped: an editor's trailing newline is not part of the key."""
    try:
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as e:
        raise StageLinkError(f"{path}: cannot read the stage key file: {e.strerror or e}") from None
    if len(key) < MIN_KEY_BYTES:
        raise StageLinkError(
            f"{path}: the stage key is {len(key)} bytes, it needs at least {MIN_KEY_BYTES}")
    return key


def read_exact(sock: socket.socket, n: int, what: str) -> bytes:
    """Exactly `n` bytes within the socket's timeout; `what` names them in the error."""
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            raise StageLinkError(f"timed out waiting for {what}") from None
        except ConnectionError:
            chunk = b""
        except OSError as e:
            raise StageLinkError(f"reading {what} failed: {e.strerror or e}") from None
        if not chunk:
            raise StageLinkError(f"peer closed the link while sending {what}")
        buf += chunk
    return bytes(buf)


def send_all(sock: socket.socket, data: bytes, what: str) -> None:
    """`sock.sendall` with the link's errors: a timeout or a closed peer, named."""
    try:
        sock.sendall(data)
    except TimeoutError:
        raise StageLinkError(f"timed out sending {what}") from None
    except ConnectionError:
        raise StageLinkError(f"peer closed the link before taking {what}") from None
    except OSError as e:
        raise StageLinkError(f"sending {what} failed: {e.strerror or e}") from None


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def greet(sock: socket.socket) -> bytes:
    """Worker, first step: announce the protocol and a fresh challenge; returns the nonce."""
    nonce_w = secrets.token_bytes(NONCE_BYTES)
    send_all(sock, MAGIC + bytes([VERSION]) + nonce_w, "the greeting")
    return nonce_w


def check_main(sock: socket.socket, key: bytes, nonce_w: bytes) -> tuple[bytes, bytes | None]:
    """Worker, second step: the main's nonce and its GPU's id (None: no CUDA), once its proof
    checks out.

    A wrong proof gets one unauthenticated byte back (so the main can say
    "wrong key" rather than "closed") and raises.
    """
    reply = read_exact(sock, NONCE_BYTES + 1 + GPU_ID_BYTES + MAC_BYTES, "the main's proof of the key")
    nonce_m, flags, proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:-MAC_BYTES], reply[-MAC_BYTES:]
    if not hmac.compare_digest(proof, _mac(key, b"strata-main", nonce_w, nonce_m, flags)):
        try:
            sock.sendall(BAD_KEY)
        except OSError:
            pass
        raise StageLinkError("wrong key: the main did not prove the shared key")
    return nonce_m, flags[1:] if flags[0] & CUDA_FLAG else None


def accept_body(rendezvous: Rendezvous, cuda: bool) -> bytes:
    """The verdict that admits the main: this end's flags and the rendezvous."""
    return ACCEPTED + _ACCEPT_BODY.pack(
        CUDA_FLAG if cuda else 0, rendezvous.port, bytes.fromhex(rendezvous.token))


def refuse_body(reason: str) -> bytes:
    """The verdict that turns the main away, with a reason cut to 255 bytes of UTF-8."""
    text = reason.encode()[:_MAX_REASON_BYTES]
    return REFUSED + bytes([len(text)]) + text


def answer(sock: socket.socket, key: bytes, nonce_w: bytes, nonce_m: bytes, body: bytes) -> None:
    """Worker, last step: the verdict, with the worker's proof of the key covering it."""
    send_all(sock, body + _mac(key, b"strata-worker", nonce_m, nonce_w, body), "the verdict")


def main_handshake(sock: socket.socket, key: bytes, gpu: bytes | None) -> Rendezvous:
    """Main side, whole: prove the key, check the worker's proof, return where to form the groups.

    Raises `StageLinkError` for a peer that is not a Strata stage, a wrong key
    on either side, a refusal (`worker refused: REASON`) or a timeout.
    """
    if read_exact(sock, len(MAGIC), "the worker's greeting") != MAGIC:
        raise StageLinkError("not a Strata stage (the peer's greeting is wrong)")
    version = read_exact(sock, 1, "the worker's protocol version")[0]
    if version != VERSION:
        raise StageLinkError(
            f"the worker speaks stage handshake version {version}, this side speaks {VERSION}")
    nonce_w = read_exact(sock, NONCE_BYTES, "the worker's challenge")
    nonce_m = secrets.token_bytes(NONCE_BYTES)
    if gpu is not None and len(gpu) != GPU_ID_BYTES:
        raise ValueError(f"a GPU id is {GPU_ID_BYTES} bytes")
    flags = bytes([CUDA_FLAG if gpu is not None else 0]) + (gpu or bytes(GPU_ID_BYTES))
    send_all(sock, nonce_m + flags + _mac(key, b"strata-main", nonce_w, nonce_m, flags),
             "the proof of the key")
    kind = read_exact(sock, 1, "the worker's verdict")
    if kind == BAD_KEY:
        raise StageLinkError("wrong key: the worker rejected this side's key")
    if kind == ACCEPTED:
        rest = read_exact(sock, _ACCEPT_BODY.size, "the rendezvous")
    elif kind == REFUSED:
        size = read_exact(sock, 1, "the refusal")
        rest = size + read_exact(sock, size[0], "the refusal's reason")
    else:
        raise StageLinkError("not a Strata stage (unexpected verdict)")
    body = kind + rest
    proof = read_exact(sock, MAC_BYTES, "the worker's proof of the key")
    if not hmac.compare_digest(proof, _mac(key, b"strata-worker", nonce_m, nonce_w, body)):
        raise StageLinkError("wrong key: the worker did not prove the shared key")
    if kind == REFUSED:
        raise StageLinkError(f"worker refused: {rest[1:].decode(errors='replace')}")
    worker_flags, port, token = _ACCEPT_BODY.unpack(rest)
    return Rendezvous(port, token.hex(), gpu is not None and bool(worker_flags & CUDA_FLAG))
