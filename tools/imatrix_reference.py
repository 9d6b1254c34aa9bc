#!/usr/bin/env python3
"""Reference data for `nextn quantize --imatrix` (crates/nextn/tests/quantize.rs).

Runs llama.cpp's llama-imatrix on a fixture and llama-quantize with that importance matrix, and
writes the FNV-1a 64 hash of every tensor's bytes in the result, so the test can check
`nextn quantize --imatrix` tensor by tensor without committing the quantized files.

usage: tools/imatrix_reference.py LLAMA_BIN_DIR ../shared/golden/q35-dense-a/q35-dense-a-F32.gguf \
           crates/nextn/tests/data/imatrix-q35-dense-a.gguf crates/nextn/tests/data/imatrix_llamacpp.json
The importance matrix is made from the first 6,000 bytes of README.md (4 chunks of 128 tokens)
unless IMATRIX already exists, in which case it is reused.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
         6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 11: ("Q3_K", 256, 110),
         12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
         20: ("IQ4_NL", 32, 18), 23: ("IQ4_XS", 256, 136), 30: ("BF16", 1, 2)}
FTYPES = ["Q4_K_M", "Q3_K_M", "Q6_K", "Q4_0", "IQ4_XS"]


def fnv1a64(data):
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def tensors(path):
    b = open(path, "rb").read()
    o = 4

    def u(fmt):
        nonlocal o
        v = struct.unpack_from(fmt, b, o)
        o += struct.calcsize(fmt)
        return v[0]

    def s():
        nonlocal o
        n = u("<Q")
        v = b[o:o + n].decode()
        o += n
        return v

    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
              10: "<Q", 11: "<q", 12: "<d"}

    def value(t):
        if t == 8:
            return s()
        if t == 9:
            et, n = u("<I"), u("<Q")
            return [value(et) for _ in range(n)]
        return u(scalar[t])

    u("<I")
    n_tensors, n_kv = u("<Q"), u("<Q")
    align = 32
    for _ in range(n_kv):
        k = s()
        v = value(u("<I"))
        if k == "general.alignment":
            align = v
    infos = []
    for _ in range(n_tensors):
        name = s()
        dims = [u("<Q") for _ in range(u("<I"))]
        infos.append((name, dims, u("<I"), u("<Q")))
    start = (o + align - 1) // align * align
    out = {}
    for name, dims, ty, off in infos:
        tname, block, size = TYPES[ty]
        rows = 1
        for d in dims[1:]:
            rows *= d
        n = dims[0] // block * size * rows
        out[name] = [tname, fnv1a64(b[start + off:start + off + n])]
    return out


def main():
    bin_dir, f32, imatrix, out = sys.argv[1:5]
    if not os.path.exists(imatrix):
        with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as t:
            t.write(open(os.path.join(os.path.dirname(__file__), "..", "README.md"), "rb").read()[:6000])
        subprocess.run([f"{bin_dir}/llama-imatrix", "-m", f32, "-f", t.name, "-o", imatrix,
                        "-c", "128", "--chunks", "4", "-t", "1"], check=True, capture_output=True)
    version = subprocess.run([f"{bin_dir}/llama-imatrix", "--version"], capture_output=True,
                             text=True)
    commit = (version.stdout + version.stderr).strip().splitlines()[0]
    files = {}
    with tempfile.TemporaryDirectory() as d:
        for ft in FTYPES:
            q = os.path.join(d, f"{ft}.gguf")
            subprocess.run([f"{bin_dir}/llama-quantize", "--imatrix", imatrix, f32, q, ft, "1"],
                           check=True, capture_output=True)
            files[ft] = tensors(q)
    json.dump({
        "made_by": "tools/imatrix_reference.py",
        "llama_cpp": commit,
        "source": os.path.basename(f32),
        "imatrix": os.path.basename(imatrix),
        "command": "llama-quantize --imatrix IMATRIX SOURCE OUT TYPE 1",
        "hash": "FNV-1a 64 of each tensor's data bytes (without alignment padding)",
        "files": files,
    }, open(out, "w"), indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
