"""Work started ahead of the tests that read it, two at a time.

Some tests spend their time waiting for a child process (a course task's tests on a
workspace, a benchmark's quick run): the test process idles while one core works. A module
submits every such run its selected tests will need when the first of them starts, two at a
time on a two-core machine, and each test reads its own result (``Ahead.result``), so a
failure still names its test. Only the runs of the tests pytest selected are started
(``selected_params``): ``-k`` on one case runs one child.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

WORKERS = max(2, min(4, os.cpu_count() or 2))


class Ahead:
    """A pool of runs keyed by what the test reading them asks for."""

    def __init__(self, workers: int = WORKERS):
        self._pool = ThreadPoolExecutor(workers)
        self._runs: dict[Hashable, Future] = {}

    def start(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> None:
        if key not in self._runs:
            self._runs[key] = self._pool.submit(fn, *args)

    def result(self, key: Hashable) -> Any:
        """The run's result (its exception raised here, in the test that reads it)."""
        return self._runs[key].result()

    def join(self) -> None:
        """Wait for every run started so far (their errors stay for their readers)."""
        for run in list(self._runs.values()):
            run.exception()

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


def selected_params(request: pytest.FixtureRequest, test: Callable[..., Any]) -> list[dict]:
    """The parameters of each selected item of ``test`` in this session, in run order ({}
    for a test without parameters)."""
    return [item.callspec.params if hasattr(item, "callspec") else {}
            for item in request.session.items if getattr(item, "function", None) is test]
