#!/usr/bin/env python3
"""Talk to `nextn serve`'s Messages API with the official `anthropic` Python client:
messages.create, messages.stream (through the client's own stream accumulator), a tool-use round
trip with tool_choice "any", thinking blocks, stop sequences, count_tokens, and the client's
exceptions for a bad key and a bad request. Exits non-zero on the first mismatch.

  pip install anthropic
  python3 tools/anthropic_check.py --url http://127.0.0.1:8080 --api-key KEY
"""

import argparse
import json
import sys
import urllib.request

import anthropic

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "London"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
    },
}


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


def usage_ok(u):
    return u.input_tokens >= 0 and u.output_tokens >= 1 and u.cache_read_input_tokens is not None \
        and u.cache_creation_input_tokens is not None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--api-key", required=True)
    a = ap.parse_args()
    client = anthropic.Anthropic(base_url=a.url, api_key=a.api_key, max_retries=0)

    # A plain answer; the same prompt again resumes from the prefix cache.
    system = [{"type": "text", "text": "You are terse. " * 40, "cache_control": {"type": "ephemeral"}}]
    msgs = [{"role": "user", "content": "Say hello."}]
    m = client.messages.create(model="any-name", max_tokens=12, system=system, messages=msgs,
                               extra_body={"temperature": 0}, thinking={"type": "disabled"}, metadata={"user_id": "u1"})
    check(m.id.startswith("msg_") and m.type == "message" and m.role == "assistant", f"envelope {m}")
    check(m.model == "any-name", "model echoed")
    check(m.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {m.stop_reason}")
    check(all(b.type == "text" for b in m.content) and m.content, f"text blocks {m.content}")
    check(usage_ok(m.usage), f"usage {m.usage}")
    first_total = m.usage.input_tokens + m.usage.cache_read_input_tokens
    m2 = client.messages.create(model="any-name", max_tokens=4, system=system, messages=msgs,
                                extra_body={"temperature": 0}, thinking={"type": "disabled"})
    check(m2.usage.cache_read_input_tokens > 0, f"second request reads the prefix cache: {m2.usage}")
    check(m2.usage.input_tokens + m2.usage.cache_read_input_tokens == first_total, "same prompt size")

    # count_tokens counts what a request would run.
    n = client.messages.count_tokens(model="x", system=system, messages=msgs, thinking={"type": "disabled"})
    check(n.input_tokens == first_total, f"count_tokens {n.input_tokens} vs {first_total}")

    # Streaming through the client's accumulator, with thinking on.
    with client.messages.stream(model="m", max_tokens=1100, messages=msgs, extra_body={"temperature": 0},
                                thinking={"type": "enabled", "budget_tokens": 1024}) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    check(kinds[0] == "message_start" and kinds[-1] == "message_stop", f"stream events {kinds[:4]}..{kinds[-3:]}")
    check("content_block_start" in kinds and "message_delta" in kinds, f"events {set(kinds)}")
    thinking = [b for b in final.content if b.type == "thinking"]
    check(final.content and all(b.signature for b in thinking), f"thinking blocks signed: {final.content}")
    check(not thinking or final.content[0].type == "thinking", f"thinking first: {final.content}")
    check(final.stop_reason in ("end_turn", "max_tokens"), f"stream stop_reason {final.stop_reason}")
    check(usage_ok(final.usage), f"stream usage {final.usage}")

    # Stop sequences: a stop at the first character of the answer is reported as such.
    m = client.messages.create(model="m", max_tokens=30, messages=msgs, extra_body={"temperature": 0},
                               thinking={"type": "disabled"}, stop_sequences=["e", "a", "o", "i", " "])
    check(m.stop_reason in ("stop_sequence", "end_turn", "max_tokens"), f"stop {m.stop_reason}")
    if m.stop_reason == "stop_sequence":
        check(m.stop_sequence in ("e", "a", "o", "i", " "), f"stop_sequence {m.stop_sequence}")

    # Tool use, forced by the grammar, streamed and whole; then the result goes back.
    ask = [{"role": "user", "content": "What is the weather in Paris for 2 days?"}]
    for stream in (False, True):
        kw = dict(model="m", max_tokens=200, messages=ask, tools=[WEATHER], extra_body={"temperature": 0},
                  tool_choice={"type": "any", "disable_parallel_tool_use": True}, thinking={"type": "disabled"})
        if stream:
            with client.messages.stream(**kw) as s:
                deltas = [e for e in s if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
                m = s.get_final_message()
            check(deltas, "tool input streams as input_json_delta")
        else:
            m = client.messages.create(**kw)
        uses = [b for b in m.content if b.type == "tool_use"]
        check(m.stop_reason == "tool_use" and len(uses) == 1, f"one tool_use ({stream}): {m}")
        u = uses[0]
        check(u.id.startswith("toolu_") and u.name == "get_weather", f"tool_use block {u}")
        check(isinstance(u.input, dict) and isinstance(u.input.get("city"), str)
              and isinstance(u.input.get("days"), int), f"typed input {u.input}")
    follow = ask + [{"role": "assistant", "content": m.content},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id,
                                                  "content": [{"type": "text", "text": "21 C, sunny"}]},
                                                 {"type": "text", "text": "Thanks."}]}]
    m = client.messages.create(model="m", max_tokens=10, messages=follow, tools=[WEATHER],
                               extra_body={"temperature": 0}, thinking={"type": "disabled"})
    check(m.stop_reason in ("end_turn", "max_tokens", "tool_use"), f"after the result: {m.stop_reason}")
    check(m.usage.cache_read_input_tokens > 0, f"the round trip resumes from the cache: {m.usage}")

    # The client's exceptions.
    try:
        anthropic.Anthropic(base_url=a.url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=4, messages=msgs)
        check(False, "a bad key is refused")
    except anthropic.AuthenticationError as e:
        check(e.status_code == 401 and e.body["error"]["type"] == "authentication_error", f"401 body {e.body}")
    try:
        client.messages.create(model="m", max_tokens=4,
                               messages=[{"role": "user", "content": [{"type": "image", "source": {
                                   "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
        check(False, "an image is refused")
    except anthropic.BadRequestError as e:
        check(e.status_code == 400 and e.body["error"]["type"] == "invalid_request_error"
              and "image" in e.body["error"]["message"], f"400 body {e.body}")
    try:
        client.post("/v1/messages/nothing", cast_to=object, body={})
        check(False, "an unknown route is 404")
    except anthropic.NotFoundError as e:
        check(e.body["error"]["type"] == "not_found_error", f"404 body {e.body}")

    # x-api-key and Authorization: Bearer both authenticate.
    for hdr in ({"x-api-key": a.api_key}, {"Authorization": f"Bearer {a.api_key}"}):
        hdr["content-type"] = "application/json"
        req = urllib.request.Request(a.url + "/v1/messages/count_tokens", method="POST", headers=hdr,
                                     data=json.dumps({"model": "m", "messages": msgs}).encode())
        with urllib.request.urlopen(req) as r:
            check(json.load(r)["input_tokens"] > 0, f"count with {list(hdr)[0]}")
    print("all anthropic checks passed")


if __name__ == "__main__":
    main()
