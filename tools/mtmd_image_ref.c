// llama.cpp's mtmd numbers for one image, for the references in crates/nextn-vision/tests/data/
// and crates/nextn/tests/data/: the image's embeddings from the mmproj, its token grid and
// decoder positions, and (mode logits) the last row's logits after a whole prompt with the image.
//
// Build against a llama.cpp build tree L (its include/, tools/mtmd/ and build/bin/ libraries):
//   gcc -O2 -o mtmd_image_ref tools/mtmd_image_ref.c -I$L/include -I$L/ggml/include \
//       -I$L/tools/mtmd -L$L/build/bin -lmtmd -lllama -lggml -lggml-base -Wl,-rpath,$L/build/bin
// Run:
//   mtmd_image_ref embd   MODEL.gguf MMPROJ.gguf IMAGE N_THREADS REPEAT OUT.bin
//   mtmd_image_ref embd-fa ... (as embd, with flash attention: llama-mtmd-cli's default on a CPU)
//   mtmd_image_ref logits MODEL.gguf MMPROJ.gguf IMAGE N_THREADS PROMPT.txt OUT.bin
// embd: encodes the image REPEAT times (printing each encode's milliseconds on stderr) and writes
//   nx, ny, n_tokens, n_pos, width (i32 each), n_tokens x (t, y, x) decoder positions relative to
//   position 0 (i32), then n_tokens x width f32 embeddings.
// logits: PROMPT.txt is the prompt text with "<__media__>" where the image goes (special tokens
//   parsed); writes n_chunks (i32), per chunk its type (0 text, 1 image) and n_tokens (i32) and,
//   for text, the token ids (i32); then n_past after the prompt (i32), n_vocab (i32) and the
//   last row's n_vocab f32 logits.
// Attention runs without flash attention (f32 throughout, as nextn computes it) except in embd-fa.
#include "llama.h"
#include "mtmd.h"
#include "mtmd-helper.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void put_i32(FILE *o, int v) { fwrite(&v, 4, 1, o); }

static char *read_text(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc(n + 1);
    if (fread(s, 1, n, f) != (size_t)n) { fclose(f); return NULL; }
    s[n] = 0;
    fclose(f);
    return s;
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: mtmd_image_ref embd|logits MODEL MMPROJ IMAGE N_THREADS REPEAT|PROMPT OUT\n");
        return 1;
    }
    const int logits_mode = !strcmp(argv[1], "logits");
    const int flash = !strcmp(argv[1], "embd-fa");
    const int n_threads = atoi(argv[5]);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[2], mp);
    if (!model) return 2;
    struct mtmd_context_params mparams = mtmd_context_params_default();
    mparams.use_gpu = false;
    mparams.n_threads = n_threads;
    mparams.flash_attn_type = flash ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    mparams.warmup = false;
    mtmd_context *mctx = mtmd_init_from_file(argv[3], model, mparams);
    if (!mctx) return 3;
    struct mtmd_helper_bitmap_wrapper bw =
        mtmd_helper_bitmap_init_from_file(mctx, argv[4], false, mtmd_helper_init_opt_default());
    if (!bw.bitmap) return 4;
    const mtmd_bitmap *bitmaps[1] = {bw.bitmap};
    char *prompt = logits_mode ? read_text(argv[6]) : strdup(mtmd_default_marker());
    if (!prompt) return 5;
    struct mtmd_input_text text = {prompt, strlen(prompt), false, true};
    mtmd_input_chunks *chunks = mtmd_input_chunks_init();
    if (mtmd_tokenize(mctx, chunks, &text, bitmaps, 1) != 0) return 6;
    FILE *o = fopen(argv[7], "wb");
    if (!o) return 7;
    if (!logits_mode) {
        const mtmd_input_chunk *img = NULL;
        for (size_t i = 0; i < mtmd_input_chunks_size(chunks); i++) {
            const mtmd_input_chunk *c = mtmd_input_chunks_get(chunks, i);
            if (mtmd_input_chunk_get_type(c) == MTMD_INPUT_CHUNK_TYPE_IMAGE) img = c;
        }
        if (!img) return 8;
        const int repeat = atoi(argv[6]);
        for (int r = 0; r < repeat; r++) {
            double t0 = now_ms();
            if (mtmd_encode_chunk(mctx, img) != 0) return 9;
            fprintf(stderr, "encode %d: %.1f ms\n", r, now_ms() - t0);
        }
        const mtmd_image_tokens *it = mtmd_input_chunk_get_tokens_image(img);
        const int n_tok = (int)mtmd_input_chunk_get_n_tokens(img);
        const int width = llama_model_n_embd_inp(model);
        int nx = 0, ny = 0;
        for (int i = 0; i < n_tok; i++) {
            struct mtmd_decoder_pos p = mtmd_image_tokens_get_decoder_pos(it, 0, i);
            if ((int)p.x + 1 > nx) nx = p.x + 1;
            if ((int)p.y + 1 > ny) ny = p.y + 1;
        }
        put_i32(o, nx); put_i32(o, ny); put_i32(o, n_tok);
        put_i32(o, (int)mtmd_input_chunk_get_n_pos(img)); put_i32(o, width);
        for (int i = 0; i < n_tok; i++) {
            struct mtmd_decoder_pos p = mtmd_image_tokens_get_decoder_pos(it, 0, i);
            put_i32(o, p.t); put_i32(o, p.y); put_i32(o, p.x);
        }
        fwrite(mtmd_get_output_embd(mctx), 4, (size_t)n_tok * width, o);
    } else {
        struct llama_context_params cp = llama_context_default_params();
        cp.n_ctx = 4096; cp.n_batch = 2048; cp.n_ubatch = 2048;
        cp.n_threads = n_threads; cp.n_threads_batch = n_threads;
        cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
        struct llama_context *lctx = llama_init_from_model(model, cp);
        if (!lctx) return 10;
        const size_t n_chunks = mtmd_input_chunks_size(chunks);
        put_i32(o, (int)n_chunks);
        for (size_t i = 0; i < n_chunks; i++) {
            const mtmd_input_chunk *c = mtmd_input_chunks_get(chunks, i);
            const int is_img = mtmd_input_chunk_get_type(c) == MTMD_INPUT_CHUNK_TYPE_IMAGE;
            size_t n = mtmd_input_chunk_get_n_tokens(c);
            put_i32(o, is_img); put_i32(o, (int)n);
            if (!is_img) {
                const llama_token *t = mtmd_input_chunk_get_tokens_text(c, &n);
                fwrite(t, 4, n, o);
            }
        }
        llama_pos n_past = 0;
        if (mtmd_helper_eval_chunks(mctx, lctx, chunks, 0, 0, 2048, true, &n_past) != 0) return 11;
        const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
        put_i32(o, n_past); put_i32(o, n_vocab);
        fwrite(llama_get_logits_ith(lctx, -1), 4, n_vocab, o);
        llama_free(lctx);
    }
    fclose(o);
    mtmd_input_chunks_free(chunks);
    mtmd_bitmap_free(bw.bitmap);
    mtmd_free(mctx);
    llama_model_free(model);
    free(prompt);
    return 0;
}
