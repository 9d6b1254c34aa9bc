#!/usr/bin/env python3
"""Talk to `nextn serve` with the official `openai` Python client: chat, streaming chat (with
usage), completions, streaming completions, model listing and error mapping. Exits non-zero on the
first mismatch.

  pip install openai
  python3 tools/openai_check.py                       # starts target/release/nextn serve itself
  python3 tools/openai_check.py --url http://127.0.0.1:8080/v1 --api-key KEY
"""

import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(binary, key):
    port = free_port()
    cmd = [binary, "serve", "--port", str(port), "--spec-type", "nextn", "-np", "4", "--api-key", key, "--log-disable"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while time.time() - t0 < 120:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            pass
        if proc.poll() is not None:
            sys.exit("the server exited during start-up")
        time.sleep(0.05)
    proc.kill()
    sys.exit("the server did not become ready")


def extra(obj, name):
    """A field the OpenAI schema lacks (llama-server's `timings`), kept by the client's models."""
    fields = getattr(obj, "model_extra", None)
    if isinstance(fields, dict) and name in fields:
        return fields[name]
    return getattr(obj, name, None)


def check_timings(t, n, what):
    keys = ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second", "cache_n", "draft_n", "draft_n_accepted")
    check(isinstance(t, dict) and all(k in t for k in keys), f"{what}: timings carries {', '.join(keys)}")
    check(t["predicted_n"] == n and 0 <= t["draft_n_accepted"] <= t["draft_n"], f"{what}: timings agree with usage")


def check_usage(u, n, what):
    check(u is not None and u.completion_tokens == n and u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + n,
          f"{what}: usage {u.prompt_tokens if u else None} + {n} tokens")


def check(cond, what):
    if not cond:
        sys.exit(f"FAIL: {what}")
    print(f"ok: {what}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=None)
    ap.add_argument("--api-key", default="sk-openai-check")
    ap.add_argument("--expect-model", default=None, help="the model id /v1/models must report (the server's --alias)")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "nextn"))
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start(args.bin, args.api_key)
    try:
        client = openai.OpenAI(base_url=url, api_key=args.api_key, max_retries=0)
        model = client.models.list().data[0].id
        check(bool(model) and model == (args.expect_model or model), f"models.list gives the model id {model!r}")

        msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
        text = r.choices[0].message.content
        check(r.object == "chat.completion" and r.model == model and r.choices[0].message.role == "assistant", "chat: object, model and role")
        check(r.choices[0].finish_reason == "length", "chat: finish_reason length")
        check_usage(r.usage, 24, "chat")
        check(bool(text), "chat: content")
        check_timings(extra(r, "timings"), 24, "chat")

        parts = []
        usage = None
        finish = None
        timings = None
        roles = []
        for chunk in client.chat.completions.create(
            model=model, messages=msgs, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
        ):
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                if ch.delta.role:
                    roles.append(ch.delta.role)
                if ch.delta.content:
                    parts.append(ch.delta.content)
                if ch.finish_reason:
                    finish = ch.finish_reason
                    timings = extra(chunk, "timings")
        check(roles == ["assistant"], "streaming chat: one role delta")
        check("".join(parts) == text, "streaming chat gives the same text")
        check(finish == "length", "streaming chat: finish_reason length")
        check_usage(usage, 24, "streaming chat (include_usage)")
        check_timings(timings, 24, "streaming chat finish chunk")

        c = client.completions.create(model=model, prompt="import os\nimport sys\n", max_tokens=16, temperature=0)
        check(c.object == "text_completion" and bool(c.choices[0].text), "completions: object and text")
        check(c.choices[0].finish_reason == "length", "completions: finish_reason length")
        check_usage(c.usage, 16, "completions")
        check_timings(extra(c, "timings"), 16, "completions")
        streamed = "".join(ch.choices[0].text for ch in client.completions.create(
            model=model, prompt="import os\nimport sys\n", max_tokens=16, temperature=0, stream=True) if ch.choices)
        check(streamed == c.choices[0].text, "streaming completions give the same text")

        # A stop string cuts the text before it and ends with finish_reason "stop".
        full = c.choices[0].text
        cut = len(full) // 2
        stop = full[cut:cut + 3]
        s = client.completions.create(model=model, prompt="import os\nimport sys\n", max_tokens=16, temperature=0, stop=[stop])
        check(s.choices[0].finish_reason == "stop" and s.choices[0].text == full[:full.index(stop)],
              f"completions: stop {stop!r} -> finish_reason stop and the text before it")
        s = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0, stop=text[len(text) // 2:len(text) // 2 + 3])
        check(s.choices[0].finish_reason == "stop" and text.startswith(s.choices[0].message.content)
              and len(s.choices[0].message.content) < len(text), "chat: stop -> finish_reason stop")

        r = client.chat.completions.create(model="gpt-4o-mini", messages=msgs, max_tokens=4, temperature=0)
        check(r.choices[0].message.content == text[:len(r.choices[0].message.content)],
              "any model name is answered (as llama-server does)")
        try:
            client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=-3)
            check(False, "bad temperature is refused")
        except openai.BadRequestError:
            check(True, "invalid field -> BadRequestError")
        bad = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0)
        try:
            bad.models.list()
            check(False, "wrong key is refused")
        except openai.AuthenticationError:
            check(True, "wrong key -> AuthenticationError")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    print("all openai client checks passed")


if __name__ == "__main__":
    main()
