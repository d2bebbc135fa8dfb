"""One edition of the book's measurements: every result the book shows, measured again at
one clean commit on one machine, and that machine described once.

The book cites results by name (the tables its chapters include and the files its
``{{#result}}`` directives read: ``tools/book_results.py``); ``benches/<name>.py`` writes
each. This script refuses a modified tree, describes the machine (CPU model, the vector
and matrix instructions the kernels can use, cores, memory, copy bandwidth), runs every
cited script one after the other with ``--rounds`` (3 by default), and writes
``benchmark_results/edition.{json,md}``: the machine, and each script's time and outcome.
The performance appendix opens with that table, and the book's test requires every cited
result to come from the edition's commit. Commit the results, then rebuild the book: the
tables and the sentences that read them follow.

``bench_vs_llama_cpp`` needs llama.cpp's ``llama-bench`` (``--llama-bench PATH``, see that
script); without it, its result stays from its own machine and commit, and the edition's
table says so. On a Mac the scripts of the Linux CPU path (OpenBLAS, the CPU kernels) stop
at once, and their results likewise stay those of the edition they came from; every other
script measures the GPU.

    python benches/edition.py --list          # the scripts it would run, in order
    python benches/edition.py                 # all of them (hours on a 2-core CPU)
    python benches/edition.py --only bench_model   # redo one script, the engine unchanged
    python benches/edition.py --add bench_tensor_parallel   # a new chapter's script

``--add`` measures a script the edition never ran (a chapter written after it) at the
current commit and keeps every other result: that script's tables compare only
configurations it measured itself, side by side, so they stand on their own engine; the
edition's table names it and its commit, and its machine where that is not the edition's
(its ratios stand on their own machine too; its absolute numbers are that machine's).
``bench_roofline`` places llama.cpp beside the engine where ``--llama-bench`` is given.

Other work on the machine skews a script's numbers. While each script runs, the edition
samples the 1-minute load average (recorded), and on Linux measures the CPU time the
machine spent on anything but the script and its own processes (``/proc/stat``'s busy
time, the hypervisor's steal included, less the script's: a script that loads the machine
on purpose, such as ``bench_blas_threads``' busy neighbour, is not "other work"). A script
beside more than ``OTHER_WORK_LIMIT`` cores of other work on average (elsewhere: a median
load above the cores plus one) runs again, once, and the table keeps the run it reports.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from common import NOT_THIS_MACHINE, REPO_ROOT, Table, copy_bandwidth, environment, save_results

sys.path.insert(0, str(REPO_ROOT / "tools"))
from book_results import cited_results  # noqa: E402

NEEDS_LLAMA_BENCH = "bench_vs_llama_cpp"
TAKES_LLAMA_BENCH = "bench_roofline"  # runs without it, its llama.cpp points left out
# Linux /proc/cpuinfo flags (x86 "flags", Arm "Features") that decide which kernels run.
OTHER_WORK_LIMIT = 0.5  # cores, on average over the script's run
LOAD_LIMIT = (os.cpu_count() or 1) + 1  # where the other work cannot be measured
LOAD_SAMPLE_S = 10
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni",
             "avx512_bf16", "amx_tile", "amx_int8", "asimd", "asimddp", "i8mm", "bf16", "sve")


def cpu_words() -> tuple[str, str]:
    """(CPU model, the instruction-set extensions of ISA_FLAGS it has)."""
    if sys.platform == "darwin":
        brand = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                               capture_output=True, text=True).stdout.strip()
        return brand or platform.processor(), "arm64 (NEON, dot product)"
    model, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model") and model in ("", platform.machine()):
            model = value.strip()
        if key.strip() in ("flags", "Features"):
            flags |= set(value.split())
    return model, " ".join(f for f in ISA_FLAGS if f in flags) or "none of " + ", ".join(ISA_FLAGS)


def machine_table() -> Table:
    model, isa = cpu_words()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    rows = [["CPU", model], ["instructions the kernels can use", isa],
            ["cores", os.cpu_count()], ["memory (GiB)", f"{memory:.0f}"],
            ["copy bandwidth (GB/s, numpy, 256 MiB)", f"{copy_bandwidth() / 1e9:.1f}"],
            ["system", platform.platform()]]
    return Table("The edition's machine", ["", "value"], rows)


def tree_is_clean() -> bool:
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                             ":!benchmark_results"], cwd=REPO_ROOT, capture_output=True,
                            text=True, check=True).stdout
    return status == ""


def run_script(name: str, rounds: int, llama_bench: Path | None) -> list[object]:
    """Run ``benches/<name>.py``, again once if other work was busy beside it; (name,
    seconds, outcome, median load, other work in cores) for the edition's table."""
    command = [sys.executable, str(REPO_ROOT / "benches" / f"{name}.py"), "--rounds", str(rounds)]
    if name == NEEDS_LLAMA_BENCH and llama_bench is None:
        return [name, None, "not run (no --llama-bench): its own machine and commit", None, None]
    if name in (NEEDS_LLAMA_BENCH, TAKES_LLAMA_BENCH) and llama_bench is not None:
        command += ["--llama-bench", str(llama_bench)]
    for attempt in (1, 2):
        print(f"edition: {' '.join(command[1:])}", flush=True)
        start = time.perf_counter()
        run = run_watching_the_machine(command)
        seconds = time.perf_counter() - start
        if run.returncode != 0 or not run.busy or attempt == 2:
            break
        print(f"edition: {name} ran beside other work ({run.describe()}): again", flush=True)
    if run.returncode == NOT_THIS_MACHINE:
        outcome = "not this machine's (the Linux CPU path): its own edition"
    else:
        outcome = "measured" if run.returncode == 0 else f"failed ({run.returncode})"
    if attempt == 2:
        outcome += ", second run" + (" (still beside other work)" if run.busy else "")
    return [name, seconds, outcome, run.load, run.other_cores]


