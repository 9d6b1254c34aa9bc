#!/usr/bin/env python3
"""A hostile client against `nextn serve`, on loopback only: requests that try to pin the server's
memory or make it work for nothing, each of which must be refused with a 4xx that names the
problem, while the server's resident memory stays put and it goes on answering.

The server must run with a vision tower, two API keys, debug logging and image URLs allowed
(public addresses only), e.g.

  nextn serve -m MODEL --mmproj MMPROJ -np 1 -c 2048 --api-key k1,k2 --verbose --allow-image-urls
  python3 tools/hostile_check.py --url http://127.0.0.1:8080 --pid PID --key k1 --other-key k2

What it sends:
- requests with tens of thousands of unknown top-level fields (and an invalid `max_tokens`);
- requests of thousands of tiny PNG files whose headers declare huge pictures (over the server's
  image cap), and of a hundred such pictures (over the context);
- requests with a hundred image URLs (over the URL cap), and with URLs at private addresses
  (10/8, 192.168/16, 169.254/16: refused before any connection, so no packet leaves the machine);
- replays of a stored response with `previous_response_id`, from its own API key with a bad field
  and from another key (which must not see it), and the other key's GET and DELETE of it.

It prints the server's RSS before and after (VmRSS from /proc, so the server runs on this
machine) and fails if it grew by more than --max-growth-mib, if any hostile request was not a 4xx
naming its problem, or if /health and a greedy request stop answering as before. With
--measure-only it sends the same requests and prints RSS without checking the answers (for a
server that predates the checks).
"""

import argparse
import base64
import http.client
import json
import random
import struct
import sys
import time
import zlib

FAILURES = []


def check(cond, what):
    if cond:
        print(f"ok: {what}")
    else:
        print(f"FAIL: {what}")
        FAILURES.append(what)


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Client:
    def __init__(self, url):
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        self.host, self.port = host, int(port)

    def send(self, method, path, key=None, body=None):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=300)
        headers = {"content-type": "application/json"}
        if key:
            headers["authorization"] = f"Bearer {key}"
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        raw = r.read()
        conn.close()
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = {"raw": raw[:300].decode(errors="replace")}
        return r.status, payload


