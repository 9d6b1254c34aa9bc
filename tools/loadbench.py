#!/usr/bin/env python3
"""Load bench for `nextn serve`: aggregate and per-request decode speed at several concurrency
levels for plain decoding, always-on MTP drafting, the fixed drafting throttle and `auto`.

It starts one server per mode on a free loopback port (one after the other, so that each one's
start-up timing of its passes runs alone; idle servers cost nothing), then for every round,
concurrency level and mode runs C client threads that together send the same number of
/v1/completions requests (temperature 0, fixed length, each thread back to back).
Rounds interleave the modes so that drift in machine load hits them alike; the table reports the
median over rounds.

Usage:
  python3 tools/loadbench.py [--bin target/release/nextn] [-m MODEL] [--levels 1,2,4,8,16]
                             [--requests 24] [--tokens 48] [--rounds 3] [--throttle 2]
                             [--nice -5] [--markdown out.md] [--json out.json]
  python3 tools/loadbench.py --url http://127.0.0.1:8080 --levels 1,4   # one running server

Only the Python standard library is used.
"""

import argparse
import http.client
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_PROMPTS = os.path.join(ROOT, "crates", "nextn", "bench", "prompts.jsonl")


def load_prompts(path):
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                prompts.append(json.loads(line)["prompt"])
    if not prompts:
        sys.exit(f"no prompts in {path}")
    return prompts


def post(host, port, path, body, timeout=600):
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        payload = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {payload[:300]!r}")
        return json.loads(payload)
    finally:
        conn.close()


