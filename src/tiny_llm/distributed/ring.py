"""The ranks meet: every rank checks its ring connections itself before MLX's ring is built (a
busy port, an address that is not the machine's or a host that does not answer fails within
seconds, naming it), then rank 0 and each worker share a TCP connection of their own
(``Channel``) for the steps, which MLX's ring would poll with a busy core while idle.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import secrets
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any

from tiny_llm.tensor_parallel import TensorParallelError

import mlx.core as mx
import numpy as np

CONNECT_TIMEOUT = 30.0  # seconds every rank has to show up at start-up (as MLX's ring)
REACH_TIMEOUT = 5.0  # seconds a host has to answer a connection (a live one answers at once)
RETRY_WAIT = 0.2  # seconds between connections to a port nothing listens on yet
HELLO_TIMEOUT = 10.0  # seconds a new connection has to name itself
HELLO_BYTES = 4096  # the longest greeting read from a connection not yet trusted


@functools.cache
def join(size: int) -> Ranks:
    """This process's place among ``size`` ranks started by ``mlx.launch``, connected to
    rank 0 (rank 0: connected to every worker), the ring's connections checked before MLX
    makes them. Once per process."""
    if "MLX_RANK" not in os.environ:
        raise ValueError(
            f"tensor_parallel_size={size} runs one process per rank: start them with "
            f"`tiny-llm launch -n {size} -- <this command>` (several machines: "
            f"--hostfile; see the book's 'Beyond one machine')")
    nodes = _ring_nodes()
    if len(nodes) != size:
        raise ValueError(f"tensor_parallel_size={size}, but mlx.launch started "
                         f"{len(nodes)} processes")
    rank = int(os.environ["MLX_RANK"])
    if not 0 <= rank < size:
        raise ValueError(f"MLX_RANK={rank}, but the hostfile names {size} ranks")
    _meet(rank, nodes)
    try:
        group = mx.distributed.init(strict=True, backend="ring")
    except RuntimeError as e:
        if not ring_failed(e):
            raise
        raise TensorParallelError(f"rank {rank} could not join the ring ({e}); its "
                                  f"addresses: {_addresses(nodes[rank])}") from None
    return Ranks(group, _connect(group, nodes[0][0][0]))


def ring_failed(e: BaseException) -> bool:
    """Whether ``e`` is a failure of MLX's ring backend (a peer lost, a socket that could not
    bind or connect). MLX raises these as a plain RuntimeError whose message starts with the
    backend's tag, ``[ring]``: it has no exception type of its own to catch."""
    return isinstance(e, RuntimeError) and str(e).startswith("[ring]")


