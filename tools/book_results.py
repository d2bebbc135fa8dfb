"""The book's preprocessor for measured numbers: prose reads each one from the benchmark
result its table comes from.

A chapter writes ``{{#result FILE TABLE COLUMN [WHERE ...] [1/x | *N | /N] [AGG] [:FORMAT]}}``:

- ``FILE``: a result under ``benchmark_results/`` without ``.json`` (``bench_week3_day4``);
- ``TABLE``: its position in the result, as in the ``tableN`` anchor that includes it;
- ``COLUMN``: a header of that table, quoted when it has spaces (``"× off#2"``: the second
  column of that name);
- ``WHERE``: filters on the rows, ``"header=value"``, or with ``!=``, ``<``, ``>``, ``<=``,
  ``>=`` (a number compares numerically);
- ``1/x``, ``*N`` or ``/N``: a transform of each value (a speedup from a time ratio, a
  percent with ``*100``, seconds from microseconds with ``/1e6``);
- ``AGG``: ``min``, ``max``, ``median``, or ``range`` (written ``low–high``) over the rows
  that pass the filters, or ``count``, how many rows pass (0 if none; not in a ratio);
  without one, exactly one row must pass;
- ``:FORMAT``: a Python format spec (``:.1f``), ``:.3g`` if none.

``{{#result FILE env KEY}}`` reads the result's environment (``git_commit``, ``date``...).

``{{#ratio A / B [:FORMAT]}}`` is a ratio of two measurements, where ``A`` and ``B`` are
each the arguments of a ``#result`` that stands for one number (one row, or ``min``,
``max`` or ``median``; no format of its own): ``{{#ratio bench_x 1 ms impl=naive / bench_x
1 ms impl=fused :.1f}}×`` says how many times faster the fused kernel is. ``:FORMAT``
formats the ratio, ``:.2f`` if none.

Anything that does not resolve (a missing file, table, column or row, an empty cell, two
rows where one is expected, a zero denominator) fails the build with the chapter and the
directive, so prose cannot drift from its table silently: rerun the benchmark and the
sentence follows.

Standard library only, so any Python 3 runs it.

    python3 tools/book_results.py supports html     # mdBook's question: exit 0
    mdbook build book                               # runs it as configured in book.toml
"""

from __future__ import annotations

import json
import re
import shlex
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from book_tasks import run_preprocessor  # mdBook's protocol, as for the tasks

RESULTS = Path(__file__).resolve().parents[1] / "benchmark_results"
BOOK_SRC = Path(__file__).resolve().parents[1] / "book" / "src"
INCLUDED_TABLE = re.compile(r"\{\{#include\s+[./]*benchmark_results/(\w+)\.md")
DIRECTIVE = re.compile(r"\{\{#(?P<kind>result|ratio)\s+(?P<args>[^}]*)\}\}")
TRANSFORM = re.compile(r"^(1/x|[*/][0-9.]+(?:e[0-9]+)?)$")  # 1/x, *100, /1e6
AGGREGATES: dict[str, Callable[[list[float]], float]] = {
    "min": min, "max": max, "median": statistics.median}


class ResultError(ValueError):
    """A directive that does not resolve to a value."""