def png_declaring(width, height):
    """A PNG of a few dozen bytes whose header says width x height 8-bit RGB."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + \
        chunk(b"IEND", b"")


def data_uri(png):
    return "data:image/png;base64," + base64.b64encode(png).decode()


def error_of(payload):
    e = payload.get("error", {})
    return e.get("param") or "", e.get("message") or ""


def hostile_requests(a, stored_id):
    """(what, method, path, key, body, accepted statuses, words the error must name) for each."""
    rnd = random.Random(7)
    reqs = []
    for n in range(a.rounds):
        keys = {f"zz_{rnd.getrandbits(96):024x}": 1 for _ in range(a.unknown_keys)}
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5, **keys}
        reqs.append((f"{a.unknown_keys} unknown fields ({n})", "POST", "/v1/chat/completions", a.key,
                     json.dumps(body).encode(), {400}, ["max_tokens"]))
    huge = data_uri(png_declaring(16000, 16000))
    for n in range(a.rounds):
        parts = [{"type": "text", "text": "look"}] + \
            [{"type": "image_url", "image_url": {"url": huge}}] * a.tiny_images
        reqs.append((f"{a.tiny_images} tiny images declaring 16000x16000 ({n})", "POST", "/v1/chat/completions",
                     a.key, {"messages": [{"role": "user", "content": parts}], "max_tokens": 1}, {400},
                     ["--max-images"]))
    big = data_uri(png_declaring(4096, 4096))
    for n in range(a.rounds):
        parts = [{"type": "image_url", "image_url": {"url": big}}] * 100
        reqs.append((f"100 images declaring 4096x4096 ({n})", "POST", "/v1/chat/completions", a.key,
                     {"messages": [{"role": "user", "content": parts}], "max_tokens": 1}, {400}, ["context"]))
        blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                               "data": big.split(",", 1)[1]}}] * 100
        reqs.append((f"Messages: 100 images declaring 4096x4096 ({n})", "POST", "/v1/messages", a.key,
                     {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": blocks}]}, {400},
                     ["context"]))
    for n in range(a.rounds):
        urls = [{"type": "image_url", "image_url": {"url": f"http://10.{i}.0.1/a.png"}} for i in range(100)]
        reqs.append((f"100 image URLs ({n})", "POST", "/v1/chat/completions", a.key,
                     {"messages": [{"role": "user", "content": urls}], "max_tokens": 1}, {400},
                     ["image_url.url", "--image-urls-max"]))
        private = [{"type": "input_image", "image_url": u} for u in
                   ("http://10.0.0.1/a.png", "http://192.168.1.1/a.png", "http://169.254.169.254/latest/meta-data")]
        reqs.append((f"Responses: image URLs at private addresses ({n})", "POST", "/v1/responses", a.key,
                     {"input": [{"role": "user", "content": private}], "max_output_tokens": 1}, {400},
                     ["input[0].content[0].image_url", "could not be fetched"]))
    for n in range(a.replays):
        reqs.append((f"replay of a stored response with a bad field ({n})", "POST", "/v1/responses", a.key,
                     {"previous_response_id": stored_id, "input": "again", "max_output_tokens": 0}, {400},
                     ["max_output_tokens"]))
        reqs.append((f"another key continuing a stored response ({n})", "POST", "/v1/responses", a.other_key,
                     {"previous_response_id": stored_id, "input": "again", "max_output_tokens": 1}, {400},
                     ["previous_response_id", "not found"]))
    reqs.append(("another key reading a stored response", "GET", f"/v1/responses/{stored_id}", a.other_key, None,
                 {404}, ["not found"]))
    reqs.append(("another key deleting a stored response", "DELETE", f"/v1/responses/{stored_id}", a.other_key,
                 None, {404}, ["not found"]))
    return reqs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--pid", type=int, required=True, help="the server's process, for its RSS")
    ap.add_argument("--key", required=True)
    ap.add_argument("--other-key", required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--unknown-keys", type=int, default=100_000)
    ap.add_argument("--tiny-images", type=int, default=2000)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--max-growth-mib", type=float, default=50)
    ap.add_argument("--measure-only", action="store_true")
    a = ap.parse_args()
    c = Client(a.url)

    greedy = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8, "temperature": 0}
    status, first = c.send("POST", "/v1/chat/completions", a.key, greedy)
    check(status == 200, f"a normal request is answered ({status})")
    status, stored = c.send("POST", "/v1/responses", a.key,
                            {"input": "remember this " * 200, "max_output_tokens": 1, "store": True})
    check(status == 200 and stored.get("id", "").startswith("resp_"), f"a response is stored ({status})")
    stored_id = stored.get("id", "resp_missing")
    status, _ = c.send("GET", f"/v1/responses/{stored_id}", a.key)
    check(status == 200, f"its own key reads it ({status})")

    reqs = hostile_requests(a, stored_id)
    # One of each kind first, so what the allocator keeps after a request is counted before.
    seen = set()
    for what, method, path, key, body, _, _ in reqs:
        kind = what.split(" (")[0]
        if kind not in seen:
            seen.add(kind)
            c.send(method, path, key, body)
    time.sleep(0.5)
    before = rss_mib(a.pid)
    t0 = time.monotonic()
    refused = {}
    for what, method, path, key, body, statuses, words in reqs:
        kind = what.split(" (")[0]
        status, payload = c.send(method, path, key, body)
        param, message = error_of(payload)
        named = all(w in param or w in message for w in words)
        ok = status in statuses and named
        refused.setdefault(kind, []).append(ok)
        if not ok and not a.measure_only:
            print(f"  {what}: {status} param={param!r} message={message[:300]!r}")
    wall = time.monotonic() - t0
    time.sleep(0.5)
    after = rss_mib(a.pid)
    print(f"server RSS: {before:.1f} MiB before, {after:.1f} MiB after {len(reqs)} hostile requests "
          f"in {wall:.1f} s (growth {after - before:+.1f} MiB)")
    if a.measure_only:
        return
    for kind, oks in refused.items():
        check(all(oks), f"{kind}: {sum(oks)}/{len(oks)} refused with a 4xx naming the problem")
    check(after - before <= a.max_growth_mib,
          f"RSS grew {after - before:.1f} MiB (at most {a.max_growth_mib:.0f})")
    status, health = c.send("GET", "/health")
    check(status == 200 and health.get("status") == "ok", f"/health answers ({status} {health})")
    status, again = c.send("POST", "/v1/chat/completions", a.key, greedy)
    same = status == 200 and again["choices"][0]["message"] == first["choices"][0]["message"]
    check(same, "the normal request is answered as before")
    status, _ = c.send("GET", f"/v1/responses/{stored_id}", a.key)
    check(status == 200, f"the stored response is still its key's ({status})")
    if FAILURES:
        sys.exit(1)
    print("hostile client checks passed")


if __name__ == "__main__":
    main()
