#!/usr/bin/env python3
"""Images through `nextn serve --mmproj` with the official `openai` client: an image_url data URI
part is answered and its encode time reported, the next turn resumes after the picture and equals
a cold run, and damaged, oversized, fetched-URL (on a server without --allow-image-urls) and
context-filling images are 400s naming the problem. Prints "all image checks passed" at the end."""

import argparse
import base64
import struct
import sys
import zlib

import openai


def png(width, height, seed=0):
    rows = b"".join(
        b"\x00" + bytes(((x * 7 + y * 13 + c * 31 + seed) % 251) for x in range(width) for c in range(3))
        for y in range(height)
    )

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    head = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def data_uri(data, kind="png"):
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def user(text, url):
    return {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}


def expect_400(client, messages, words):
    try:
        client.chat.completions.create(model="m", messages=messages, max_tokens=4)
    except openai.BadRequestError as e:
        text = str(e)
        missing = [w for w in words if w not in text]
        assert not missing, f"the 400 does not name {missing}: {text}"
        return
    raise AssertionError(f"expected a 400 naming {words}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.url, api_key="none", max_retries=0)
    picture = data_uri(png(70, 50))
    first = [user("Look:", picture)]
    r1 = client.chat.completions.create(model="m", messages=first, max_tokens=8, temperature=0)
    assert r1.choices[0].message.content, r1
    t1 = r1.model_extra["timings"]
    assert t1["images_encoded"] == 1 and t1["image_encode_ms"] > 0, t1
    text_only = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Look:"}], max_tokens=1, temperature=0
    )
    image_rows = r1.usage.prompt_tokens - text_only.usage.prompt_tokens
    assert image_rows > 4, (r1.usage, text_only.usage)

    second = first + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And now?"},
    ]
    warm = client.chat.completions.create(model="m", messages=second, max_tokens=16, temperature=0)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached > image_rows, (cached, image_rows, warm.usage)
    assert "images_encoded" not in warm.model_extra["timings"], warm.model_extra["timings"]
    cold = client.chat.completions.create(
        model="m", messages=second, max_tokens=16, temperature=0, extra_body={"cache_prompt": False}
    )
    assert cold.model_extra["timings"]["cache_n"] == 0, cold.model_extra["timings"]
    assert cold.model_extra["timings"]["images_encoded"] == 1
    assert warm.choices[0].message.content == cold.choices[0].message.content, (warm, cold)

    # `detail`, which the SDK's types ask for, in every value the API defines.
    for detail in ["low", "high", "auto"]:
        part = {"type": "image_url", "image_url": {"url": picture, "detail": detail}}
        r = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "Look:"}, part]}],
            max_tokens=1, temperature=0)
        assert r.usage.prompt_tokens == r1.usage.prompt_tokens, (detail, r.usage, r1.usage)
        r = client.responses.create(model="m", max_output_tokens=1, temperature=0, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "Look:"}, {"type": "input_image", "image_url": picture, "detail": detail}]}])
        assert r.status in ("completed", "incomplete") and r.usage.input_tokens > image_rows, (detail, r)

    expect_400(client, [user("x", data_uri(b"not a picture at all"))], ["content[1]", "decode"])
    expect_400(client, [user("x", data_uri(png(20000, 1)))], ["20000x1", "16384"])
    expect_400(client, [user("x", "https://example.com/cat.png")], ["not fetched", "--allow-image-urls", "data URI"])
    expect_400(client, [user("x", data_uri(png(600, 600)))], ["context", "image"])
    expect_400(
        client,
        [user("<|vision_start|><|image_pad|><|vision_end|>", picture)],
        ["placeholder"],
    )
    print("all image checks passed")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)
