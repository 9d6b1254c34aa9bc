#!/usr/bin/env python3
"""Generate the bit-exact reference vectors for crates/nextn-quant/tests/formats.rs.

Reference: gguf-py (`gguf.quants.dequantize` / `gguf.quants.quantize`, numpy). Q8_K,
which gguf-py lacks, is checked against the numpy reimplementation below (its layout:
f32 d, 256 x i8 qs, 16 x i16 bsums; value = d*q; quantization as ggml's
quantize_row_q8_K_ref).

gguf-py has no K-quant quantizers. With `--ggml-src DIR` (a checkout of
github.com/ggml-org/ggml or llama.cpp's ggml/ directory) the script compiles ggml's
reference C quantizers (`quantize_row_q{2,3,4,5,6,8}_K_ref`) with gcc and
`-ffp-contract=off` (no fused multiply-add, so plain IEEE f32 arithmetic in source
order) and records their output too. Without it, K-quant cases already present in the
manifest are kept as they are.

Output (deterministic, fixed seed), under crates/nextn-quant/tests/vectors/:
  manifest.txt                    one case per line: op type n_elements input expected
  dequant_<TYPE>.in / .out        block bytes / gguf-py's f32 output (little-endian)
  quant_<TYPE>.in / .out          f32 input (little-endian) / gguf-py's block bytes

Run from anywhere:  python3 tools/gen_quant_vectors.py [--ggml-src DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

OUT = Path(__file__).resolve().parent.parent / "crates" / "nextn-quant" / "tests" / "vectors"
SEED = 20240611
N_BLOCKS = 64
N_PLAIN = 2048  # elements for the plain float types

# Byte offsets of the f16 scale fields in each block (ggml-common.h layouts).
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ4_NL: [0], T.IQ4_XS: [0],
}

DEQUANT_TYPES = [
    T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K,
    T.Q5_K, T.Q6_K, T.Q8_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4,
]
QUANT_TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4, T.Q8_K]


def f16_bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).astype(np.float16).view(np.uint16)


def sensible_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Normal f16 scales of either sign, magnitudes 2^-14 .. 2^4."""
    mag = np.exp2(rng.uniform(-14, 4, size=n)).astype(np.float32)
    sign = np.where(rng.random(n) < 0.3, -1.0, 1.0).astype(np.float32)
    return f16_bits(mag * sign)


# Edge blocks (by index) for every quantized dequant type; the rest are random.
#   0: zero scales        1: negative scales     2: subnormal f16 scales
#   3: all code bits set  4: all code bits clear 5: large scales (60000)
#   6: smallest subnormal scale (0x0001)         7: largest negative normal (-65504)
def edge_scale_bits(block: int, rng: np.random.Generator, n: int) -> np.ndarray | None:
    if block == 0:
        return np.zeros(n, dtype=np.uint16)
    if block == 1:
        return f16_bits(-np.abs(np.exp2(rng.uniform(-8, 2, size=n))))
    if block == 2:
        return rng.integers(1, 0x0400, size=n, dtype=np.uint16)
    if block == 5:
        return f16_bits(np.full(n, 60000.0))
    if block == 6:
        return np.full(n, 1, dtype=np.uint16)
    if block == 7:
        return np.full(n, 0xFBFF, dtype=np.uint16)
    return None


def random_blocks(qtype: T, rng: np.random.Generator) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(N_BLOCKS, type_size), dtype=np.uint8)
    blocks[3, :] = 0xFF
    blocks[4, :] = 0x00
    if qtype == T.MXFP4:
        blocks[:, 0] = rng.integers(100, 151, size=N_BLOCKS, dtype=np.uint8)
        # Subnormal and extreme (finite-product) exponents, and the OCP NaN code's
        # neighbourhood kept finite: 250 * 12 < f32 max.
        blocks[0:8, 0] = [0, 1, 2, 127, 128, 250, 3, 126]
        return blocks
    if qtype == T.Q8_K:
        d = (np.exp2(rng.uniform(-20, 2, size=N_BLOCKS)) * np.where(rng.random(N_BLOCKS) < 0.3, -1, 1))
        d = d.astype(np.float32)
        d[0] = 0.0
        d[1] = -1.5
        d[2] = np.float32(1e-40)  # f32 subnormal scale
        d[5] = np.float32(3e30)
        blocks[:, 0:4] = d.view(np.uint8).reshape(N_BLOCKS, 4)
        return blocks
    fields = F16_FIELDS[qtype]
    for b in range(N_BLOCKS):
        bits = edge_scale_bits(b, rng, len(fields))
        if bits is None:
            bits = sensible_f16(rng, len(fields))
        for off, v in zip(fields, bits):
            blocks[b, off:off + 2] = np.array([v], dtype=np.uint16).view(np.uint8)
    return blocks


