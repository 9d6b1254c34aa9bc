#!/usr/bin/env python3
"""Talk to `nextn serve` over the Responses API (`/v1/responses`) with the official `openai`
Python client. Every object and stream event the server sends is validated against the client's
own types (pydantic, strictly), and:

- a plain response: output items, `output_text`, status and `usage`;
- a streamed one, read raw and through the client's `responses.stream()` accumulator: event
  order, consecutive `sequence_number`s, deltas that join to the done texts and the final object;
- a function call forced by `tool_choice` (streamed and not), its arguments valid for the
  function's schema, and a round trip answering it with `function_call_output`;
- `text.format` json_schema: seeded answers at temperature 1.0 that parse and validate, and
  `responses.parse()` with a pydantic model;
- `previous_response_id` (the stored conversation continued, the prefix cache hit reported in
  `cached_tokens`), `retrieve`, `delete`, and the errors for unknown ids;
- `input_tokens.count` agreeing with a response's `input_tokens`;
- a hosted `web_search` tool beside a function (Codex's default) left out and the request answered;
- a 400 for what the server refuses (an image part on a server without a vision tower, a custom tool).

  pip install openai jsonschema
  python3 tools/openai_responses_check.py --url http://127.0.0.1:8080/v1 [--api-key KEY]
"""

import argparse
import json
import sys

import jsonschema
import openai
import pydantic
from openai.types.responses import Response, ResponseStreamEvent

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
MODEL = "nextn"

SET_MODE = {
    "type": "function",
    "name": "set_mode",
    "description": "Set the machine's mode.",
    "parameters": {
        "type": "object",
        "properties": {
            "mode": {"type": "string", "enum": ["fast", "slow"]},
            "level": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["mode", "level"],
        "additionalProperties": False,
    },
}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["list", "dict", "set"]},
    },
    "required": ["name", "size", "kind"],
    "additionalProperties": False,
}


def check(cond, what):
    if not cond:
        sys.exit(f"FAIL: {what}")
    print(f"ok: {what}")


def strict(raw):
    """The raw JSON of a response, validated as the client's `Response` type."""
    try:
        return Response.model_validate(raw)
    except pydantic.ValidationError as e:
        sys.exit(f"FAIL: the response does not validate as openai's Response: {e}\n{json.dumps(raw)[:2000]}")


def create_raw(client, **kw):
    """A non-streamed response, as its raw JSON validated strictly."""
    raw = client.responses.with_raw_response.create(model=MODEL, **kw)
    return strict(raw.http_response.json())


def check_usage(r, what, max_output=None):
    u = r.usage
    check(u is not None and u.input_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens,
          f"{what}: usage {u.input_tokens} + {u.output_tokens} tokens")
    check(0 <= u.input_tokens_details.cached_tokens <= u.input_tokens, f"{what}: cached_tokens within input_tokens")
    check(0 <= u.output_tokens_details.reasoning_tokens <= u.output_tokens, f"{what}: reasoning_tokens within output_tokens")
    if max_output is not None:
        check(u.output_tokens <= max_output, f"{what}: at most max_output_tokens generated")
    if r.status == "incomplete":
        check(r.incomplete_details.reason == "max_output_tokens", f"{what}: incomplete for max_output_tokens")
    else:
        check(r.status == "completed" and r.incomplete_details is None, f"{what}: completed ({r.status})")


def message_text(r):
    return "".join(c.text for o in r.output if o.type == "message" for c in o.content if c.type == "output_text")


def plain(client):
    r = create_raw(client, input="Tell me about Python lists.", instructions="Answer briefly.",
                   max_output_tokens=24, temperature=0, metadata={"case": "plain"})
    check(r.id.startswith("resp_") and r.object == "response", "plain: a response object with a resp_ id")
    check(r.instructions == "Answer briefly." and r.metadata == {"case": "plain"} and r.max_output_tokens == 24,
          "plain: instructions, metadata and max_output_tokens repeated")
    check(all(o.type in ("message", "reasoning") for o in r.output) and r.output, f"plain: output items {[o.type for o in r.output]}")
    check_usage(r, "plain", 24)
    check(r.output_text == message_text(r), "plain: output_text is the messages' text")
    return r


