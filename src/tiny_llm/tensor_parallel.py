"""Beyond one machine: tensor parallelism over ``mx.distributed``.

A model too large for one machine is split across ``N`` processes (ranks), one per
machine, each holding ``1/N`` of every layer. The split is Megatron's, two all-reduces
per layer:

- **Attention by KV-head groups.** Rank ``r`` holds KV heads ``r*Hkv/N .. (r+1)*Hkv/N - 1``
  and the query heads that read them: the output rows of q, k and v ("column" shards) and
  the matching input columns of o_proj ("row" shards). Its attention is complete for its
  heads; its o_proj product is a partial sum of the layer's output.
- **The feed-forward by its intermediate dimension**: gate and up by rows, down by
  columns. A Mixture-of-Experts layer splits every expert the same way and keeps the
  router whole on every rank: each rank routes every token as the others do, no token
  moves between ranks, and the work is equal by construction (experts placed on ranks
  would need an all-to-all of token rows and would idle the ranks whose experts are cold).
- **The embedding and the LM head stay whole**: a lookup is cheap, and only rank 0 needs
  logits (it samples), so the other ranks skip the head's work (an untied head's weights
  stay in every rank's memory).

The partial sums meet in ``all_reduce``: every rank gathers every rank's partial and adds
them in rank order. MLX's ring ``all_sum`` adds chunk by chunk in an order that depends
on the array's length, so with three ranks or more a row's bits would depend on how many
rows share the step; gathered and added in rank order, a row's sum depends only on that
row, the engine's batch invariance survives, and every rank holds the same bits.

**One scheduler, many workers.** Rank 0 runs the whole engine (scheduler, block manager,
tokenizer, sampler, server). Each step it sends the step's layout (``StepBatch``: token
ids, positions, block tables, slot mapping) to every other rank, and every rank runs the
forward on its shard; the collectives inside keep them in step. Every rank's page pool
has the same pages, holding its own KV heads only, so the block tables rank 0 writes mean
the same on every rank, and a rank's pool holds ``N`` times the tokens of one machine's
pool of the same bytes. Prefix caching, chunked prefill, preemption, speculation and
aborts are rank 0's bookkeeping and work unchanged. The steps travel over a TCP
connection of their own, not over ``mx.distributed``: the ring backend polls its sockets
while it waits, which would keep a core busy on every worker for as long as the engine
is idle.

**Faults.** A worker that dies closes its connection: rank 0's step fails with
``TensorParallelError`` naming it (a server answers 503), and rank 0 exits a moment later,
idle or not, since it cannot serve without that shard. A step that does not finish within
``tensor_parallel_timeout`` seconds (a rank hung or stopped; the time counts from the send)
ends rank 0 with that error on stderr, since its main thread is blocked inside a
collective. A step that fails on rank 0 after it was sent leaves every later step failing:
the ranks may be in different collectives. A worker whose rank 0 has gone exits; workers
ignore Ctrl-C. Options and the model's geometry are checked on every rank, with the same
error on each, before the weights of a safetensors checkpoint are read (a GGUF file is read
whole first: MLX loads its tensors eagerly, so a model too large for one machine must come
as safetensors). Each worker checks that its own memory holds rank 0's page count before
allocating its pool.

**The launch.** ``tiny-llm launch`` runs ``mlx.launch`` and exits non-zero when a rank
failed (mlx.launch itself exits 0 whatever its ranks did). mlx.launch ends the other ranks
with SIGTERM once one exits: rank 0 then reports a lost worker and exits 1. Before MLX's
ring is built, the ranks check its connections themselves (``_meet``), so that a busy port,
an address that is not the machine's or a host that does not answer fails within seconds
with a message naming it.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import secrets
import select
import signal
import socket
import struct
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from math import gcd
from typing import Any

from tiny_llm.day3_paged_kv import MAX_POOL_FRACTION, available_memory
from tiny_llm.models.model import MLP, Model, ModelConfig
from tiny_llm.moe import SparseMoeBlock
from tiny_llm.step.batch import PagedLayout, ScheduledChunk, StepBatch

import mlx.core as mx
import mlx.nn as nn
import numpy as np

CONNECT_TIMEOUT = 30.0  # seconds every rank has to show up at start-up (as MLX's ring)
REACH_TIMEOUT = 5.0  # seconds a host has to answer a connection (a live one answers at once)
RETRY_WAIT = 0.2  # seconds between connections to a port nothing listens on yet
HELLO_TIMEOUT = 10.0  # seconds a new connection has to name itself
HELLO_BYTES = 4096  # the longest greeting read from a connection not yet trusted
EXIT_GRACE = 2.0  # seconds between finding a rank gone and ending this one
LOST_WAIT = 1.0  # seconds rank 0 waits, on a sign of a lost worker, for its connection to close
STOP_TIMEOUT = 10.0  # seconds rank 0 waits, at its end, for the workers to exit


class TensorParallelError(RuntimeError):
    """The ranks can no longer serve together (a worker died, or rank 0 went away)."""


# ANCHOR: tp_geometry
def valid_sizes(config: ModelConfig) -> list[int]:
    """The tensor-parallel sizes that split this model evenly: divisors of every head
    count and every feed-forward width."""
    common = 0
    for n in (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size,
              config.moe_intermediate_size, config.shared_expert_intermediate_size):
        common = gcd(common, n)
    return [d for d in range(1, common + 1) if common % d == 0]


def check_tensor_parallel(config: ModelConfig, size: int, model: Model | None = None) -> None:
    """Raise ValueError unless ``size`` ranks can each hold whole KV heads and an equal
    share of every layer (with ``model``, also whole groups of its quantized weights)."""
    sizes = valid_sizes(config)
    if model is not None:
        sizes = [n for n in sizes if all(w % n == 0 for w in _row_widths(model))]
    if size in sizes:
        return
    if size in valid_sizes(config):
        raise ValueError(f"tensor_parallel_size={size} would split groups of this model's "
                         f"quantized weights; valid sizes: {', '.join(map(str, sizes))}")
    widths = f"an MLP of {config.intermediate_size}"
    if config.num_experts:
        widths += f", experts of {config.moe_intermediate_size}"
    if config.shared_expert_intermediate_size:
        widths += f", a shared expert of {config.shared_expert_intermediate_size}"
    raise ValueError(
        f"tensor_parallel_size={size} does not divide this model: every rank holds whole KV "
        f"heads and an equal share of each layer, and it has {config.num_attention_heads} "
        f"attention heads, {config.num_key_value_heads} KV heads and {widths}; valid "
        f"sizes: {', '.join(map(str, valid_sizes(config)))}")


def _row_widths(model: Model) -> list[int]:
    """The input widths, in stored units (packed words, groups), of every layer a rank
    keeps a slice of the inputs of."""
    widths = []
    for block in model.model.layers:
        rows = [block.self_attn.o_proj]
        mlp = block.mlp
        rows += [mlp.down_proj] if isinstance(mlp, MLP) else [mlp.switch_mlp.down_proj]
        if isinstance(mlp, SparseMoeBlock) and "shared_expert" in mlp:
            rows.append(mlp.shared_expert.down_proj)
        widths += [v.shape[-1] for layer in rows for k, v in layer.parameters().items()
                   if k != "bias"]
    return widths


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """The model one rank holds: its heads and its share of each feed-forward."""
    return replace(
        config, head_dim=config.head_dim,
        num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=config.num_key_value_heads // size,
        intermediate_size=config.intermediate_size // size,
        moe_intermediate_size=config.moe_intermediate_size // size,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // size)
# ANCHOR_END: tp_geometry


# ANCHOR: shard_linear
def shard_linear(layer: nn.Module, split: str, rank: int, size: int) -> None:
    """Keep rank ``rank``'s share of ``layer`` (a linear layer, quantized or not, or a
    stack of experts' ``[E, out, in]``): ``split="column"`` keeps a slice of its output
    features, ``"row"`` a slice of its input features (a row shard's output is a partial
    sum). Quantized weights are sliced as stored: packed words and their groups' scales
    and biases, which needs the slice to hold whole groups."""
    # TASK 8.1: shard_linear — Sharding a linear layer
    if split == "row" and "bias" in layer:
        raise ValueError("a row-sharded layer's bias would be added once per rank")
    params = layer.parameters()
    axes = {name: -1 if (split == "row" or name == "bias") else -2 for name in params}
    for name, value in params.items():  # every check before any slice: all or nothing
        if value.shape[axes[name]] % size:
            what = "its groups of quantized weights" if name in ("scales", "biases") else name
            raise ValueError(f"cannot split {what} ({value.shape[axes[name]]} along axis "
                             f"{axes[name]}) {size} ways")
    for name, value in params.items():
        step = value.shape[axes[name]] // size
        index = [slice(None)] * value.ndim
        index[axes[name]] = slice(rank * step, (rank + 1) * step)
        layer[name] = mx.contiguous(value[tuple(index)])
    # END TASK
# ANCHOR_END: shard_linear


# ANCHOR: all_reduce
def all_reduce(x: mx.array, group: mx.distributed.Group) -> mx.array:
    """The sum of every rank's ``x``, added in rank order: the same bits on every rank,
    and a row's sum depends only on that row."""
    # TASK 8.2: all_reduce — Where the partial sums meet
    parts = mx.distributed.all_gather(x, group=group)  # rank r's rows at r * len(x)
    parts = parts.reshape(group.size(), *x.shape)
    total = parts[0]
    for r in range(1, group.size()):
        total = total + parts[r]
    return total
    # END TASK


