"""A soak of `tiny-llm serve` under clients that misbehave: do the well-behaved ones notice?

The server runs in its own process on 127.0.0.1 (the default model, float32; ``--quick``: a
tiny random model) and each round sends, from client threads on this machine:

- **well-behaved** streams (``/v1/completions``, read to ``[DONE]``), first alone (the
  baseline), then again during the storm;
- **the storm**, started with them: streams whose client disconnects after 1-5 chunks and
  plain requests whose client leaves while they run (each asking for 1,000 tokens), slow
  readers (one chunk every 0.1 s through a small receive buffer), bodies declared at 50 MB
  and bodies streamed past the size limit.

Reported per round, then the median over rounds: clients that disconnected against requests
the server aborted (``tiny_llm_num_aborted_requests_total``), tokens generated for nobody
(the server's ``tiny_llm_generation_tokens_total`` over the storm, less the tokens clients
received: usage for those that stayed, a chunk a token for those that left), the well-behaved
clients' p50/p99 latency with and without the storm, the oversized bodies' answers, and the
server's RSS before the storm and after it.

Every loop is bounded (a fixed number of clients, socket timeouts), and only 127.0.0.1 is
addressed.

    python benches/bench_serve_soak.py          # about 3 minutes on 2 cores (3 rounds)
    python benches/bench_serve_soak.py --quick  # a tiny random model, writes *_quick.*
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

from bench_serve import export_folder, free_port, start
from common import Table, bench_parser, load_model, percentile, save_results, spread

NAME = "bench_serve_soak"
TIMEOUT = 120  # seconds any one client waits on the server
LEAVER_TOKENS = 1000


def stream(port: int, prompt: str, max_tokens: int, leave_after: int | None = None,
           slow: bool = False) -> dict[str, Any]:
    """One streamed completion; ``leave_after`` chunks then disconnect, or ``slow``: read
    a chunk every 0.1 s through a small receive buffer. Returns its latency and tokens."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    conn.connect()
    if slow:
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start_time = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    chunks, usage = 0, None
    while True:
        line = response.readline()
        if not line or line.startswith(b"data: [DONE]"):
            break
        if not line.startswith(b"data: "):
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            usage = event["usage"]["completion_tokens"]
        elif event.get("choices") and event["choices"][0]["text"]:
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                conn.sock.close()  # the client goes away mid-stream
                return {"left": True, "tokens": chunks}
            if slow:
                time.sleep(0.1)
    conn.close()
    return {"left": False, "tokens": usage if usage is not None else chunks,
            "latency": time.perf_counter() - start_time}