def get(host, port, path, timeout=10):
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name, binary, model, args, threads, slots, nice=0):
        self.name = name
        self.port = free_port()
        cmd = ["nice", "-n", str(nice)] if nice else []
        cmd += [binary, "serve", "--port", str(self.port), "-np", str(slots), "--log-disable"]
        if threads:
            cmd += ["-t", str(threads)]
        if model:
            cmd += ["-m", model]
        cmd += args
        self.cmd = cmd
        self.log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"loadbench-{name}-{self.port}.log"), "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, cwd=ROOT)

    def wait_ready(self, timeout=180):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                sys.exit(f"server {self.name} exited; see {self.log.name}")
            try:
                status, _ = get("127.0.0.1", self.port, "/health")
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        sys.exit(f"server {self.name} not ready after {timeout} s")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def metrics(host, port):
    _, body = get(host, port, "/metrics")
    out = {}
    for line in body.decode().splitlines():
        m = re.match(r"^([a-z_:]+(?:\{[^}]*\})?) ([-0-9.e+]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def run_cell(host, port, prompts, concurrency, requests, tokens, references=None):
    """C threads sending `requests` completions in all (at least one each), each thread back to
    back. With `references` (prompt -> the plain output's token ids) each request sends its
    plain output, for a server run with --force-acceptance. Returns a result dict."""
    per_client = max(1, -(-requests // concurrency))
    results = []
    errors = []
    lock = threading.Lock()
    before = metrics(host, port)

    def client(k):
        for r in range(per_client):
            prompt = prompts[(k * per_client + r) % len(prompts)]
            body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
            if references is not None:
                body["forced_acceptance_reference"] = references[prompt]
                body["seed"] = k * per_client + r
            t = time.time()
            try:
                out = post(host, port, "/v1/completions", body)
            except Exception as e:  # noqa: BLE001 - reported, the bench goes on
                with lock:
                    errors.append(str(e))
                continue
            wall = time.time() - t
            with lock:
                results.append((out["usage"]["completion_tokens"], wall, out["timings"]))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    t0 = time.time()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.time() - t0
    after = metrics(host, port)
    if errors:
        print(f"  {len(errors)} errors, first: {errors[0]}", file=sys.stderr)
    total = sum(r[0] for r in results)
    per_request = [r[2]["predicted_per_second"] for r in results if r[2]["predicted_ms"] > 0]
    ttft = [r[2]["prompt_ms"] for r in results]
    drafted = after.get("llamacpp:spec_decode_num_draft_tokens_total", 0) - before.get("llamacpp:spec_decode_num_draft_tokens_total", 0)
    accepted = after.get("llamacpp:spec_decode_num_accepted_tokens_total", 0) - before.get("llamacpp:spec_decode_num_accepted_tokens_total", 0)
    return {
        "aggregate_tps": total / wall if wall > 0 else 0.0,
        # The median request: a mean of rates would be pulled up by a few lucky short ones.
        "per_request_tps": statistics.median(per_request) if per_request else 0.0,
        "prompt_ms": statistics.median(ttft) if ttft else 0.0,
        "tokens": total,
        "wall_s": wall,
        "drafted": drafted,
        "accepted": accepted,
        "errors": len(errors),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "nextn"))
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--url", default=None, help="bench one running server instead of starting the four modes")
    ap.add_argument("--levels", default="1,2,4,8,16")
    ap.add_argument("--requests", type=int, default=24, help="requests per cell, spread over the clients (at least one each)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--throttle", type=int, default=2, help="N of the fixed throttle (--spec-max-drafting-slots N)")
    ap.add_argument("--n-max", type=int, default=3, help="--spec-draft-n-max for the MTP modes")
    ap.add_argument("--threads", type=int, default=0, help="-t for the servers (default: the server's own)")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--modes", default="plain,mtp,throttle,auto", help="comma list of plain, mtp, throttle, auto, each optionally with a draft depth (mtp1, auto4)")
    ap.add_argument("--nice", type=int, default=0, help="run the servers under `nice -n N` (negative: ahead of other work on a shared machine)")
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS)
    ap.add_argument("--force-acceptance", default=None, metavar="RATES",
                    help="run the MTP modes at these per-position acceptance rates (e.g. 0.95,0.86,0.75): the servers get "
                         "--force-acceptance and every request sends the plain output of its prompt, recorded first")
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="draw aggregate tok/s against concurrency per mode into this PNG (needs matplotlib)")
    args = ap.parse_args()
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (checked before the bench runs for minutes)
        except ImportError:
            sys.exit("--plot needs matplotlib: python3 -m pip install matplotlib")

    levels = [int(x) for x in args.levels.split(",")]
    prompts = load_prompts(args.prompts)
    def mode_args(mode):
        """plain | mtp | throttle | auto, optionally with the draft depth: mtp2, auto4, ..."""
        m = re.fullmatch(r"(plain|mtp|throttle|auto)(\d*)", mode)
        if not m:
            sys.exit(f"unknown mode {mode!r}: use plain, mtp, throttle or auto, optionally with a depth (mtp2)")
        kind, depth = m.group(1), m.group(2) or str(args.n_max)
        forced = ["--force-acceptance", args.force_acceptance] if args.force_acceptance else []
        if kind == "plain":
            return ["--spec-type", "none"]
        spec = ["--spec-type", "nextn", "--spec-draft-n-max", depth] + forced
        drafting = {"mtp": str(args.slots), "throttle": str(args.throttle), "auto": "auto"}[kind]
        return spec + ["--spec-max-drafting-slots", drafting]

    servers = []
    # A terminated bench still stops the servers it started (the `finally` below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("loadbench: terminated"))
    try:
        if args.url:
            u = urllib.parse.urlparse(args.url)
            targets = [("server", u.hostname or "127.0.0.1", u.port or 80)]
        else:
            modes = [m for m in args.modes.split(",") if m]
            # One at a time: each server times its passes at start-up (auto's cost curves), and
            # servers calibrating side by side would time each other's contention instead.
            for m in modes:
                servers.append(Server(m, args.bin, args.model, mode_args(m), args.threads, args.slots, args.nice))
                servers[-1].wait_ready()
            targets = [(s.name, "127.0.0.1", s.port) for s in servers]
        for name, host, port in targets:
            post(host, port, "/v1/completions", {"prompt": prompts[0], "max_tokens": 8, "temperature": 0})
        references = None
        if args.force_acceptance:
            # Greedy output is the same whatever a server drafts: record it once, from the first.
            _, host, port = targets[0]
            references = {}
            for p in prompts:
                out = post(host, port, "/v1/completions",
                           {"prompt": p, "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True, "return_tokens": True})
                references[p] = out["choices"][0]["tokens"]
        cells = {}
        for rnd in range(args.rounds):
            for c in levels:
                for name, host, port in targets:
                    # Plain decoding drafts nothing to steer: its requests go as they are.
                    refs = None if name.startswith("plain") else references
                    r = run_cell(host, port, prompts, c, args.requests, args.tokens, refs)
                    cells.setdefault((name, c), []).append(r)
                    print(f"round {rnd + 1} c={c:<2} {name:<9} aggregate {r['aggregate_tps']:7.1f} tok/s, per request {r['per_request_tps']:6.1f} tok/s, "
                          f"drafted {r['drafted']:.0f} accepted {r['accepted']:.0f}", file=sys.stderr)
    finally:
        for s in servers:
            s.stop()

    names = [t[0] for t in targets]

    def med(name, c, key):
        return statistics.median(x[key] for x in cells[(name, c)])

    lines = []
    head = "| concurrency | " + " | ".join(f"{n} agg | {n} per-req" for n in names) + " |"
    lines.append(head)
    lines.append("|" + "---|" * (1 + 2 * len(names)))
    for c in levels:
        row = [str(c)]
        for n in names:
            row.append(f"{med(n, c, 'aggregate_tps'):.1f}")
            row.append(f"{med(n, c, 'per_request_tps'):.1f}")
        lines.append("| " + " | ".join(row) + " |")
    acc = []
    for n in names:
        d = sum(x["drafted"] for c in levels for x in cells[(n, c)])
        a = sum(x["accepted"] for c in levels for x in cells[(n, c)])
        if d > 0:
            acc.append(f"{n}: {a:.0f}/{d:.0f} drafts accepted ({a / d:.2f})")
    table = "\n".join(lines)
    print(table)
    if acc:
        print("; ".join(acc))
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(table + "\n")
            if acc:
                f.write("\n" + "; ".join(acc) + "\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({f"{n}@{c}": cells[(n, c)] for (n, c) in cells}, f, indent=1)
    if args.plot:
        plot(args.plot, names, levels, med)


def plot(path, names, levels, med):
    """Aggregate and per-request tokens/s against concurrency, one line per mode (medians)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (agg, per) = plt.subplots(1, 2, figsize=(11, 4.2))
    for n in names:
        agg.plot(levels, [med(n, c, "aggregate_tps") for c in levels], marker="o", label=n)
        per.plot(levels, [med(n, c, "per_request_tps") for c in levels], marker="o", label=n)
    for ax, title in ((agg, "aggregate tokens/s"), (per, "tokens/s per request")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    agg.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