class AllReduce(nn.Module):
    """A sharded module whose output is this rank's partial sum, summed over the ranks."""

    def __init__(self, module: nn.Module, group: mx.distributed.Group):
        super().__init__()
        self.module = module
        self.group = group

    def __call__(self, *args: Any) -> mx.array:
        return all_reduce(self.module(*args), self.group)
# ANCHOR_END: all_reduce


# ANCHOR: shard_model
def shard_model(model: Model, group: mx.distributed.Group) -> None:
    """Keep this rank's share of every layer of ``model`` (in place; given a model whose
    weights are not evaluated yet, each tensor is read once and only its share is kept)
    and sum the partials after each attention and each feed-forward."""
    rank, size = group.rank(), group.size()
    check_tensor_parallel(model.config, size, model)  # before any layer is touched
    for block in model.model.layers:
        attn = block.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            shard_linear(proj, "column", rank, size)
        shard_linear(attn.o_proj, "row", rank, size)
        attn.n_heads //= size
        attn.n_kv_heads //= size
        block.self_attn = AllReduce(attn, group)
        mlp = block.mlp
        mlps = [mlp] if isinstance(mlp, MLP) else [mlp.switch_mlp]
        if isinstance(mlp, SparseMoeBlock) and "shared_expert" in mlp:
            mlps.append(mlp.shared_expert)
        for m in mlps:
            shard_linear(m.gate_proj, "column", rank, size)
            shard_linear(m.up_proj, "column", rank, size)
            shard_linear(m.down_proj, "row", rank, size)
        block.mlp = AllReduce(mlp, group)
    model.config = local_config(model.config, size)
    model.tensor_parallel = group
    # Now, not lazily: the whole weights are dropped, and a lazy array belongs to this
    # thread's stream (the server runs the engine on another thread).
    mx.eval(model.parameters())