def streamed_raw(client):
    """The events as sent, each validated strictly."""
    raw = client.responses.with_raw_response.create(model=MODEL, input="Tell me about Python sets.",
                                                   max_output_tokens=32, temperature=0, stream=True)
    events = []
    kind = None
    for line in raw.http_response.iter_lines():
        if line.startswith("event: "):
            kind = line[len("event: "):]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: "):])
            if data["type"] != kind:
                sys.exit(f"FAIL: SSE event {kind} carries {data['type']}")
            try:
                events.append(EVENT.validate_python(data))
            except pydantic.ValidationError as e:
                sys.exit(f"FAIL: event does not validate as openai's ResponseStreamEvent: {e}\n{line[:2000]}")
    types = [e.type for e in events]
    check(types[:2] == ["response.created", "response.in_progress"], "stream: begins with created, in_progress")
    check(types[-1] in ("response.completed", "response.incomplete"), f"stream: ends with {types[-1]}")
    check([e.sequence_number for e in events] == list(range(len(events))), "stream: sequence_number counts up from 0")
    final = events[-1].response
    check(events[0].response.id == final.id and events[0].response.status == "in_progress", "stream: one id, in_progress first")
    texts, done = {}, {}
    for e in events:
        if e.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            texts[e.item_id] = texts.get(e.item_id, "") + e.delta
        if e.type in ("response.output_text.done", "response.reasoning_text.done"):
            done[e.item_id] = e.text
    check(texts == done, "stream: text deltas join to the done texts")
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    finished = [e.item for e in events if e.type == "response.output_item.done"]
    check(added == [i.id for i in finished] == [o.id for o in final.output], "stream: every item added is done, in output order")
    check(final.output_text == "".join(t for i, t in done.items() if i.startswith("msg_")), "stream: final output_text is the streamed text")
    check_usage(final, "stream", 32)


def streamed_helper(client):
    # The client's accumulator needs `response.completed`: the grammar of a JSON format ends
    # the answer before the budget does.
    fmt = {"format": {"type": "json_schema", "name": "container", "schema": SCHEMA, "strict": True}}
    with client.responses.stream(model=MODEL, input="Name a Python container.", max_output_tokens=400,
                                 temperature=0, text=fmt, reasoning={"effort": "none"}) as s:
        text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        final = s.get_final_response()
    check(final.output_text == text, "responses.stream(): accumulated text is the final output_text")
    jsonschema.validate(json.loads(text), SCHEMA)
    check_usage(final, "responses.stream()", 400)


