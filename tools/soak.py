#!/usr/bin/env python3
"""Soak a server with many concurrent multi-turn conversations, then check every answer against
the same conversation run one at a time on a reference server.

CONVERSATIONS clients talk at once, each through conversations of TURNS turns, until DURATION
seconds have passed (a conversation under way is finished). Half of them share one system prompt,
as agents of one tool do; the others each have their own. Every answer is MAX_TOKENS tokens
(greedy, ignore_eos) and goes back as the assistant message of the next turn. While they run, the
server's resident memory (with --pid) and its prefix-cache gauges from /metrics are sampled every
second. Afterwards each finished conversation is replayed alone against --ref-url (a server with
the same model, e.g. `-np 1 --cache-ram 0`), and its answers must be the same, turn by turn.

    python3 tools/soak.py --url http://127.0.0.1:8080 --ref-url http://127.0.0.1:8081 \
        [--pid PID] [--conversations 16] [--turns 4] [--duration 300] [--budget-mib 256] \
        [--json out.json]

Exits 1 when a request failed, an answer differed, or the cache held more than --budget-mib.
Uses the official `openai` client.
"""

import argparse
import json
import random
import sys
import threading
import time
import urllib.request

from openai import OpenAI

WORDS = (
    "the agent reads a file and runs the tests then edits the function that failed and explains "
    "what changed in the parser the cache the server and the client so that the next request of "
    "the same conversation starts from what the model already computed"
).split()


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def metrics(url):
    """The server's Prometheus gauges as a dict (name -> value)."""
    out = {}
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, value = line.rsplit(" ", 1)
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def conversation(seed, shared_system, args):
    """The fixed part of one conversation: its system prompt and user messages."""
    rng = random.Random(seed)
    system = shared_system if seed % 2 == 0 else words(rng, args.system_words)
    users = [words(rng, args.user_words) for _ in range(args.turns)]
    return {"seed": seed, "system": system, "users": users}


def model_id(client):
    """The first model the server lists (requests name it, as clients do)."""
    return client.models.list().data[0].id


def talk(client, conv, args):
    """Run a conversation; its answers and the cached prompt tokens of each turn."""
    messages = [{"role": "system", "content": conv["system"]}]
    answers, cached = [], []
    for user in conv["users"]:
        messages.append({"role": "user", "content": user})
        r = client.chat.completions.create(
            model=args.model,
            messages=messages,
            max_tokens=args.max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        answer = r.choices[0].message.content or ""
        details = r.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details else 0)
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer})
    return answers, cached


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True, help="the server under test")
    ap.add_argument("--ref-url", required=True, help="a reference server for one-at-a-time runs")
    ap.add_argument("--pid", type=int, help="the tested server's process id, to sample its RSS")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--duration", type=float, default=300)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--user-words", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--budget-mib", type=float, help="fail if nextn:cache_bytes exceeds this")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()

    client = OpenAI(base_url=args.url + "/v1", api_key="none", max_retries=0, timeout=3600)
    args.model = model_id(client)
    shared_system = words(random.Random(0), args.system_words)
    deadline = time.monotonic() + args.duration
    done, errors = [], []
    lock = threading.Lock()

    def worker(w):
        round_no = 0
        while time.monotonic() < deadline:
            conv = conversation(w * 1000 + round_no, shared_system, args)
            round_no += 1
            try:
                answers, cached = talk(client, conv, args)
            except Exception as e:  # every failure is reported, none ends the soak early
                with lock:
                    errors.append(f"conversation {conv['seed']}: {type(e).__name__}: {e}")
                time.sleep(1.0)
                continue
            with lock:
                done.append({**conv, "answers": answers, "cached": cached})

    samples = []
    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            m = metrics(args.url)
            samples.append({
                "t": time.monotonic(),
                "rss_mib": rss_mib(args.pid) if args.pid else None,
                "cache_mib": m.get("nextn:cache_bytes", 0) / 2**20,
                "evictions": m.get("nextn:cache_evictions_total", 0),
            })
            stop.wait(1.0)

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(args.conversations)]
    s = threading.Thread(target=sampler)
    s.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    s.join()
    elapsed = time.monotonic() - t0
    final = metrics(args.url)

    ref = OpenAI(base_url=args.ref_url + "/v1", api_key="none", max_retries=0, timeout=3600)
    mismatches = []
    for conv in sorted(done, key=lambda c: c["seed"]):
        alone, _ = talk(ref, conv, args)
        for i, (a, b) in enumerate(zip(conv["answers"], alone)):
            if a != b:
                mismatches.append(f"conversation {conv['seed']} turn {i + 1}: {a!r} != {b!r}")
                break

    rss = [x["rss_mib"] for x in samples if x["rss_mib"] is not None]
    report = {
        "seconds": round(elapsed, 1),
        "conversations": len(done),
        "turns": sum(len(c["answers"]) for c in done),
        "errors": len(errors),
        "first_errors": errors[:10],
        "mismatches": len(mismatches),
        "first_mismatches": mismatches[:10],
        "cached_prompt_tokens": final.get("nextn:prompt_tokens_cached_total", 0),
        "processed_prompt_tokens": final.get("llamacpp:prompt_tokens_total", 0),
        "cache_mib_max": round(max((x["cache_mib"] for x in samples), default=0), 1),
        "evictions": final.get("nextn:cache_evictions_total", 0),
        "rss_mib_first": round(rss[0], 1) if rss else None,
        "rss_mib_max": round(max(rss), 1) if rss else None,
        "samples": len(samples),
    }
    over = args.budget_mib is not None and report["cache_mib_max"] > args.budget_mib
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report, "trace": samples}, f)
    if errors or mismatches or over:
        sys.exit(1)


if __name__ == "__main__":
    main()