@dataclass
class WatchedRun:
    """A script's return code, the median 1-minute load while it ran, and the cores other
    work used on average (None where ``/proc/stat`` does not exist)."""

    returncode: int
    load: float
    other_cores: float | None

    @property
    def busy(self) -> bool:
        if self.other_cores is not None:
            return self.other_cores > OTHER_WORK_LIMIT
        return self.load > LOAD_LIMIT

    def describe(self) -> str:
        if self.other_cores is not None:
            return f"{self.other_cores:.2f} cores of other work, limit {OTHER_WORK_LIMIT}"
        return f"load {self.load:.1f}, limit {LOAD_LIMIT}"


def busy_cpu_seconds() -> float | None:
    """The machine's busy CPU time so far (every core, steal included), or None off Linux."""
    stat = Path("/proc/stat")
    if not stat.exists():
        return None
    fields = [int(x) for x in stat.read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """The CPU time of this process's children that were waited for, and theirs: every
    script waits for the processes it starts (servers, ranks, a busy neighbour), so a
    script's own work is all counted here; a process it left running would count as
    other work."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_watching_the_machine(command: list[str]) -> WatchedRun:
    """Run ``command``, sampling the 1-minute load every ``LOAD_SAMPLE_S`` seconds and
    measuring the CPU time spent on anything but it."""
    loads: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(LOAD_SAMPLE_S):
            loads.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample, daemon=True)
    busy0, own0, start = busy_cpu_seconds(), children_cpu_seconds(), time.perf_counter()
    sampler.start()
    returncode = subprocess.run(command, cwd=REPO_ROOT).returncode
    done.set()
    sampler.join()
    busy1, wall = busy_cpu_seconds(), time.perf_counter() - start
    other = None
    if busy0 is not None and busy1 is not None:
        own = children_cpu_seconds() - own0
        other = max(0.0, busy1 - busy0 - own) / wall
    return WatchedRun(returncode, statistics.median(loads or [os.getloadavg()[0]]), other)


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)


def earlier_edition(machine: Table, same_engine: bool) -> dict:
    """The edition that ``--only`` redoes scripts of (or ``--add`` adds to): for ``--only``
    on this machine with the engine (``src/``) unchanged since it, so that every result
    still measures one engine and one machine."""
    path = REPO_ROOT / "benchmark_results" / "edition.json"
    if not path.exists():
        raise SystemExit("--only redoes scripts of an edition: run a whole one first")
    edition = json.loads(path.read_text())
    if same_engine and edition["tables"][0]["rows"][0] != machine.rows[0]:
        raise SystemExit("the edition was measured on another CPU: run a whole edition here")
    commit = edition["data"]["engine_commit"]
    if same_engine and git("diff", "--quiet", commit, "HEAD", "--", "src").returncode != 0:
        raise SystemExit(f"the engine (src/) changed since the edition's commit {commit}: "
                         "a new edition measures every script")
    return edition


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every script (>= 3)")
    ap.add_argument("--only", nargs="+", metavar="NAME",
                    help="redo these scripts of the last edition (the engine unchanged)")
    ap.add_argument("--add", nargs="+", metavar="NAME",
                    help="measure scripts the last edition did not run (a new chapter's), "
                         "at this commit, keeping the others' results")
    ap.add_argument("--llama-bench", type=Path, help="llama.cpp's llama-bench, for its table")
    ap.add_argument("--list", action="store_true", help="print the scripts, run nothing")
    args = ap.parse_args()
    names = cited_results()
    chosen = args.only or args.add
    if args.only and args.add:
        raise SystemExit("--only redoes scripts, --add adds new ones: one at a time")
    if chosen:
        unknown = sorted(set(chosen) - set(names))
        if unknown:
            raise SystemExit(f"not results the book cites: {unknown}; it cites {names}")
    if args.list:
        print("\n".join(n for n in names if not chosen or n in chosen))
        return
    if args.rounds < 3:
        raise SystemExit("an edition needs at least 3 rounds (the book's test refuses fewer)")
    if not tree_is_clean() or environment()["git_dirty"]:
        raise SystemExit("the tree has changes: commit or stash them, an edition is one commit")
    machine = machine_table()
    commit = environment()["git_commit"]
    rows = {name: [name, None, "not run", None, None, commit] for name in names}
    engine_commit, added, added_on = commit, {}, {}
    if chosen:
        edition = earlier_edition(machine, same_engine=bool(args.only))
        engine_commit = edition["data"]["engine_commit"]
        added = edition["data"].get("added", {})
        added_on = edition["data"].get("added_on", {})
        earlier = {row[0]: row for row in edition["tables"][1]["rows"]}
        # An edition from before the load was recorded: its scripts' loads are unknown.
        earlier = {n: row if len(row) == 6 else [*row[:3], None, None, row[3]]
                   for n, row in earlier.items()}
        if args.add:
            ran = sorted(n for n in args.add if n in earlier and n not in added)
            if ran:
                raise SystemExit(f"{ran} are the edition's own scripts: a new edition redoes "
                                 "them (or --only, the engine unchanged)")
        rows |= {name: row for name, row in earlier.items() if name in rows}
        here = machine.rows[0][1]
        machine = Table(**{k: edition["tables"][0][k] for k in ("title", "headers", "rows")})
        # A script added again takes the machine of its new run.
        added_on = {n: m for n, m in added_on.items() if n not in (args.add or [])}
        if args.add and here != machine.rows[0][1]:
            added_on |= dict.fromkeys(args.add, here)
    for name in chosen or names:
        rows[name] = [*run_script(name, args.rounds, args.llama_bench), commit]
    added |= dict.fromkeys(args.add or [], commit)
    note = f"The engine (src/) of every commit above is that of {engine_commit}"
    if added:
        note += (", but for " + ", ".join(
            f"{n} (added at {c}" + (f", on {added_on[n]}" if n in added_on else "") + ")"
            for n, c in added.items())
                 + ": a later chapter's script, measured on the engine of its own commit"
                 + (" and, where named, on another machine than the edition's" if added_on
                    else ""))
    scripts = Table("The edition's scripts, one after the other",
                    ["result", "seconds", "outcome", "load (median)", "other work (cores)",
                     "commit"],
                    list(rows.values()), formats=["", ".0f", "", ".1f", ".2f", ""],
                    note=note + f". Load: the 1-minute load average, sampled every "
                    f"{LOAD_SAMPLE_S} s while the script ran (its own threads count); other "
                    "work: the CPU time the machine spent on anything but the script, in "
                    f"cores on average; a script beside more than {OTHER_WORK_LIMIT} ran again.")
    save_results("edition", {"results": names, "engine_commit": engine_commit, "added": added,
                             "added_on": added_on}, [machine, scripts], rounds=args.rounds)
    failed = [r[0] for r in rows.values() if str(r[2]).startswith("failed")]
    if failed:
        raise SystemExit(f"failed: {failed}")


if __name__ == "__main__":
    main()
