#!/usr/bin/env python3
"""Run Claude Code (npm `@anthropic-ai/claude-code`, tools/claude_code) in print mode against a
server's Anthropic Messages API, through a recording proxy, and check the protocol: every request
got a well-formed answer (status 200; a stream that opens with message_start, closes every block
it opens and ends with message_stop; JSON bodies of the SDK's shapes), the run ended without an
API error, and the second request read the prefix cache (cache_read_input_tokens > 0). Prints the
run's wall time and each request's time to first token.

  npm ci --prefix tools/claude_code
  python3 tools/claude_code_check.py --url http://127.0.0.1:8080 --api-key KEY
"""

import argparse
import http.client
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLAUDE = os.path.join(ROOT, "tools", "claude_code", "node_modules", ".bin", "claude")


class Recorder(http.server.BaseHTTPRequestHandler):
    upstream = None
    records = []
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def forward(self):
        t0 = time.monotonic()
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        up = urllib.parse.urlsplit(self.upstream)
        conn = http.client.HTTPConnection(up.hostname, up.port, timeout=600)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection", "accept-encoding")}
        conn.request(self.command, self.path, body=body, headers=headers)
        r = conn.getresponse()
        self.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("connection", "close")
        self.end_headers()
        data, first_token = b"", None
        streamed = "text/event-stream" in (r.getheader("content-type") or "")
        while True:
            chunk = r.read1(65536) if hasattr(r, "read1") else r.read(65536)
            if not chunk:
                break
            # A stream's first token is its first content delta; a whole answer's, its body.
            if first_token is None and (b"content_block_delta" in data + chunk or not streamed):
                first_token = time.monotonic() - t0
            data += chunk
            self.wfile.write(chunk)
            self.wfile.flush()
        with self.lock:
            self.records.append({"path": self.path, "status": r.status, "request": body, "body": data,
                                 "ttft": first_token, "total": time.monotonic() - t0,
                                 "stream": "text/event-stream" in (r.getheader("content-type") or "")})
        self.close_connection = True

    do_POST = forward
    do_GET = forward


def sse_events(data):
    events = []
    for frame in data.decode().split("\n\n"):
        if not frame.strip():
            continue
        lines = [line for line in frame.split("\n") if not line.startswith(":")]
        if not lines:
            continue  # a comment frame (a keep-alive), which SSE clients skip
        name, payload = None, None
        for line in lines:
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                payload = json.loads(line[6:])
        if name is None or payload is None or payload.get("type") != name:
            raise ValueError(f"malformed frame {frame[:200]!r}")
        events.append(payload)
    return events