def _ring_nodes() -> list[list[tuple[str, int]]]:
    """Every rank's ring addresses, ``(host, port)``, from the hostfile ``mlx.launch`` wrote
    (``MLX_HOSTFILE``: a JSON list of each rank's ``"ip:port"`` strings, empty for one
    process)."""
    path = os.environ.get("MLX_HOSTFILE")
    if not path:
        raise ValueError("MLX_RANK is set but MLX_HOSTFILE is not: start the ranks with "
                         "`tiny-llm launch`")
    with open(path) as f:
        text = f.read().strip()
    if not text:
        return [[]]
    return [[(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in node]
            for node in json.loads(text)]


def _addresses(node: list[tuple[str, int]]) -> str:
    return ", ".join(f"{host}:{port}" for host, port in node)


def _meet(rank: int, nodes: list[list[tuple[str, int]]]) -> None:
    """Check the ring's connections before MLX makes them, so that a wrong address or a busy
    port fails within seconds with a message naming it. MLX's ring (``mx.distributed.init``,
    which holds the GIL throughout) would block in ``accept`` until its left neighbour
    connects, retry a refused or unanswered connection for about 30 s, and name a busy port
    by its errno only. Here every rank listens on its own addresses, connects to its right
    neighbour's and says who it is; once a rank has closed its listeners it tells its left
    neighbour, which only then goes on to MLX's ring, whose connections therefore never
    reach one of these listeners."""
    size = len(nodes)
    left, right = (rank - 1) % size, (rank + 1) % size
    deadline = time.monotonic() + CONNECT_TIMEOUT
    listeners = [_listen(rank, address) for address in nodes[rank]]
    channels: list[Channel] = []
    try:
        outgoing = []
        for address in nodes[right]:
            outgoing.append(_reach(rank, right, address, deadline))
            channels.append(outgoing[-1])
        incoming = []
        for listener, address in zip(listeners, nodes[rank], strict=True):
            incoming.append(_accept_neighbour(listener, rank, left, address, deadline))
            channels.append(incoming[-1])
            listener.close()
        for channel in incoming:
            channel.send({"ring": "listeners closed"})
        for channel, (host, port) in zip(outgoing, nodes[right], strict=True):
            if _greeting(channel.sock, deadline) != {"ring": "listeners closed"}:
                raise TensorParallelError(
                    f"rank {rank}: {host}:{port}, rank {right}'s address in the hostfile, took "
                    f"the connection but did not answer as rank {right} of this launch within "
                    f"{CONNECT_TIMEOUT:g} s (another program on that port?)")
    finally:
        for s in listeners + [c.sock for c in channels]:
            s.close()


def _listen(rank: int, address: tuple[str, int]) -> socket.socket:
    host, port = address
    try:
        return socket.create_server(address)  # SO_REUSEADDR, as MLX's ring binds
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            why = ("the port is in use (an earlier launch still running, or another program): "
                   "end it, or start the ranks on other ports (tiny-llm launch --starting-port)")
        elif e.errno == errno.EADDRNOTAVAIL:
            why = (f"{host} is not an address of this machine: correct this host's ips in the "
                   f"hostfile")
        else:
            why = e.strerror
        raise TensorParallelError(f"rank {rank} cannot listen on {host}:{port}, its address "
                                  f"in the hostfile: {why}") from None


def _reach(rank: int, right: int, address: tuple[str, int], deadline: float) -> Channel:
    """A connection to rank ``right``'s address, on which this rank names itself. Refused
    means nothing listens there yet: tried again until the deadline, with a word on stderr
    after ``REACH_TIMEOUT`` seconds. No answer (a host that drops the packets) or no route
    fails at once."""
    host, port = address
    what = f"rank {rank} cannot reach rank {right} at {host}:{port}, its address in the hostfile"
    check = f"is rank {right} running, and is that its address?"
    noted = time.monotonic() + REACH_TIMEOUT
    while True:
        wait = min(REACH_TIMEOUT, _left(deadline))
        try:
            sock = socket.create_connection(address, timeout=wait)
        except ConnectionRefusedError:
            if _left(deadline) <= RETRY_WAIT:
                raise TensorParallelError(f"{what}: the connection was refused for "
                                          f"{CONNECT_TIMEOUT:g} s: {check}") from None
            if noted is not None and time.monotonic() > noted:
                say(f"{what}, yet: the connection is refused ({check}); trying for "
                     f"{deadline - time.monotonic():.0f} s more")
                noted = None
            time.sleep(RETRY_WAIT)
            continue
        except TimeoutError:
            raise TensorParallelError(f"{what}: no answer within {wait:.1f} s: is that host "
                                      f"up, and does a firewall let port {port} through?") from None
        except OSError as e:
            raise TensorParallelError(f"{what}: {e.strerror}") from None
        sock.settimeout(None)
        channel = Channel(sock)
        channel.send({"ring": rank})
        return channel


def _accept_neighbour(listener: socket.socket, rank: int, left: int, address: tuple[str, int],
                      deadline: float) -> Channel:
    """The connection on which rank ``left`` names itself (others are closed: strangers, or
    a connection of an earlier launch still retrying)."""
    while True:
        listener.settimeout(_left(deadline))
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            host, port = address
            raise TensorParallelError(
                f"rank {rank}: rank {left} did not connect to {host}:{port} within "
                f"{CONNECT_TIMEOUT:g} s: is it running, and can it reach this host?") from None
        if _greeting(sock, min(deadline, time.monotonic() + HELLO_TIMEOUT)) == {"ring": left}:
            return Channel(sock)
        sock.close()


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (never zero: a zero timeout would make a socket
    non-blocking)."""
    return max(1e-3, deadline - time.monotonic())


@dataclass
class Ranks:
    group: mx.distributed.Group
    channels: dict[int, Channel]  # rank 0: one per worker; a worker: {0: rank 0}

    @property
    def rank(self) -> int:
        return self.group.rank()


def _connect(group: mx.distributed.Group, host: str) -> dict[int, Channel]:
    """Rank 0 listens on an ephemeral port of ``host``, the address ``mlx.launch`` gave it,
    and tells the workers the port and a one-time token through one collective; each worker
    connects and names itself."""
    rank, size = group.rank(), group.size()
    listener = None
    word = np.zeros(4, np.int32)
    if rank == 0:
        listener = socket.create_server((host, 0))
        word = np.array([listener.getsockname()[1], *np.frombuffer(secrets.token_bytes(12),
                                                                   np.int32)], np.int32)
    word = np.array(mx.distributed.all_sum(mx.array(word), group=group, stream=mx.cpu))
    port, token = int(word[0]), word[1:].tobytes().hex()
    if rank != 0:
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
        sock.settimeout(None)
        channel = Channel(sock)
        channel.send({"rank": rank, "token": token})
        return {0: channel}
    channels: dict[int, Channel] = {}
    deadline = time.monotonic() + CONNECT_TIMEOUT
    try:
        while len(channels) < size - 1:
            listener.settimeout(_left(deadline))
            sock, _ = listener.accept()
            rank_of = _hello(sock, token, size)
            if rank_of is None or rank_of in channels:  # not one of ours: closed, not trusted
                sock.close()
                continue
            channels[rank_of] = Channel(sock)
    except TimeoutError:
        missing = sorted(set(range(1, size)) - set(channels))
        raise TensorParallelError(f"worker rank(s) {missing} did not connect to rank 0 "
                                  f"within {CONNECT_TIMEOUT:g} s") from None
    finally:
        listener.close()
    return channels


def _hello(sock: socket.socket, token: str, size: int) -> int | None:
    """The worker rank a new connection names with the right token, else None (a stranger,
    a silent peer or a malformed greeting)."""
    hello = _greeting(sock, time.monotonic() + HELLO_TIMEOUT)
    if hello is None or hello.get("token") != token:
        return None
    rank = hello.get("rank")
    return rank if isinstance(rank, int) and 0 < rank < size else None


def _greeting(sock: socket.socket, deadline: float) -> dict[str, Any] | None:
    """The first message on a connection not yet trusted, if it comes before ``deadline``
    and is a short JSON object in our framing; else None."""
    sock.settimeout(_left(deadline))
    try:
        hello, _ = Channel(sock).receive(limit=HELLO_BYTES)
    except (ValueError, TypeError, KeyError, AttributeError, struct.error):  # not our framing
        return None
    sock.settimeout(None)
    return hello if isinstance(hello, dict) else None


class Channel:
    """One TCP connection between rank 0 and a worker. A message is a JSON header and
    any number of numpy arrays (their dtypes and shapes in the header), length-prefixed."""

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock

    def send(self, header: dict[str, Any], arrays: list[np.ndarray] = ()) -> None:
        arrays = [np.ascontiguousarray(a) for a in arrays]
        head = json.dumps({**header, "_arrays": [(a.dtype.str, a.shape) for a in arrays]})
        payload = b"".join([head.encode(), *(a.tobytes() for a in arrays)])
        self.sock.sendall(struct.pack("!QI", len(payload), len(head.encode())) + payload)

    def receive(self, limit: int | None = None
                ) -> tuple[dict[str, Any], list[np.ndarray]] | tuple[None, None]:
        """The next message, or ``(None, None)`` once the other side has closed (or gone
        silent past the socket's timeout); ValueError for one longer than ``limit``."""
        prefix = self._read(12)
        if prefix is None:
            return None, None
        total, head_len = struct.unpack("!QI", prefix)
        if limit is not None and total > limit:
            raise ValueError(f"a message of {total} bytes, more than {limit}")
        payload = self._read(total)
        if payload is None:
            return None, None
        header = json.loads(payload[:head_len])
        arrays, offset = [], head_len
        for dtype, shape in header.pop("_arrays"):
            a = np.frombuffer(payload, np.dtype(dtype), int(np.prod(shape)), offset)
            arrays.append(a.reshape(shape))
            offset += arrays[-1].nbytes
        return header, arrays

    def _read(self, n: int) -> bytes | None:
        chunks, left = [], n
        while left:
            try:
                chunk = self.sock.recv(min(left, 1 << 20))
            except (ConnectionError, OSError):
                return None
            if not chunk:
                return None
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)


def say(message: str) -> None:
    sys.stderr.write(f"tiny-llm: {message}\n")
    sys.stderr.flush()