def plain_dequant_input(qtype: T, rng: np.random.Generator) -> np.ndarray:
    if qtype == T.F32:
        bits = rng.integers(0, 2**32, size=N_PLAIN, dtype=np.uint32)
        bits[:8] = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0x00000001, 0x807FFFFF]
        return bits.view(np.uint8)
    bits = rng.integers(0, 2**16, size=N_PLAIN, dtype=np.uint16)
    if qtype == T.F16:
        # Every exponent/sign edge: zeros, subnormals, infinities, quiet and signalling NaNs.
        bits[:12] = [0, 0x8000, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0x7C00, 0xFC00, 0x7C01, 0x7E00, 0xFDFF, 0x8001]
    else:
        bits[:8] = [0, 0x8000, 0x0001, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0x807F]
    return bits.view(np.uint8)


def q8k_dequantize(data: np.ndarray) -> np.ndarray:
    blocks = data.reshape(-1, 292)
    d = blocks[:, 0:4].copy().view(np.float32)  # (n, 1)
    qs = blocks[:, 4:260].copy().view(np.int8).astype(np.float32)
    return (d * qs).reshape(-1)


def q8k_quantize(x: np.ndarray) -> np.ndarray:
    """ggml quantize_row_q8_K_ref in numpy float32 (nearest_int = magic-number rounding)."""
    blocks = x.reshape(-1, 256).astype(np.float32)
    out = np.zeros((blocks.shape[0], 292), dtype=np.uint8)
    for i, xb in enumerate(blocks):
        imax = int(np.argmax(np.abs(xb)))
        amax, vmax = np.abs(xb[imax]), xb[imax]
        if amax == 0:
            continue
        with np.errstate(all="ignore"):  # subnormal maxima overflow iscale, as in ggml
            iscale = np.float32(-127.0) / vmax
            v = (iscale * xb + np.float32(12582912.0)).view(np.uint32)
        q = np.minimum((v & np.uint32(0x7FFFFF)).astype(np.int32) - 0x400000, 127).astype(np.int8)
        bsums = q.astype(np.int32).reshape(16, 16).sum(axis=1).astype(np.int16)
        with np.errstate(all="ignore"):
            d = np.array([np.float32(1.0) / iscale], dtype=np.float32)
        out[i] = np.concatenate([d.view(np.uint8), q.view(np.uint8), bsums.view(np.uint8)])
    return out.reshape(-1)


