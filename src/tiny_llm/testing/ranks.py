"""Ranks on one machine, as ``mlx.launch -n N --backend ring`` starts them: one process per
rank with ``MLX_RANK`` and a ring hostfile on 127.0.0.1, started here so that a test or a
benchmark knows each rank's process (to read its output, stop it or kill it); and the ranks
a running ``mlx.launch`` (or ``tiny-llm launch``) started, found by their environment; and
``RankPlace``, a rank's place in a group for sharding without processes."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path


class RankPlace:
    """A rank's place in a group of ``size``, without processes: what sharding reads of
    an ``mx.distributed`` group (its ``rank()`` and ``size()``)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def free_ports(n: int) -> list[int]:
    """``n`` ports free on 127.0.0.1 right now (held together, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalRanks:
    """``n`` processes of ``argv`` (after the Python interpreter), rank r's output in
    ``directory / f"rank{r}.log"``; ``addresses``: each rank's ``"ip:port"`` in the ring's
    hostfile (by default free ports on 127.0.0.1)."""

    def __init__(self, n: int, argv: list[str], directory: Path,
                 env: dict[str, str] | None = None, addresses: list[str] | None = None):
        addresses = addresses or [f"127.0.0.1:{p}" for p in free_ports(n)]
        hostfile = directory / "hostfile.json"
        hostfile.write_text(json.dumps([[a] for a in addresses]))
        self.logs = [directory / f"rank{r}.log" for r in range(n)]
        self.procs = []
        for r in range(n):
            with open(self.logs[r], "wb") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT,
                    env={**os.environ, **(env or {}), "MLX_RANK": str(r),
                         "MLX_HOSTFILE": str(hostfile)}))

    def wait(self, timeout: float) -> list[int]:
        """Every rank's exit status; the ranks still running after ``timeout`` seconds are
        killed and read as None."""
        deadline = time.monotonic() + timeout
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        self.kill()
        return codes

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def output(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")


def launched_ranks(launcher: int) -> dict[int, int]:
    """The process id of every rank the launcher ``launcher`` (a process id) has started on
    this machine, by rank: its children whose environment holds ``MLX_RANK`` (``ps``)."""
    table = _ps("-A", "-o", "pid=,ppid=")
    children = [int(pid) for pid, ppid in (row.split() for row in table.splitlines())
                if int(ppid) == launcher]
    ranks = {}
    for pid in children:
        rank = re.search(r"\bMLX_RANK=(\d+)", _ps("eww", "-o", "command=", "-p", str(pid)))
        if rank:
            ranks[int(rank.group(1))] = pid
    return ranks


def _ps(*args: str) -> str:
    return subprocess.run(["ps", *args], capture_output=True, text=True).stdout