def function_call(client, stream):
    kw = dict(input=[{"role": "user", "content": "Switch the machine to fast mode."}], tools=[SET_MODE],
              tool_choice={"type": "function", "name": "set_mode"}, temperature=0, max_output_tokens=400)
    name = "function call (stream)" if stream else "function call"
    if stream:
        deltas = ""
        with client.responses.stream(model=MODEL, **kw) as s:
            for e in s:
                if e.type == "response.function_call_arguments.delta":
                    deltas += e.delta
            r = s.get_final_response()
    else:
        r = create_raw(client, **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    check(r.status == "completed" and len(calls) == 1, f"{name}: one call, completed ({r.status}, {[o.type for o in r.output]})")
    c = calls[0]
    check(c.name == "set_mode" and c.call_id.startswith("call_") and c.id.startswith("fc_"), f"{name}: named, with call_id and id")
    args = json.loads(c.arguments)
    jsonschema.validate(args, SET_MODE["parameters"])
    check(True, f"{name}: arguments {args} valid for the schema")
    if stream:
        check(deltas == c.arguments, f"{name}: argument deltas join to the arguments")
    return kw, r, c


def round_trip(client):
    kw, r, c = function_call(client, False)
    follow = kw["input"] + [o.model_dump(exclude_none=True) for o in r.output] + [
        {"type": "function_call_output", "call_id": c.call_id, "output": "the machine is in fast mode"}]
    before = client.responses.input_tokens.count(model=MODEL, input=kw["input"], tools=[SET_MODE]).input_tokens
    after = client.responses.input_tokens.count(model=MODEL, input=follow, tools=[SET_MODE]).input_tokens
    check(after > before, f"round trip: the call and its output are in the prompt ({before} -> {after} tokens)")
    r2 = create_raw(client, input=follow, tools=[SET_MODE], temperature=0, max_output_tokens=8)
    check(r2.usage.input_tokens == after, "round trip: answered, input_tokens as counted")
    check_usage(r2, "round trip", 8)


def structured(client):
    fmt = {"format": {"type": "json_schema", "name": "container", "schema": SCHEMA, "strict": True}}
    seen = set()
    for seed in range(8):
        r = create_raw(client, input="Describe a Python container as JSON.", text=fmt, temperature=1.0,
                       max_output_tokens=400, reasoning={"effort": "none"}, extra_body={"seed": seed})
        check(r.status == "completed", f"json_schema seed {seed}: the JSON ends the answer ({r.status})")
        value = json.loads(r.output_text)
        jsonschema.validate(value, SCHEMA)
        seen.add(json.dumps(value, sort_keys=True))
    check(True, "json_schema: 8 seeded answers at temperature 1.0 validate against the schema")
    check(len(seen) > 1, "json_schema: the seeds give different answers")

    class Container(pydantic.BaseModel):
        name: str
        size: int
        kind: str

    p = client.responses.parse(model=MODEL, input="Describe a Python container as JSON.", text_format=Container,
                               max_output_tokens=400, reasoning={"effort": "none"}, temperature=0)
    check(isinstance(p.output_parsed, Container), f"responses.parse(): output_parsed is the model ({p.output_parsed})")


def stored(client):
    r1 = create_raw(client, input="Hello there, tell me a story.", max_output_tokens=16, temperature=0)
    r2 = create_raw(client, input="And another one.", previous_response_id=r1.id, max_output_tokens=8, temperature=0)
    check(r2.previous_response_id == r1.id, "previous_response_id repeated")
    check(r2.usage.input_tokens >= r1.usage.input_tokens + r1.usage.output_tokens,
          f"previous_response_id: the stored conversation is in the prompt ({r2.usage.input_tokens} tokens)")
    check(r2.usage.input_tokens_details.cached_tokens > 0,
          f"previous_response_id: the prefix cache served {r2.usage.input_tokens_details.cached_tokens} tokens")
    got = client.responses.retrieve(r1.id)
    check(got.id == r1.id and got.output_text == r1.output_text, "retrieve: the stored response")
    client.responses.delete(r1.id)
    try:
        client.responses.retrieve(r1.id)
        check(False, "retrieve after delete fails")
    except openai.NotFoundError:
        check(True, "retrieve after delete: NotFoundError")
    try:
        client.responses.create(model=MODEL, input="x", previous_response_id=r1.id, max_output_tokens=4)
        check(False, "an unknown previous_response_id fails")
    except openai.BadRequestError as e:
        check(e.body.get("param") == "previous_response_id", f"unknown previous_response_id: BadRequestError ({e.message})")
    unstored = create_raw(client, input="x", store=False, max_output_tokens=4)
    try:
        client.responses.retrieve(unstored.id)
        check(False, "a store=false response is not kept")
    except openai.NotFoundError:
        check(True, "store=false: not kept")


def input_tokens(client):
    kw = dict(input="Count my tokens.", instructions="Be exact.")
    n = client.responses.input_tokens.count(model=MODEL, **kw)
    check(n.object == "response.input_tokens" and n.input_tokens > 0, f"input_tokens.count: {n.input_tokens}")
    r = create_raw(client, max_output_tokens=2, **kw)
    check(r.usage.input_tokens == n.input_tokens, "input_tokens.count agrees with the response's input_tokens")


def hosted_tools(client):
    r = client.responses.create(model=MODEL, max_output_tokens=4, input="x",
                                tools=[SET_MODE, {"type": "web_search"}])
    check(r.status in ("completed", "incomplete"), f"hosted web_search tool: answered ({r.status})")
    check([t.type for t in r.tools] == ["function", "web_search"], "hosted web_search tool: tools repeated as sent")


def refusals(client):
    for what, kw, needle in [
        ("an image part without a vision tower", dict(input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "high"}]}]), "--mmproj"),
        ("a custom tool", dict(input="x", tools=[{"type": "custom", "name": "apply_patch"}]), "custom"),
    ]:
        try:
            client.responses.create(model=MODEL, max_output_tokens=4, **kw)
            check(False, f"{what} is refused")
        except openai.BadRequestError as e:
            check(needle in e.message, f"{what}: BadRequestError ({e.message})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--api-key", default="sk-no-key")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.url, api_key=args.api_key, max_retries=0, timeout=300)
    plain(client)
    streamed_raw(client)
    streamed_helper(client)
    function_call(client, True)
    round_trip(client)
    structured(client)
    stored(client)
    input_tokens(client)
    hosted_tools(client)
    refusals(client)
    print("all responses checks passed")


if __name__ == "__main__":
    main()