def quant_input(qtype: T, rng: np.random.Generator) -> np.ndarray:
    block_size = GGML_QUANT_SIZES[qtype][0]
    n_blocks = {1: N_PLAIN // 32, 32: N_BLOCKS, 256: 16}[block_size]
    x = rng.standard_normal((n_blocks, 32 if block_size == 1 else block_size)).astype(np.float32)
    # Per-block magnitudes spread over many decades.
    x *= np.exp2(rng.uniform(-20, 20, size=(n_blocks, 1))).astype(np.float32)
    x[0] = 0.0                                            # all-zero block
    x[1] = rng.standard_normal(x.shape[1]) * np.float32(1e-30)   # tiny
    x[2] = rng.standard_normal(x.shape[1]) * np.float32(1e30)    # large
    x[3] = np.abs(x[3])                                   # single sign
    x[4] = -np.abs(x[4])
    x[5] = 1.0                                            # constant block
    x[6, :] = rng.standard_normal(x.shape[1]).astype(np.float32) * np.float32(1e-41)  # f32 subnormals
    # Ties: scales chosen so that x/d lands exactly on .5 steps.
    half = np.arange(x.shape[1], dtype=np.float32) - x.shape[1] / 2 + np.float32(0.5)
    if qtype in (T.Q8_0, T.Q8_K):
        x[7] = half
        x[7, 0] = -127.0 if qtype == T.Q8_0 else 127.0
        x[8] = half * np.float32(0.25)
        x[8, 0] = np.float32(127 * 0.25)
    elif qtype in (T.Q4_0, T.Q5_0):
        nmax = 8 if qtype == T.Q4_0 else 16
        x[7] = np.clip(half / 2, -nmax + 0.5, nmax - 0.5)
        x[7, 0] = -float(nmax)
    elif qtype in (T.Q4_1, T.Q5_1):
        steps = 15 if qtype == T.Q4_1 else 31
        x[7] = np.clip(np.abs(half) / 2, 0, steps) - 1
        x[7, 0], x[7, 1] = -1.0, steps - 1.0
    elif qtype == T.MXFP4:
        # Maxima at and just below powers of two (floor(log2) edge) and midpoints.
        for r, k in zip(range(7, 16), range(-20, 120, 16)):
            x[r] = rng.uniform(-1, 1, x.shape[1]).astype(np.float32) * np.float32(2.0**k)
            below = (np.array([2.0**k], dtype=np.float32).view(np.uint32) - (r % 3)).view(np.float32)[0]
            x[r, r % x.shape[1]] = below
        x[16] = np.float32(0.25) * np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 5, 7, 2.5, 1.25, 0.75, 0.25, 3.5, 5.0] * 2, dtype=np.float32)
        x[16, 0] = 6.0
    elif qtype == T.BF16:
        bits = rng.integers(0, 2**32, size=x.shape[1], dtype=np.uint32)
        bits = (bits & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # exact ties
        x[7] = bits.view(np.float32)
        x[7][~np.isfinite(x[7])] = 1.0
        x[8, :4] = np.array([0x7F7FFFFF, 0xFF7F8000, 0x00008000, 0x80018000], dtype=np.uint32).view(np.float32)
    elif qtype == T.F16:
        h = rng.integers(0, 0x7BFF, size=x.shape[1], dtype=np.uint16)
        lo = h.view(np.float16).astype(np.float32)
        hi = (h + 1).view(np.float16).astype(np.float32)
        x[7] = (lo.astype(np.float64) + hi) / 2  # exact midpoints (representable in f32)
        x[8, :6] = [65504.0, 65519.0, 65520.0, 1e6, 2.0**-25, 2.0**-24 * 1.5]
    return x.reshape(-1)


K_QUANT_TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_K]

