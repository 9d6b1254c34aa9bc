#!/usr/bin/env python3
"""What agents need from `nextn serve`, checked with the official `openai` Python client against
two servers on the same model, one drafting with the MTP head and one decoding plainly:

- tool calls (non-streaming and streaming), forced by a named `tool_choice` whose parameters admit
  one value each, come back as structured `tool_calls` with typed arguments, `finish_reason`
  "tool_calls", no markup in `content`, and the same calls from both servers;
- a streamed call's string argument arrives in pieces as the model writes it (a file's contents
  growing in an agent's view), and the pieces join to the arguments of the same call unstreamed;
- a conversation carrying an assistant `tool_calls` message and a `tool` message is accepted;
- a `json_schema` response validates against its schema in 20 seeded runs at temperature 1.0;
- `top_logprobs: 5` gives 5 alternatives per token, and both servers agree on them.

Exits non-zero on the first mismatch.

  pip install openai jsonschema
  python3 tools/openai_agent_check.py --url-mtp http://127.0.0.1:8080/v1 --url-plain http://127.0.0.1:8081/v1
"""

import argparse
import json
import sys

import jsonschema
import openai


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


SET_MODE = {
    "type": "function",
    "function": {
        "name": "set_mode",
        "description": "Set the machine's mode.",
        "parameters": {
            "type": "object",
            "properties": {
                "mode": {"type": "string", "enum": ["fast"]},
                "level": {"type": "integer", "enum": [3]},
                "ratio": {"type": "number", "const": 0.5},
                "flag": {"type": "boolean", "const": True},
                "tags": {"type": "array", "const": ["a", 1]},
            },
            "required": ["mode", "level", "ratio", "flag", "tags"],
        },
    },
}
GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
WANT_ARGS = {"mode": "fast", "level": 3, "ratio": 0.5, "flag": True, "tags": ["a", 1]}
FILE_TEXT = "def main():\n    print('hello, world')\n    return 0\n\n\nif __name__ == '__main__':\n    main()\n"
WRITE_FILE = {
    "type": "function",
    "function": {
        "name": "write_file",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "enum": ["hello.py"]},
                "content": {"type": "string", "enum": [FILE_TEXT]},
            },
            "required": ["path", "content"],
        },
    },
}
MESSAGES = [{"role": "user", "content": "Switch the machine to fast mode."}]
MODEL = None
MARKUP = ("<tool_call>", "</tool_call>", "<function=", "<parameter=")


def tool_call_request(client, stream):
    return client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[GET_WEATHER, SET_MODE],
        tool_choice={"type": "function", "function": {"name": "set_mode"}},
        temperature=0,
        # The markup takes many tokens of the bundled model's small vocabulary.
        max_tokens=400,
        stream=stream,
    )


def tool_calls_non_stream(client, name):
    r = tool_call_request(client, False)
    c = r.choices[0]
    check(c.finish_reason == "tool_calls", f"{name}: finish_reason is tool_calls ({c.finish_reason})")
    calls = c.message.tool_calls or []
    check(len(calls) == 1, f"{name}: one tool call ({len(calls)})")
    call = calls[0]
    check(call.type == "function" and call.id.startswith("call_"), f"{name}: call has an id and type function")
    check(call.function.name == "set_mode", f"{name}: the named function was called")
    args = json.loads(call.function.arguments)
    check(args == WANT_ARGS, f"{name}: arguments typed as the schema says: {args}")
    content = c.message.content or ""
    check(not any(m in content for m in MARKUP), f"{name}: no markup in content ({content!r})")
    return [(call.function.name, args)]


def tool_calls_stream(client, name):
    calls = {}
    finish = None
    for chunk in tool_call_request(client, True):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        d = ch.delta
        if d.content:
            check(not any(m in d.content for m in MARKUP), f"{name}: no markup in delta.content ({d.content!r})")
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                check(entry["id"] is None, f"{name}: one id per call")
                entry["id"] = tc.id
                check(tc.type == "function", f"{name}: the first delta of a call has type function")
            if tc.function and tc.function.name:
                entry["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                entry["arguments"] += tc.function.arguments
        if ch.finish_reason:
            finish = ch.finish_reason
    check(finish == "tool_calls", f"{name}: streamed finish_reason is tool_calls ({finish})")
    check(sorted(calls) == [0], f"{name}: one streamed call at index 0 ({sorted(calls)})")
    c = calls[0]
    check(c["id"] and c["name"] == "set_mode", f"{name}: streamed call has id and name")
    args = json.loads(c["arguments"])
    check(args == WANT_ARGS, f"{name}: streamed argument fragments join to the arguments: {args}")
    return [(c["name"], args)]


def write_file_request(client, stream):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write hello.py."}],
        tools=[WRITE_FILE],
        tool_choice={"type": "function", "function": {"name": "write_file"}},
        temperature=0,
        max_tokens=400,
        stream=stream,
    )