def check_stream(events):
    """The usage of a well-formed stream, or an error."""
    kinds = [e["type"] for e in events]
    if kinds[0] != "message_start" or kinds[-1] != "message_stop" or "error" in kinds:
        raise ValueError(f"stream events {kinds[:3]}...{kinds[-3:]}")
    open_blocks = set()
    for e in events:
        if e["type"] == "content_block_start":
            open_blocks.add(e["index"])
        elif e["type"] == "content_block_stop":
            open_blocks.remove(e["index"])
        elif e["type"] == "content_block_delta" and e["index"] not in open_blocks:
            raise ValueError(f"delta for a closed block {e}")
    if open_blocks:
        raise ValueError(f"blocks left open {open_blocks}")
    delta = [e for e in events if e["type"] == "message_delta"]
    if len(delta) != 1 or delta[0]["delta"]["stop_reason"] not in ("end_turn", "max_tokens", "stop_sequence", "tool_use"):
        raise ValueError(f"message_delta {delta}")
    usage = dict(events[0]["message"]["usage"])
    usage.update(delta[0]["usage"])
    return usage


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8080")
    ap.add_argument("--api-key", default="sk-local")
    ap.add_argument("--claude", default=CLAUDE)
    ap.add_argument("--max-output-tokens", default="48")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--output-format", choices=["json", "stream-json"], default="json",
                    help="stream-json runs Claude Code with --verbose, as SDK hosts do (it then asks "
                         "for thinking.display \"updates\")")
    ap.add_argument("--save-requests", metavar="DIR",
                    help="write each Messages request body to DIR/request-N.json (to replay a real "
                         "agent's prompts against another server)")
    a = ap.parse_args()
    Recorder.upstream = a.url
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    work = tempfile.mkdtemp(prefix="claude-code-check-")
    for name in ("README.md", "main.py"):
        with open(os.path.join(work, name), "w") as f:
            f.write(f"{name}\n")
    home = tempfile.mkdtemp(prefix="claude-code-home-")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_")) and
           k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env.update({
        "HOME": home, "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{proxy.server_address[1]}",
        "ANTHROPIC_API_KEY": a.api_key, "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": a.max_output_tokens, "NO_PROXY": "127.0.0.1,localhost",
    })
    t0 = time.monotonic()
    command = [a.claude, "-p", "List the files here.", "--output-format", a.output_format]
    if a.output_format == "stream-json":
        command.append("--verbose")
    run = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=a.timeout)
    wall = time.monotonic() - t0
    proxy.shutdown()
    failures = []
    try:
        if a.output_format == "json":
            result = json.loads(run.stdout)
        else:
            # One JSON event a line; the run's outcome is the last, of type "result".
            events = [json.loads(line) for line in run.stdout.splitlines() if line.strip()]
            result = events[-1]
            if result.get("type") != "result":
                raise ValueError(f"last event {result.get('type')}")
    except (ValueError, IndexError):
        result = {}
        failures.append(f"claude printed no JSON result (exit {run.returncode}): {run.stdout[-2000:]} {run.stderr[-2000:]}")
    # A synthesized model writes noise until the token limit; Claude Code then asks for more a
    # few times and gives up with its own `max_output_tokens` error. That is the agent's reaction
    # to well-formed answers, not a protocol error; any other error is.
    gave_up_at_limit = result.get("api_error") == "max_output_tokens" and not result.get("api_error_status")
    if result.get("api_error_status") or (
            (result.get("is_error") or result.get("terminal_reason") == "api_error") and not gave_up_at_limit):
        failures.append(f"the run ended with an error: {json.dumps(result)[:2000]}")
    messages = [r for r in Recorder.records if urllib.parse.urlsplit(r["path"]).path == "/v1/messages"]
    usages = []
    for i, r in enumerate(Recorder.records):
        try:
            if r["status"] != 200:
                raise ValueError(f"status {r['status']}: {r['body'][:500]!r}")
            if r["stream"]:
                usage = check_stream(sse_events(r["body"]))
            else:
                body = json.loads(r["body"])
                usage = body.get("usage", {})
                if "/v1/messages" == urllib.parse.urlsplit(r["path"]).path and (
                        body.get("type") != "message" or not body["id"].startswith("msg_")):
                    raise ValueError(f"not a message: {body}")
            if r in messages:
                usages.append(usage)
        except (ValueError, KeyError, IndexError) as e:
            failures.append(f"request {i} ({r['path']}): {e}")
            if r in messages:
                usages.append({})
    if len(messages) < 2:
        failures.append(f"Claude Code sent {len(messages)} Messages requests; the cache check needs two")
    elif not usages[1].get("cache_read_input_tokens", 0) > 0:
        failures.append(f"the second request read nothing from the prefix cache: {usages[1]}")
    print(f"claude code ({a.output_format}) {run.returncode}: wall {wall:.2f} s, {len(Recorder.records)} requests, "
          f"ended: {result.get('terminal_reason')} {result.get('api_error') or ''}")
    if a.save_requests:
        os.makedirs(a.save_requests, exist_ok=True)
        for i, r in enumerate(messages):
            with open(os.path.join(a.save_requests, f"request-{i}.json"), "wb") as f:
                f.write(r["request"])
    for r, u in zip(messages, usages):
        ttft = f"{r['ttft']:.3f} s" if r["ttft"] is not None else "-"
        print(f"  {r['path']}: time to first token {ttft}, total {r['total']:.3f} s, usage {json.dumps(u)}")
    if failures:
        for f in failures:
            print("FAILED:", f, file=sys.stderr)
        sys.exit(1)
    print("claude code check passed")


if __name__ == "__main__":
    main()