# Symbols ggml-quants.c references but the reference quantizers never reach.
GGML_STUBS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
void ggml_abort(const char *file, int line, const char *fmt, ...) { fprintf(stderr, "ggml_abort %s:%d\n", file, line); abort(); }
size_t ggml_row_size(int type, long long ne) { abort(); }
const char *ggml_type_name(int type) { return "?"; }
size_t ggml_type_size(int type) { abort(); }
"""


def build_ggml_reference(src: Path, workdir: Path) -> ctypes.CDLL:
    root = src / "ggml" if (src / "ggml" / "src" / "ggml-quants.c").exists() else src
    quants = root / "src" / "ggml-quants.c"
    if not quants.exists():
        raise SystemExit(f"{quants} not found: --ggml-src must be a ggml (or llama.cpp) checkout")
    stubs = workdir / "stubs.c"
    stubs.write_text(GGML_STUBS)
    lib = workdir / "libggml_quants_ref.so"
    cmd = ["gcc", "-O2", "-ffp-contract=off", "-DNDEBUG", "-fPIC", "-shared",
           "-I", str(root / "include"), "-I", str(root / "src"), "-I", str(root / "src" / "ggml-cpu"),
           str(quants), str(stubs), "-o", str(lib), "-lm"]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(lib))


def ggml_quantize(lib: ctypes.CDLL, qtype: T, x: np.ndarray) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros(x.size // block_size * type_size, dtype=np.uint8)
    fn = getattr(lib, f"quantize_row_{qtype.name[:2].lower()}_K_ref")
    fn(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(out.ctypes.data), ctypes.c_int64(x.size))
    return out


def k_quant_input(rng: np.random.Generator) -> np.ndarray:
    n_blocks = 64
    x = rng.standard_normal((n_blocks, 256)).astype(np.float32)
    x *= np.exp2(rng.uniform(-12, 12, size=(n_blocks, 1))).astype(np.float32)
    i = np.arange(256, dtype=np.float32)
    x[0] = 0.0                                                   # all-zero block
    x[1] = (0.1 + 2.0 * np.cos(i)).astype(np.float32)            # ggml's test data
    x[2] = np.abs(x[2])                                          # no negative values
    x[3] = -np.abs(x[3])                                         # no positive values
    x[4] = 0.75                                                  # constant
    x[5] = rng.standard_normal(256).astype(np.float32) * np.float32(1e-30)  # tiny
    x[6] = rng.standard_normal(256).astype(np.float32) * np.float32(1e4)    # large
    x[7] = 0.0                                                   # sparse outliers
    x[7, rng.integers(0, 256, size=5)] = rng.standard_normal(5).astype(np.float32) * 10
    x[8, :128] = 0.0                                             # half-empty
    x[9] = rng.integers(-8, 8, size=256).astype(np.float32)      # exact grid values
    x[10] *= np.repeat(np.exp2(rng.uniform(-6, 6, size=16)), 16).astype(np.float32)  # per-sub-block ranges
    return x.reshape(-1)


def write(name: str, data: np.ndarray) -> None:
    (OUT / name).write_bytes(np.ascontiguousarray(data).tobytes())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ggml-src", type=Path, help="ggml checkout for the K-quant reference quantizers")
    args = parser.parse_args()

    OUT.mkdir(parents=True, exist_ok=True)
    manifest = OUT / "manifest.txt"
    old_lines = manifest.read_text().splitlines() if manifest.exists() else []
    rng = np.random.default_rng(SEED)
    lines = ["# op type n_elements input expected  (generated by tools/gen_quant_vectors.py, gguf-py "
             + importlib.metadata.version("gguf") + ", numpy " + np.__version__ + ")"]

    for qtype in DEQUANT_TYPES:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if block_size == 1:
            data = plain_dequant_input(qtype, rng)
        else:
            data = random_blocks(qtype, rng).reshape(-1)
        if qtype == T.Q8_K:
            out = q8k_dequantize(data)
        else:
            with np.errstate(all="ignore"):
                out = gguf.quants.dequantize(data, qtype).astype(np.float32, copy=False).reshape(-1)
        n = data.size // type_size * block_size
        assert out.size == n, (qtype, out.size, n)
        stem = f"dequant_{qtype.name}"
        write(stem + ".in", data.astype(np.uint8))
        write(stem + ".out", out.astype("<f4"))
        lines.append(f"dequantize {qtype.name} {n} {stem}.in {stem}.out")

    for qtype in QUANT_TYPES:
        x = quant_input(qtype, rng)
        if qtype == T.Q8_K:
            out = q8k_quantize(x)
        else:
            with np.errstate(all="ignore"):
                out = gguf.quants.quantize(x.reshape(1, -1), qtype)
            out = np.ascontiguousarray(out).view(np.uint8).reshape(-1)
        stem = f"quant_{qtype.name}"
        write(stem + ".in", x.astype("<f4"))
        write(stem + ".out", out)
        lines.append(f"quantize {qtype.name} {x.size} {stem}.in {stem}.out")

    k_names = {f"Q{k}_K" for k in (2, 3, 4, 5, 6)}
    if args.ggml_src is not None:
        k_rng = np.random.default_rng(SEED + 1)
        with tempfile.TemporaryDirectory() as tmp:
            lib = build_ggml_reference(args.ggml_src, Path(tmp))
            for qtype in K_QUANT_TYPES:
                x = k_quant_input(k_rng)
                out = ggml_quantize(lib, qtype, x)
                if qtype == T.Q8_K:
                    # The numpy reimplementation used above must agree with ggml's.
                    assert np.array_equal(out, q8k_quantize(x)), "numpy Q8_K differs from ggml"
                    continue
                stem = f"quant_{qtype.name}"
                write(stem + ".in", x.astype("<f4"))
                write(stem + ".out", out)
                lines.append(f"quantize {qtype.name} {x.size} {stem}.in {stem}.out  # ggml reference")
    else:
        kept = [l for l in old_lines if l.startswith("quantize ") and l.split()[1] in k_names]
        lines.extend(kept)
        print(f"no --ggml-src: kept {len(kept)} K-quant quantize cases from the previous manifest")

    manifest.write_text("\n".join(lines) + "\n")
    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"wrote {len(lines) - 1} cases, {total} bytes to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
