/*
 * Reference vectors for crates/nextn-quant/tests/quantize_importance.rs: the bytes ggml's
 * ggml_quantize_chunk (the call llama-quantize makes for every tensor) produces for a set
 * of rows, without and with an importance matrix.
 *
 * Link it against ggml-base as llama.cpp's CMake builds it (no -march for ggml-base, so no
 * FMA contraction; that build is what llama-quantize runs), from the repository root:
 *
 *   LLAMA=/path/to/llama.cpp        (configured and built with cmake -B build)
 *   cc -O2 -I$LLAMA/ggml/include crates/nextn-quant/tests/vectors/ggml/gen_ggml_ref.c
 *      -L$LLAMA/build/bin -lggml-base -Wl,-rpath,$LLAMA/build/bin -o /tmp/gen_ggml_ref
 *   /tmp/gen_ggml_ref crates/nextn-quant/tests/vectors/ggml "llama.cpp <commit> ggml-base"
 *
 * It writes rows.f32 (NROWS x N_PER_ROW little-endian f32), imatrix.f32 (N_PER_ROW
 * weights), <type>.none / <type>.imatrix (the quantized rows) and manifest.txt. The inputs
 * come from a fixed integer generator and exact f32 operations, so they do not depend on
 * the C library.
 */

#include "ggml.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N_PER_ROW 512
#define NROWS 16

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint32_t next_u32(void) {  // xorshift64*
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545f4914f6cdd1dull) >> 32);
}

static float uniform(void) {  // [0, 1), 24 random bits: exact in f32
    return (float)(next_u32() >> 8) / 16777216.0f;
}

static float normalish(void) {  // Irwin-Hall: sum of 12 uniforms minus 6
    float s = 0.0f;
    for (int i = 0; i < 12; ++i) s += uniform();
    return s - 6.0f;
}

static float pow2(int e) {
    float v = 1.0f;
    for (; e > 0; --e) v *= 2.0f;
    for (; e < 0; ++e) v *= 0.5f;
    return v;
}

static void make_rows(float * x) {
    for (int r = 0; r < NROWS; ++r) {
        float * row = x + (size_t)r * N_PER_ROW;
        for (int i = 0; i < N_PER_ROW; ++i) row[i] = normalish();
        switch (r) {
            case 1: memset(row, 0, 256 * sizeof(float)); break;             // a zero super-block
            case 2: memset(row, 0, N_PER_ROW * sizeof(float)); break;       // an all-zero row
            case 3: for (int i = 0; i < N_PER_ROW; ++i) row[i] = 0.75f; break;  // constant
            case 4: for (int i = 0; i < N_PER_ROW; ++i) row[i] *= pow2(-100); break;  // tiny
            case 5: for (int i = 0; i < N_PER_ROW; ++i) row[i] *= pow2(13); break;    // large
            case 6:                                                         // sparse outliers
                memset(row, 0, N_PER_ROW * sizeof(float));
                for (int k = 0; k < 7; ++k) row[next_u32() % N_PER_ROW] = 10.0f * normalish();
                break;
            case 7: memset(row, 0, 128 * sizeof(float)); break;             // half-empty block
            case 8:                                                         // exact grid values
                for (int i = 0; i < N_PER_ROW; ++i) row[i] = (float)((int)(next_u32() % 16) - 8);
                break;
            case 9:                                                         // ranges per 16
                for (int i = 0; i < N_PER_ROW; ++i) row[i] *= pow2((int)((i / 16 * 7) % 13) - 6);
                break;
            case 10: for (int i = 0; i < N_PER_ROW; ++i) if (row[i] < 0) row[i] = -row[i]; break;
            case 11: for (int i = 0; i < N_PER_ROW; ++i) if (row[i] > 0) row[i] = -row[i]; break;
            case 12: for (int i = 0; i < N_PER_ROW; ++i) row[i] = (float)i / N_PER_ROW - 0.5f; break;
            case 13: for (int i = 0; i < N_PER_ROW; ++i) row[i] *= pow2(-8); break;
            case 14: for (int i = 0; i < N_PER_ROW; ++i) row[i] *= pow2(4); break;
            default: break;
        }
    }
}

// Mean squared activations, as an imatrix holds: positive, a few zero columns and one
// zero 32-column block, a spread of magnitudes.
static void make_imatrix(float * w) {
    for (int i = 0; i < N_PER_ROW; ++i) {
        float u = 4.0f * uniform();
        w[i] = u * u * pow2((int)(next_u32() % 9) - 4);
        if (i % 37 == 0) w[i] = 0.0f;
        if (i >= 64 && i < 96) w[i] = 0.0f;
    }
}

static void write_file(const char * dir, const char * name, const void * data, size_t n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE * f = fopen(path, "wb");
    if (!f || fwrite(data, 1, n, f) != n || fclose(f) != 0) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(1);
    }
}

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s OUT_DIR [SOURCE_DESCRIPTION]\n", argv[0]);
        return 2;
    }
    const char * dir = argv[1];
    static float x[NROWS * N_PER_ROW];
    static float imatrix[N_PER_ROW];
    make_rows(x);
    make_imatrix(imatrix);
    write_file(dir, "rows.f32", x, sizeof x);
    write_file(dir, "imatrix.f32", imatrix, sizeof imatrix);

    const enum ggml_type types[] = {
        GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0,
        GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K,
        GGML_TYPE_IQ4_NL, GGML_TYPE_IQ4_XS,
    };
    char manifest[8192];
    int len = snprintf(manifest, sizeof manifest,
                       "# type imatrix file  (ggml_quantize_chunk, %d rows x %d, from %s)\n",
                       NROWS, N_PER_ROW, argc > 2 ? argv[2] : "ggml");
    for (size_t t = 0; t < sizeof types / sizeof types[0]; ++t) {
        const size_t bytes = ggml_row_size(types[t], N_PER_ROW) * NROWS;
        void * out = calloc(1, bytes);
        for (int with = 0; with < 2; ++with) {
            const size_t got = ggml_quantize_chunk(types[t], x, out, 0, NROWS, N_PER_ROW,
                                                   with ? imatrix : NULL);
            if (got != bytes) {
                fprintf(stderr, "%s: %zu bytes, expected %zu\n", ggml_type_name(types[t]), got, bytes);
                return 1;
            }
            char name[64];
            snprintf(name, sizeof name, "%s.%s", ggml_type_name(types[t]), with ? "imatrix" : "none");
            write_file(dir, name, out, bytes);
            len += snprintf(manifest + len, sizeof manifest - len, "%s %s %s\n",
                            ggml_type_name(types[t]), with ? "imatrix" : "none", name);
        }
        free(out);
    }
    write_file(dir, "manifest.txt", manifest, (size_t)len);
    return 0;
}
