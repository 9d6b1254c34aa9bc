// llama.cpp's logits for every row of a token sequence with chosen KV cache types, for the
// reference in crates/nextn-model/tests/data/kv_quant_llamacpp.json.
//
// Build against a llama.cpp build tree L (its include/ and build/bin/ libraries):
//   gcc -O2 -o llama_kv_logits tools/llama_kv_logits.c -I$L/include -I$L/ggml/include \
//       -L$L/build/bin -lllama -lggml -lggml-base -Wl,-rpath,$L/build/bin
// Run:
//   llama_kv_logits MODEL.gguf TOKENS.txt TYPE_K TYPE_V FLASH_ATTN(0|1) OUT.bin
// TOKENS.txt holds whitespace-separated token ids (a golden.json sequence); OUT.bin is
// n_rows (i32), n_vocab (i32), then n_rows × n_vocab f32 logits. Types: f32 f16 q8_0 q4_0.
#include "llama.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static enum ggml_type ty(const char *s) {
    if (!strcmp(s, "f32")) return GGML_TYPE_F32;
    if (!strcmp(s, "f16")) return GGML_TYPE_F16;
    if (!strcmp(s, "q8_0")) return GGML_TYPE_Q8_0;
    if (!strcmp(s, "q4_0")) return GGML_TYPE_Q4_0;
    fprintf(stderr, "bad type %s\n", s); exit(1);
}
int main(int argc, char **argv) {
    if (argc != 7) { fprintf(stderr, "usage\n"); return 1; }
    FILE *f = fopen(argv[2], "r");
    int toks[4096], n = 0;
    while (n < 4096 && fscanf(f, "%d", &toks[n]) == 1) n++;
    fclose(f);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 2;
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 1024; cp.n_batch = 512; cp.n_ubatch = 512;
    cp.n_threads = 1; cp.n_threads_batch = 1;
    cp.type_k = ty(argv[3]); cp.type_v = ty(argv[4]);
    cp.flash_attn_type = atoi(argv[5]) ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) return 3;
    struct llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        b.token[i] = toks[i]; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1;
    }
    b.n_tokens = n;
    if (llama_decode(ctx, b)) return 4;
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    int nv = llama_vocab_n_tokens(vocab);
    FILE *o = fopen(argv[6], "wb");
    fwrite(&n, 4, 1, o); fwrite(&nv, 4, 1, o);
    for (int i = 0; i < n; i++) fwrite(llama_get_logits_ith(ctx, i), 4, nv, o);
    fclose(o);
    llama_batch_free(b); llama_free(ctx); llama_model_free(model);
    return 0;
}
