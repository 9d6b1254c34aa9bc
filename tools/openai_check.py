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


def check(cond, what):
    if not cond:
        sys.exit(f"FAIL: {what}")
    print(f"ok: {what}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=None)
    ap.add_argument("--api-key", default="sk-openai-check")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "nextn"))
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start(args.bin, args.api_key)
    try:
        client = openai.OpenAI(base_url=url, api_key=args.api_key, max_retries=0)
        model = client.models.list().data[0].id
        check(bool(model), f"models.list gives the model id {model!r}")

        msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
        text = r.choices[0].message.content
        check(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 24, "chat: finish_reason and usage")
        check(bool(text), "chat: content")

        parts = []
        usage = None
        finish = None
        for chunk in client.chat.completions.create(
            model=model, messages=msgs, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
        ):
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                if ch.delta.content:
                    parts.append(ch.delta.content)
                if ch.finish_reason:
                    finish = ch.finish_reason
        check("".join(parts) == text, "streaming chat gives the same text")
        check(finish == "length" and usage is not None and usage.completion_tokens == 24, "streaming chat: finish_reason and usage chunk")

        c = client.completions.create(model=model, prompt="import os\nimport sys\n", max_tokens=16, temperature=0)
        check(c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 16, "completions")
        streamed = "".join(ch.choices[0].text for ch in client.completions.create(
            model=model, prompt="import os\nimport sys\n", max_tokens=16, temperature=0, stream=True) if ch.choices)
        check(streamed == c.choices[0].text, "streaming completions give the same text")

        try:
            client.chat.completions.create(model="no-such-model", messages=msgs, max_tokens=4)
            check(False, "unknown model is refused")
        except openai.NotFoundError:
            check(True, "unknown model -> NotFoundError")
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