def load(name: str, cache: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if name not in cache:
        path = RESULTS / f"{name}.json"
        if not path.exists():
            raise ResultError(f"no result {path.name} in benchmark_results/")
        cache[name] = json.loads(path.read_text())
    return cache[name]


def find_table(result: dict[str, Any], table: str) -> dict[str, Any]:
    tables = result["tables"]
    if not table.isdigit() or not 1 <= int(table) <= len(tables):
        raise ResultError(f"no table {table}: it has tables 1 to {len(tables)}")
    return tables[int(table) - 1]


def column(table: dict[str, Any], header: str) -> int:
    """The column named ``header``; ``header#2`` is the second column of that name."""
    name, _, nth = header.rpartition("#") if "#" in header else (header, "", "1")
    found = [i for i, h in enumerate(table["headers"]) if h == name]
    if not nth.isdigit() or len(found) < int(nth):
        raise ResultError(f"no column {header!r} (its columns: {table['headers']})")
    return found[int(nth) - 1]


FILTER = re.compile(r"^(?P<name>.*?)(?P<op>!=|>=|<=|=|<|>)(?P<value>.*)$")
COMPARE = {"=": lambda a, b: a == b, "!=": lambda a, b: a != b, "<": lambda a, b: a < b,
           ">": lambda a, b: a > b, "<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b}


def passes(cell: Any, op: str, value: str) -> bool:
    """``cell op value``: numerically for a number, else as text (= and != only)."""
    if isinstance(cell, (int, float)) and not isinstance(cell, bool):
        try:
            return COMPARE[op](float(cell), float(value))
        except ValueError:
            return op == "!="
    if op not in ("=", "!="):
        raise ResultError(f"{cell!r} is not a number to compare with {op}")
    return COMPARE[op](str(cell), value)


def values(table: dict[str, Any], header: str, where: list[str],
           none_pass: bool = False) -> list[Any]:
    """The column's cells in the rows that pass every filter (``header=value``, or with
    ``!=``, ``<``, ``>``, ``<=``, ``>=``); no row passing is an error unless ``none_pass``."""
    rows = table["rows"]
    for condition in where:
        m = FILTER.match(condition)
        if m is None:
            raise ResultError(f"not a filter: {condition!r}")
        i = column(table, m["name"])
        rows = [r for r in rows if passes(r[i], m["op"], m["value"])]
    if not rows and not none_pass:
        raise ResultError(f"no row where {' and '.join(where)}")
    i = column(table, header)
    return [r[i] for r in rows]


@dataclass
class Query:
    """A directive's arguments: which cells of which table, and what becomes of them."""

    name: str
    table: str
    header: str
    where: list[str]
    transform: str | None
    aggregate: str | None


def split_format(words: list[str], default: str) -> tuple[list[str], str]:
    """The words before a trailing ``:FORMAT``, and the format (``default`` if none)."""
    if len(words) > 3 and words[-1].startswith(":"):
        return words[:-1], words[-1]
    return words, default


def parse(words: list[str]) -> Query:
    if len(words) < 3:
        raise ResultError("needs FILE TABLE COLUMN (or FILE env KEY)")
    name, table, header, *rest = words
    aggregate = rest.pop() if rest and rest[-1] in (*AGGREGATES, "range", "count") else None
    transform = rest.pop() if rest and TRANSFORM.match(rest[-1]) else None
    if not all(FILTER.match(w) for w in rest):
        raise ResultError(f"not a filter, transform or aggregate (a format comes last): {rest}")
    return Query(name, table, header, rest, transform, aggregate)


def selected(query: Query, cache: dict[str, dict[str, Any]]) -> list[Any]:
    """The query's cells: exactly one unless it aggregates (none, for a count)."""
    table = find_table(load(query.name, cache), query.table)
    cells = values(table, query.header, query.where, none_pass=query.aggregate == "count")
    if query.aggregate is None and len(cells) != 1:
        raise ResultError(f"{len(cells)} rows pass the filters; add filters or an aggregate")
    return cells


def numbers(query: Query, cells: list[Any]) -> list[float]:
    """The numbers among ``cells``, transformed."""
    found = [c for c in cells if isinstance(c, (int, float)) and not isinstance(c, bool)]
    if not found:
        raise ResultError(f"no number in the selected cells {cells}")
    return [apply(query.transform, v) for v in found] if query.transform else found


def combine(query: Query, found: list[float]) -> float:
    """The query's aggregate of ``found``, or its one number."""
    return AGGREGATES[query.aggregate](found) if query.aggregate else found[0]


def number(query: Query, cache: dict[str, dict[str, Any]]) -> float:
    """The one number a query stands for: its row's, or its aggregate (not a range)."""
    if query.aggregate in ("range", "count"):
        raise ResultError(f"a {query.aggregate} is not a number to divide")
    return combine(query, numbers(query, selected(query, cache)))


def environment(words: list[str], cache: dict[str, dict[str, Any]]) -> str:
    """``FILE env KEY``: a value of the result's environment."""
    if len(words) != 3:
        raise ResultError("needs FILE env KEY")
    env = load(words[0], cache)["environment"]
    if words[2] not in env:
        raise ResultError(f"no environment key {words[2]!r}")
    return str(env[words[2]])


def resolve(args: str, cache: dict[str, dict[str, Any]]) -> str:
    """The text a ``{{#result}}``'s arguments stand for."""
    words, spec = split_format(shlex.split(args), ":.3g")
    if len(words) > 1 and words[1] == "env":
        return environment(words, cache)
    query = parse(words)
    cells = selected(query, cache)
    if query.aggregate == "count":  # rows, not numbers: none passing is 0
        return str(len(cells))
    if query.aggregate is None and isinstance(cells[0], str):
        return cells[0]  # a label ("yes", "16/16")
    found = numbers(query, cells)
    if query.aggregate == "range":
        return f"{min(found):{spec[1:]}}–{max(found):{spec[1:]}}"
    return f"{combine(query, found):{spec[1:]}}"


def operands(words: list[str]) -> list[list[str]]:
    """A ``{{#ratio}}``'s words split at its ``/``: the numerator's and the denominator's."""
    if words.count("/") != 1:
        raise ResultError("needs A / B: two result directives' arguments around one ' / '")
    i = words.index("/")
    return [words[:i], words[i + 1:]]


def ratio(args: str, cache: dict[str, dict[str, Any]]) -> str:
    """The text a ``{{#ratio A / B}}`` stands for: A's number over B's."""
    words, spec = split_format(shlex.split(args), ":.2f")
    numerator, denominator = (number(parse(w), cache) for w in operands(words))
    if denominator == 0:
        raise ResultError("the denominator is zero")
    return f"{numerator / denominator:{spec[1:]}}"


RESOLVERS: dict[str, Callable[[str, dict[str, dict[str, Any]]], str]] = {
    "result": resolve, "ratio": ratio}


def apply(transform: str, value: float) -> float:
    """``1/x``, ``*N`` or ``/N`` of ``value``."""
    factor = 1.0 if transform == "1/x" else float(transform[1:])
    if transform[0] == "*":
        return value * factor
    if (value if transform == "1/x" else factor) == 0:
        raise ResultError(f"{transform} of {value}: a division by zero")
    return 1 / value if transform == "1/x" else value / factor


def substitute(content: str, where: str, cache: dict[str, dict[str, Any]]) -> str:
    """``content`` with every directive replaced by its value."""

    def value(m: re.Match[str]) -> str:
        try:
            return RESOLVERS[m["kind"]](m["args"], cache)
        except ValueError as e:  # ResultError, or a format spec Python does not know
            raise ResultError(f"{where}: {m[0]}: {e}") from None

    return DIRECTIVE.sub(value, content)


def files_read(directive: re.Match[str]) -> list[str]:
    """The results a directive reads: a ``#ratio``'s two operands' files, a ``#result``'s."""
    words = shlex.split(directive["args"])
    if directive["kind"] == "result":
        return words[:1]
    starts = [0] + [i + 1 for i, w in enumerate(words) if w == "/"]  # malformed: the build says
    return [words[i] for i in starts if i < len(words)]


def cited_results(src: Path = BOOK_SRC) -> list[str]:
    """The results the book shows: the tables its chapters include and the files their
    directives read (``benches/<name>.py`` writes each)."""
    names: set[str] = set()
    for chapter in src.glob("*.md"):
        text = chapter.read_text(encoding="utf-8")
        names |= set(INCLUDED_TABLE.findall(text))
        names |= {name for m in DIRECTIVE.finditer(text) for name in files_read(m)}
    return sorted(names - {"edition"})  # the edition's own record: not a script's result


def main() -> int:
    cache: dict[str, dict[str, Any]] = {}
    return run_preprocessor("book_results", lambda content, where: substitute(
        content, where, cache), ResultError)


if __name__ == "__main__":
    sys.exit(main())