def plain_leaver(port: int, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A non-streamed request whose client leaves 0.3 s after sending it."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    time.sleep(0.3)
    conn.sock.close()
    return {"left": True, "tokens": 0}


def oversized(port: int, chunked: bool) -> dict[str, Any]:
    """A body declared at 50 MB, or streamed in 1 MB chunks past the limit: the status."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    head = ("POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
            "Content-Type: application/json\r\n")
    head += ("Transfer-Encoding: chunked\r\n\r\n" if chunked
             else f"Content-Length: {50 << 20}\r\n\r\n")
    start_time = time.perf_counter()
    sock.sendall(head.encode())
    try:
        piece = b"[" + b" " * ((1 << 20) - 1)
        for _ in range(16 if chunked else 1):
            sock.sendall((b"%x\r\n%s\r\n" % (len(piece), piece)) if chunked else piece)
    except OSError:
        pass  # the server answered and closed while the body was still coming
    answer = b""
    while b"\r\n" not in answer:
        data = sock.recv(4096)
        if not data:
            break
        answer += data
    sock.close()
    status = answer.split(b" ")[1].decode() if answer.startswith(b"HTTP/") else "closed"
    return {"status": status, "seconds": time.perf_counter() - start_time}


def run_clients(jobs: list[tuple[str, Any]]) -> list[tuple[str, dict]]:
    results: list[tuple[str, dict]] = [None] * len(jobs)  # type: ignore[list-item]

    def run(i: int) -> None:
        kind, fn = jobs[i]
        try:
            results[i] = (kind, fn())
        except OSError as e:
            results[i] = (kind, {"error": f"{type(e).__name__}: {e}"})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join(TIMEOUT + 30)
    return results


def metric(port: int, name: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def rss_mb(pid: int) -> float:
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    return int(out.stdout.strip() or 0) / 1024


def one_round(proc: subprocess.Popen, port: int, sizes: dict[str, int],
              rng: random.Random) -> dict[str, Any]:
    def prompt(i: int) -> str:
        return f"Request {i}: " + " ".join(f"w{rng.randrange(500)}"
                                           for _ in range(rng.randint(5, 60)))

    n, max_tokens = sizes["well_behaved"], sizes["max_tokens"]
    good = [("good", partial(stream, port, prompt(i), max_tokens)) for i in range(n)]
    baseline = [r["latency"] for _, r in run_clients(good) if "latency" in r]
    rss_before = rss_mb(proc.pid)
    aborted_before = metric(port, "tiny_llm_num_aborted_requests_total")
    generated_before = metric(port, "tiny_llm_generation_tokens_total")
    storm = [("good", partial(stream, port, prompt(i), max_tokens)) for i in range(n)]
    # The leaving clients ask for LEAVER_TOKENS: still running when they go, whatever the model.
    storm += [("leave", partial(stream, port, prompt(i), LEAVER_TOKENS,
                                leave_after=rng.randint(1, 5)))
              for i in range(sizes["disconnects"])]
    storm += [("leave", partial(plain_leaver, port, prompt(i), LEAVER_TOKENS))
              for i in range(sizes["plain_leavers"])]
    storm += [("slow", partial(stream, port, prompt(i), max_tokens, slow=True))
              for i in range(sizes["slow"])]
    storm += [("big", partial(oversized, port, i % 2 == 1)) for i in range(sizes["big"])]
    rng.shuffle(storm)
    results = run_clients(storm)
    deadline = time.monotonic() + 30  # let the server's aborts land
    left = sum(1 for kind, r in results if r.get("left"))
    while metric(port, "tiny_llm_num_aborted_requests_total") - aborted_before < left and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    generated = metric(port, "tiny_llm_generation_tokens_total") - generated_before
    received = sum(r.get("tokens", 0) for _, r in results)
    during = [r["latency"] for kind, r in results if kind == "good" and "latency" in r]
    big = [r for kind, r in results if kind == "big"]
    return {
        "disconnected": left,
        "aborted": metric(port, "tiny_llm_num_aborted_requests_total") - aborted_before,
        "generated": generated, "received": received, "for_nobody": generated - received,
        "errors": [r["error"] for _, r in results if "error" in r],
        "p50_alone": percentile(baseline, 50), "p99_alone": percentile(baseline, 99),
        "p50_storm": percentile(during, 50), "p99_storm": percentile(during, 99),
        "big_statuses": sorted({r["status"] for r in big}),
        "big_max_seconds": max(r["seconds"] for r in big) if big else None,
        "rss_before_mb": rss_before, "rss_after_mb": rss_mb(proc.pid),
    }


def main() -> None:
    args = bench_parser(__doc__).parse_args()
    model, tokenizer, model_name = load_model(args.quick)
    sizes = (dict(well_behaved=6, disconnects=6, plain_leavers=2, slow=2, big=2, max_tokens=16)
             if args.quick else
             dict(well_behaved=16, disconnects=24, plain_leavers=8, slow=4, big=4,
                  max_tokens=48))
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        export_folder(model, tokenizer, folder)
        port = free_port()
        proc = start("tiny-llm", folder, port)
        try:
            stream(port, "warm up", 4)
            for r in range(args.rounds):
                rounds.append(one_round(proc, port, sizes, random.Random(r)))
                print(f"round {r + 1}/{args.rounds}: {rounds[-1]}", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    med = {k: statistics.median(r[k] for r in rounds) for k in (
        "disconnected", "aborted", "generated", "received", "for_nobody", "p50_alone",
        "p99_alone", "p50_storm", "p99_storm", "big_max_seconds", "rss_before_mb",
        "rss_after_mb")}
    ratio = statistics.median(r["p99_storm"] / r["p99_alone"] for r in rounds)
    statuses = sorted({s for r in rounds for s in r["big_statuses"]})
    errors = [e for r in rounds for e in r["errors"]]
    table = Table(
        "Soak: misbehaving clients against well-behaved ones (median over rounds)",
        ["measure", "value"],
        [["clients that disconnected", med["disconnected"]],
         ["requests the server aborted", med["aborted"]],
         ["tokens generated during the storm", med["generated"]],
         ["tokens generated for nobody", med["for_nobody"]],
         ["well-behaved p50 / p99 alone (s)", f"{med['p50_alone']:.2f} / {med['p99_alone']:.2f}"],
         ["well-behaved p50 / p99 in the storm (s)",
          f"{med['p50_storm']:.2f} / {med['p99_storm']:.2f}"],
         ["well-behaved p99, storm / alone (median of per-round ratios)", f"{ratio:.2f}"],
         ["oversized bodies answered (status), slowest answer (s)",
          f"{', '.join(statuses)}; {med['big_max_seconds']:.2f}"],
         ["server RSS before / after the storm (MB)",
          f"{med['rss_before_mb']:.0f} / {med['rss_after_mb']:.0f}"],
         ["client errors (all rounds)", len(errors)]],
        ["", ""],
        f"{model_name}; per round {sizes['well_behaved']} well-behaved streams "
        f"({sizes['max_tokens']} tokens max), then the same with {sizes['disconnects']} "
        f"streams that disconnect after 1-5 chunks, {sizes['plain_leavers']} plain requests "
        f"whose client leaves, {sizes['slow']} slow readers and {sizes['big']} oversized "
        "bodies. Tokens for nobody: the server's generated tokens over the storm less those "
        "clients received (chunks count a token each for the clients that left).")
    save_results(NAME + ("_quick" if args.quick else ""),
                 {"sizes": sizes, "rounds": rounds,
                  "median": {k: spread([r[k] for r in rounds]) for k in med}},
                 [table], plot(rounds), rounds=args.rounds)


def plot(rounds: list[dict[str, Any]]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    x = range(1, len(rounds) + 1)
    for key, style, label in (("p99_alone", "o-", "p99 alone"), ("p99_storm", "s--",
                                                                 "p99 in the storm"),
                              ("p50_alone", "o:", "p50 alone"), ("p50_storm", "s:",
                                                                 "p50 in the storm")):
        a.plot(x, [r[key] for r in rounds], style, label=label)
    a.set_xlabel("round")
    a.set_ylabel("well-behaved latency (s)")
    a.legend(fontsize=7)
    width = 0.4
    b.bar([i - width / 2 for i in x], [r["disconnected"] for r in rounds], width,
          label="clients that disconnected")
    b.bar([i + width / 2 for i in x], [r["aborted"] for r in rounds], width,
          label="requests aborted")
    b.set_xlabel("round")
    b.legend(fontsize=7)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    sys.exit(main())