# ANCHOR_END: shard_model


def sharded_group(model: Model) -> mx.distributed.Group | None:
    """The group ``model`` is sharded over (None: a whole model)."""
    return getattr(model, "tensor_parallel", None)


# ---------------------------------------------------------------- the ranks

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
                _say(f"{what}, yet: the connection is refused ({check}); trying for "
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


# ANCHOR: step_message
def step_message(batch: StepBatch) -> tuple[dict[str, Any], list[np.ndarray]]:
    """What a worker needs of a step: its rows and where their K/V live (no requests,
    no sampling: rank 0 samples)."""
    # TASK 8.3: step_message — Sending the step to the workers
    kv = batch.kv
    header = {"chunks": [[c.start, c.end] for c in batch.chunks],
              "query_start_loc": batch.query_start_loc, "context_lens": batch.context_lens,
              "decode_rows": batch.decode_rows}
    arrays = [batch.token_ids, batch.positions, kv.slot_mapping, *kv.page_metadata]
    return header, [np.array(a) for a in arrays]
    # END TASK


def step_of_message(header: dict[str, Any], arrays: list[np.ndarray]) -> StepBatch:
    """The worker's copy of rank 0's step: the same rows, pages and layout (the tables
    are the block table's rows up to their first -1)."""
    tables = [row[row >= 0].tolist() for row in arrays[3]]
    token_ids, positions, slot_mapping, block_table, context_lens, query_start_loc = (
        mx.array(a) for a in arrays)
    return StepBatch(
        chunks=[ScheduledChunk(None, start, end) for start, end in header["chunks"]],
        token_ids=token_ids, positions=positions,
        query_start_loc=header["query_start_loc"], context_lens=header["context_lens"],
        logit_rows=mx.array([], dtype=mx.int32), sampling=[], num_logits=[],
        decode_rows=header["decode_rows"],
        kv=PagedLayout(tables, slot_mapping, block_table, context_lens, query_start_loc))
# ANCHOR_END: step_message


# ---------------------------------------------------------------- rank 0

class Workers:
    """Rank 0's side: the workers' connections, each step sent to them, and a watchdog
    that ends rank 0 when a step is stuck in a collective."""

    def __init__(self, ranks: Ranks, timeout: float):
        self.channels, self.timeout = ranks.channels, timeout
        self.lost: set[int] = set()
        self.kv_cache_bytes: dict[int, int] = {}  # each worker's page pool
        self.failure: TensorParallelError | None = None
        self._failure_raised = False  # a step raised it: its caller reports it
        self._step_started: float | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self._sigterm: Any = signal.SIG_DFL  # what SIGTERM did before start()

    def start(self, setup: dict[str, Any]) -> None:
        """Send every worker the engine it builds (pool size, backend, kernels); wait until
        each has built it; then watch them."""
        for channel in self.channels.values():
            channel.send(setup)
        for rank, channel in self.channels.items():
            channel.sock.settimeout(self.timeout)
            reply, _ = channel.receive()
            channel.sock.settimeout(None)
            if reply is None or "error" in reply:
                why = "exited or did not answer" if reply is None else reply["error"]
                raise TensorParallelError(f"worker rank {rank} could not start: {why}")
            self.kv_cache_bytes[rank] = reply["kv_cache_bytes"]
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()
        if threading.current_thread() is threading.main_thread():  # where handlers are set
            self._sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _send(self, batch: StepBatch) -> None:
        header, arrays = step_message(batch)
        for rank, channel in self.channels.items():
            try:
                channel.send(header, arrays)
            except OSError:
                self._lose(rank)
                raise self._raised() from None

    @contextmanager
    def step(self, batch: StepBatch):
        """Send ``batch`` to the workers and run it on rank 0 inside the block, watched from
        before the send. A step that fails once sent may leave the ranks in different
        collectives: no later step runs."""
        if self.failure is not None:
            raise self._raised()
        with self._lock:
            self._step_started = time.monotonic()
        try:
            self._send(batch)
            yield
        except BaseException as e:
            if ring_failed(e):
                self._find_lost(wait=LOST_WAIT)  # a closed connection says which worker exited
            if self.failure is None:
                self.failure = TensorParallelError(
                    f"a tensor-parallel step failed on rank 0 after it was sent to the "
                    f"workers ({type(e).__name__}: {e}); the ranks may no longer be in step, "
                    f"so no later step runs")
            raise self._raised() from e
        finally:
            with self._lock:
                self._step_started = None

    def _raised(self) -> TensorParallelError:
        """The failure, to raise: its caller now knows (and reports it)."""
        self._failure_raised = True
        return self.failure

    def stop(self) -> None:
        """Tell every worker to exit (at rank 0's end), and wait until each has: one still
        finishing the last step would find the ring closed under it. A worker found gone
        that no step has reported (rank 0 idle, or ended by a signal) ends rank 0 with
        status 1 and the error on stderr, not a silent success."""
        if self._stopped:
            return
        self._find_lost(wait=0.0)
        if self.lost and not self._failure_raised:
            _exit(f"{self.failure}; rank 0 exits")
        self._stopped = True
        for channel in self.channels.values():
            try:
                channel.send({"stop": True})
            except OSError:
                pass
        deadline = time.monotonic() + STOP_TIMEOUT
        for channel in self.channels.values():
            channel.sock.settimeout(max(0.0, deadline - time.monotonic()))
            channel.receive()  # nothing more is sent: this returns at the worker's exit

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM on rank 0. ``mlx.launch`` sends it to the other ranks when one exits: with a
        worker gone, rank 0 says so and exits 1 rather than die without a word. Otherwise
        SIGTERM does what it did before."""
        if not self._stopped:
            self._find_lost(wait=LOST_WAIT)  # a remote worker's end may come a moment later
            if self.failure is not None:
                _exit(f"{self.failure}; rank 0 exits")
        if callable(self._sigterm):
            self._sigterm(signum, frame)
        elif self._sigterm != signal.SIG_IGN:  # the default: end by the signal, as before
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)

    def _lose(self, rank: int) -> None:
        """Mark ``rank`` gone; the error names the first found (mlx.launch ends the other
        ranks once one has exited, and ``_find_lost`` reads them in rank order)."""
        if not self.lost:
            self.failure = TensorParallelError(f"tensor-parallel worker rank {rank} has "
                                               f"exited; rank 0 cannot serve without its shard")
        self.lost.add(rank)

    def _find_lost(self, wait: float) -> None:
        """Mark the workers whose connection has closed (they exited), waiting up to
        ``wait`` seconds for one to."""
        socks = {c.sock: r for r, c in self.channels.items() if r not in self.lost}
        readable, _, _ = select.select(list(socks), [], [], wait) if socks else ([], [], [])
        for sock in sorted(readable, key=socks.get):
            if _closed(sock):
                self._lose(socks[sock])

    def _watch(self) -> None:
        """A worker's connection closing means it exited: rank 0, which cannot serve
        without its shard, ends too (a moment later, so that a step failing on its own
        reports first). A step older than the timeout means a rank is stuck: rank 0,
        blocked in a collective, ends with that error."""
        lost_at: float | None = None
        while not self._stopped:
            known = len(self.lost)
            self._find_lost(wait=0.25)
            if len(self.lost) > known:
                lost_at = time.monotonic()
            with self._lock:
                started = self._step_started
            now = time.monotonic()
            if started is not None and now - started > self.timeout:
                _exit(f"a tensor-parallel step did not finish within {self.timeout:g} s "
                      f"(tensor_parallel_timeout): a rank is stuck, stopped or too slow"
                      f"{f' ({self.failure})' if self.failure else ''}; rank 0 exits")
            if lost_at is not None and now - lost_at > EXIT_GRACE:
                _exit(f"{self.failure}; rank 0 exits")


def _closed(sock: socket.socket) -> bool:
    """Whether the other side of a readable connection has closed it."""
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _exit(message: str) -> None:
    _say(f"error: {message}")
    os._exit(1)


def _say(message: str) -> None:
    sys.stderr.write(f"tiny-llm: {message}\n")
    sys.stderr.flush()


# ---------------------------------------------------------------- the workers

def serve_as_worker(ranks: Ranks, build_runner) -> None:
    """A worker's whole life: build the engine's shard as rank 0 says, then run every
    step rank 0 sends, until it says stop (exit 0) or goes away (exit 1). Never returns."""
    # Ctrl-C in the terminal reaches every rank of mlx.launch: rank 0 decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel = ranks.channels[0]
    setup, _ = channel.receive()
    if setup is None:
        _exit(f"rank 0 went away before the engine started (worker rank {ranks.rank})")
    try:
        runner = build_runner(setup)
    except Exception as e:  # rank 0 reports it; the worker ends
        channel.send({"error": f"{type(e).__name__}: {e}"})
        _exit(f"worker rank {ranks.rank} could not start: {e}")
    channel.send({"kv_cache_bytes": runner.kv.nbytes()})
    gone = f"rank 0 went away or left a step worker rank {ranks.rank} is in: it stops"
    in_step = threading.Event()
    threading.Thread(target=_watch_rank0, args=(channel.sock, in_step, gone),
                     name="tp-rank0-watch", daemon=True).start()
    while True:
        header, arrays = channel.receive()
        if header is None:
            _exit(gone)
        if header.get("stop"):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        in_step.set()
        try:
            runner.forward(step_of_message(header, arrays), head=False)
        except Exception as e:  # rank 0's step fails with it: the ring breaks as we exit
            _exit(f"worker rank {ranks.rank}: a step failed ({type(e).__name__}: {e})")
        in_step.clear()


def check_worker_pool(num_pages: int, page_bytes: int) -> None:
    """On a worker, before its page pool is allocated: refuse rank 0's page count where this
    machine's memory cannot hold it, by the rule rank 0 sized its own pool by
    (``pool_pages``: at most ``MAX_POOL_FRACTION`` of the memory available)."""
    need, available = num_pages * page_bytes, available_memory()
    if need > int(available * MAX_POOL_FRACTION):
        raise ValueError(
            f"rank 0's KV pool of {num_pages} pages of {page_bytes} bytes "
            f"({need / 2**30:.2f} GiB) does not fit in this rank's memory: its machine has "
            f"{available / 2**30:.2f} GiB available and the pool may take at most "
            f"{MAX_POOL_FRACTION:.0%} of it; give rank 0 a smaller pool (--num-pages, "
            f"--kv-memory-bytes or --kv-memory-fraction)")


def _watch_rank0(sock: socket.socket, in_step: threading.Event, gone: str) -> None:
    """End a worker left inside a step: rank 0 has gone (its connection closed) or moved on
    (its next message waits) while this rank has been blocked in the step's collectives
    for ``EXIT_GRACE`` seconds. A broken ring does not always fail the collectives that
    wait on it, and a worker never leaves a step rank 0 abandoned."""
    waiting_since: float | None = None
    while True:
        readable, _, _ = select.select([sock], [], [], 0.25)
        if readable and in_step.is_set():
            waiting_since = waiting_since or time.monotonic()
            if time.monotonic() - waiting_since > EXIT_GRACE:
                _exit(gone)
        else:
            waiting_since = None
        if readable:
            time.sleep(0.05)  # the main thread reads what waits (or the end) itself


# ---------------------------------------------------------------- the launch

def launch(argv: list[str]) -> int:
    """``mlx.launch --backend ring`` with ``argv`` (its options, ``--``, the command), exiting
    as its ranks did: 0 when every rank exited 0; else the first failing status a rank exited
    with itself, in rank order; else 128 + N for the first rank ended by signal N (the
    launcher ends the others with SIGTERM when one exits). mlx.launch itself exits 0 whatever
    its ranks did (its ``main`` returns nothing), so it runs here in this process, with a
    record of the processes it starts. Ctrl-C ends the ranks: rank 0 first, so that the
    workers see it go rather than rank 0 a worker."""
    from mlx._distributed_utils import launch as mlx_launch

    started: dict[int, Any] = {}  # rank: mlx.launch's RemoteProcess

    class Recorded(mlx_launch.RemoteProcess):
        def __init__(self, rank: int, *args: Any):
            super().__init__(rank, *args)
            started[rank] = self

    original, argv0 = mlx_launch.RemoteProcess, sys.argv
    mlx_launch.RemoteProcess = Recorded
    sys.argv = ["tiny-llm launch", "--backend", "ring", *argv]
    try:
        mlx_launch.main()
    except KeyboardInterrupt:
        for rank in sorted(started):
            started[rank].process.terminate()
            started[rank].process.wait()
        return 130
    finally:
        mlx_launch.RemoteProcess, sys.argv = original, argv0
    if not started:
        raise ValueError("mlx.launch started no rank: tiny-llm launch runs the ring backend "
                         "only (no --backend)")
    codes = [started[rank].process.wait() for rank in sorted(started)]
    own, signalled = [c for c in codes if c > 0], [128 - c for c in codes if c < 0]
    return (own or signalled or [0])[0]