def arguments_grow_while_written(client, name):
    whole = write_file_request(client, False).choices[0].message.tool_calls[0].function.arguments
    pieces = []
    for chunk in write_file_request(client, True):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if tc.function and tc.function.arguments:
                pieces.append(tc.function.arguments)
    check("".join(pieces) == whole, f"{name}: streamed pieces join to the unstreamed arguments")
    check(json.loads(whole) == {"path": "hello.py", "content": FILE_TEXT}, f"{name}: the file's arguments")
    inside = [p for p in pieces if "hello" in p or "print" in p or "main" in p]
    check(
        len(pieces) >= 8 and len(inside) >= 2,
        f"{name}: the contents arrive in pieces as they are written ({len(pieces)} pieces)",
    )


def round_trip(client, name):
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES
        + [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "set_mode", "arguments": json.dumps(WANT_ARGS)}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "done"}]},
        ],
        tools=[SET_MODE],
        temperature=0,
        max_tokens=4,
    )
    check(r.choices[0].message.role == "assistant", f"{name}: a conversation with a tool call and its result is answered")


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["list", "dict", "set"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "size", "kind", "ok"],
    "additionalProperties": False,
}


def structured(client, name):
    outputs = []
    for seed in range(20):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a Python container as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "container", "schema": SCHEMA, "strict": True}},
            temperature=1.0,
            seed=seed,
            max_tokens=400,
        )
        c = r.choices[0]
        check(c.finish_reason == "stop", f"{name}: seed {seed}: the JSON ends the answer ({c.finish_reason})")
        value = json.loads(c.message.content)
        jsonschema.validate(value, SCHEMA)
        outputs.append(value)
    check(True, f"{name}: 20 seeded answers at temperature 1.0 validate against the schema")
    check(len({json.dumps(o, sort_keys=True) for o in outputs}) > 1, f"{name}: the seeds give different answers")
    return outputs


def logprobs(client, name):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to five."}],
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=5,
    )
    content = r.choices[0].logprobs.content
    check(len(content) == r.usage.completion_tokens, f"{name}: one logprobs entry per token")
    for t in content:
        check(len(t.top_logprobs) == 5, f"{name}: 5 alternatives for {t.token!r}")
        best = t.top_logprobs[0].logprob
        check(t.logprob <= best + 1e-6 and t.logprob <= 0, f"{name}: the greedy token is the most likely")
    streamed = []
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to five."}],
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=5,
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed.extend(chunk.choices[0].logprobs.content)
    check([t.token for t in streamed] == [t.token for t in content], f"{name}: streamed logprobs cover the same tokens")
    return [(t.token, round(t.logprob, 4), [(a.token, round(a.logprob, 4)) for a in t.top_logprobs]) for t in content]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url-mtp", required=True)
    ap.add_argument("--url-plain", required=True)
    args = ap.parse_args()
    results = {}
    for name, url in (("mtp", args.url_mtp), ("plain", args.url_plain)):
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        global MODEL
        MODEL = client.models.list().data[0].id
        results[name] = {
            "calls": tool_calls_non_stream(client, name),
            "streamed_calls": tool_calls_stream(client, name),
            "logprobs": logprobs(client, name),
        }
        arguments_grow_while_written(client, name)
        round_trip(client, name)
        if name == "mtp":
            structured(client, name)
    check(results["mtp"]["calls"] == results["mtp"]["streamed_calls"], "streamed and non-streamed calls agree")
    check(results["mtp"]["calls"] == results["plain"]["calls"], "the same calls with and without MTP drafting")
    check(results["mtp"]["logprobs"] == results["plain"]["logprobs"], "the same logprobs with and without MTP drafting")
    print("all agent checks passed")


if __name__ == "__main__":
    main()
