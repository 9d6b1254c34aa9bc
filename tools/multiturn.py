#!/usr/bin/env python3
"""Replay a multi-turn chat against an OpenAI-compatible server and print the time to first token
of every turn.

The conversation: a long system prompt, then TURNS user messages of about USER_WORDS words each;
every answer is MAX_TOKENS tokens (greedy, ignore_eos) and is sent back as the assistant message of
the next turn, as a chat client does. Time to first token is measured on the stream, from sending
the request to the first chunk that carries text. Works against `nextn serve` and llama-server.

    python3 tools/multiturn.py --url http://127.0.0.1:8080 [--turns 8] [--system-words 1485]
        [--user-words 150] [--max-tokens 64] [--json out.json]
"""

import argparse
import http.client
import json
import random
import sys
import time
import urllib.parse

WORDS = (
    "the model reads every token of the request before it writes the first one so a long history "
    "costs time on each turn unless the server keeps what it already computed for the prefix that "
    "did not change between two requests of the same conversation while the agent calls its tools "
    "and reads files and writes code and tests and reports what it found"
).split()


def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def turn(url, messages, max_tokens):
    """Stream one chat completion; (time to first text, answer text, usage, timings)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=3600)
    body = json.dumps({
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    })
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        sys.exit(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    ttft = None
    answer = []
    usage = timings = None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        timings = chunk.get("timings") or timings
        for ch in chunk.get("choices", []):
            delta = ch.get("delta", {})
            piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            answer.append(delta.get("content") or "")
    conn.close()
    return ttft, "".join(answer), usage, timings


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-words", type=int, default=1485)
    ap.add_argument("--user-words", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    messages = [{"role": "system", "content": text(rng, a.system_words)}]
    rows = []
    print("turn  prompt_tokens  cached_tokens  ttft_s")
    for i in range(a.turns):
        messages.append({"role": "user", "content": text(rng, a.user_words)})
        ttft, answer, usage, timings = turn(a.url, messages, a.max_tokens)
        messages.append({"role": "assistant", "content": answer})
        usage = usage or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is None and timings:
            cached = timings.get("cache_n")
        rows.append({"turn": i + 1, "prompt_tokens": usage.get("prompt_tokens"),
                     "cached_tokens": cached, "ttft_s": ttft})
        print(f"{i + 1:4}  {usage.get('prompt_tokens', '?'):>13}  {cached if cached is not None else '?':>13}  {ttft:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
