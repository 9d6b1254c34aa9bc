//! Byte accounting of a pass (`pass_bytes`) against sums computed straight from the GGUF's tensor
//! directory, and the MoE rule that rows choosing the same expert read its weights once.

use std::path::PathBuf;
use std::sync::Arc;

use nextn_gguf::{GgmlType, GgufFile};
use nextn_model::pass_bytes::{self, PassShape};
use nextn_model::{KvType, LogitRows, Model, NextnHead};
use nextn_quant::kernels::ThreadPool;

fn bundled() -> PathBuf {
    nextn_testdata::bundled_model()
}

/// Block index of a `blk.N.` tensor name.
fn block_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// Bytes the forward reads in memory: quantized matrices as stored, 1-D tensors as f32 (they are
/// dequantized once at load).
fn resident_bytes(f: &GgufFile, name: &str) -> u64 {
    let t = f.tensor(name).expect("tensor");
    if t.dims.iter().filter(|&&d| d > 1).count() <= 1 && t.ty != GgmlType::F32 {
        t.n_elements * 4
    } else {
        t.n_bytes
    }
}

#[test]
fn decode_bytes_equal_the_tensors_the_forward_reads() {
    let file = Arc::new(GgufFile::open(bundled()).expect("open bundled model"));
    let model = Model::load(file.clone()).expect("load");
    let cfg = &model.config;
    let n_layer = cfg.n_layer;

    // Independently: every trunk block tensor, the final norm, the LM head (untied output or the
    // tied embedding) once, and one embedding row per token.
    let mut weights = 0u64;
    for t in file.tensors() {
        if block_of(&t.name).is_some_and(|b| b < n_layer) || t.name == "output_norm.weight" {
            weights += resident_bytes(&file, &t.name);
        }
    }
    let embd = file.tensor("token_embd.weight").expect("embedding");
    let lm_head = file
        .tensor("output.weight")
        .map(|t| t.n_bytes)
        .unwrap_or(embd.n_bytes);
    let embd_row = embd.n_bytes / embd.dims[1];

    let shape = |n_past, n_rows, logit_rows| PassShape {
        n_past,
        n_rows,
        logit_rows,
        k_type: KvType::F16,
        v_type: KvType::F32,
    };
    let decode = pass_bytes::trunk_pass_bytes(&model, &shape(10, 1, 1));
    assert_eq!(decode.weights + decode.experts, weights);
    assert_eq!(decode.lm_head, lm_head);
    assert_eq!(decode.embedding, embd_row);

    // KV: per full-attention layer, n_kv·head_dim values of K (f16) and V (f32) for the cached
    // positions read plus the new row written and read.
    let kv_width: u64 = (0..n_layer)
        .filter(|&il| cfg.layer_kinds[il] == nextn_model::LayerKind::FullAttention)
        .map(|il| (cfg.n_head_kv[il] * cfg.head_dim) as u64)
        .sum();
    assert!(kv_width > 0);
    assert_eq!(decode.kv_cache, kv_width * (2 + 4) * (10 + 2));

    // Delta-net: the conv window and the recurrent state, read and written.
    let n_delta = (0..n_layer)
        .filter(|&il| cfg.layer_kinds[il] == nextn_model::LayerKind::DeltaNet)
        .count() as u64;
    let per_layer = (cfg.ssm_v_heads * cfg.ssm_head_dim * cfg.ssm_head_dim
        + (cfg.conv_kernel - 1) * cfg.conv_dim()) as u64
        * 4;
    assert_eq!(decode.recurrent_state, 2 * n_delta * per_layer);
    assert_eq!(
        decode.total(),
        weights + lm_head + embd_row + decode.kv_cache + decode.recurrent_state
    );

    // A verify pass reads the same weights once, whatever its row count; no logits, no LM head.
    let verify = pass_bytes::trunk_pass_bytes(&model, &shape(10, 4, 4));
    assert_eq!(verify.weights, decode.weights);
    assert_eq!(verify.lm_head, decode.lm_head);
    assert_eq!(verify.embedding, 4 * embd_row);
    assert_eq!(
        pass_bytes::trunk_pass_bytes(&model, &shape(10, 1, 0)).lm_head,
        0
    );

    // The head: its block's tensors plus eh_proj and its norms, and its LM head.
    let head = NextnHead::load(&model).expect("head");
    let block = cfg.nextn_block().expect("nextn block");
    let mut head_weights = 0u64;
    let mut head_lm = lm_head;
    for t in file.tensors() {
        if block_of(&t.name) != Some(block) {
            continue;
        }
        if t.name.ends_with("nextn.embed_tokens.weight") {
            continue;
        }
        if t.name.ends_with("nextn.shared_head_head.weight") {
            head_lm = t.n_bytes;
            continue;
        }
        head_weights += resident_bytes(&file, &t.name);
    }
    let draft = pass_bytes::head_pass_bytes(&head, &shape(10, 1, 1));
    if file
        .tensor(&format!("blk.{block}.nextn.shared_head_norm.weight"))
        .is_none()
    {
        // Absent from the file, the head falls back to the trunk's final norm.
        head_weights += resident_bytes(&file, "output_norm.weight");
    }
    assert_eq!(draft.weights, head_weights);
    assert_eq!(draft.lm_head, head_lm);
}

/// Rows of one verify pass that route to the same expert share one read of its weights, and the
/// pass's per-row results are bit-identical to decoding the rows one at a time.
#[test]
fn moe_verify_rows_read_each_chosen_expert_once() {
    let Some(golden) = nextn_testdata::shared("golden") else {
        return;
    };
    let path = golden.join("q35moe-a/q35moe-a-Q8_0.gguf");
    let model = Model::load(Arc::new(GgufFile::open(&path).expect("open"))).expect("load");
    let pool = ThreadPool::new(2);
    let prompt: Vec<u32> = (0..9u32)
        .map(|i| (i * 53 + 11) % model.n_vocab as u32)
        .collect();
    // Repeated tokens route alike in the early layers, so sharing is certain to occur.
    let rows = [7u32, 7, 7, 7];

    let mut base = model.new_sequence(64, KvType::F16, KvType::F16).unwrap();
    model
        .forward(&prompt, &mut base, LogitRows::None, &pool)
        .expect("prefill");

    let mut st = base.clone();
    pass_bytes::reset_expert_usage(&model);
    let verify = model.forward_verify(&rows, &mut st, &pool).expect("verify");
    let (distinct, reads) = pass_bytes::expert_reads(&model.layers);
    assert!(distinct > 0);
    assert_eq!(
        reads, distinct,
        "an expert was read more than once in one pass"
    );
    let k = model.config.n_expert_used as u64;
    let n_moe = model.layers.len() as u64;
    assert!(
        reads < rows.len() as u64 * k * n_moe,
        "no two rows shared an expert: {reads} reads"
    );
    let shape = PassShape {
        n_past: prompt.len(),
        n_rows: rows.len(),
        logit_rows: rows.len(),
        k_type: KvType::F16,
        v_type: KvType::F16,
    };
    let bytes = pass_bytes::trunk_pass_bytes(&model, &shape);
    assert!(bytes.experts > 0 && bytes.experts < pass_bytes::all_expert_bytes(&model));

    // Row by row: the same logits to the bit, and each single-row pass reads k experts per layer.
    let mut single = base.clone();
    let mut per_row_reads = 0;
    for (i, &t) in rows.iter().enumerate() {
        pass_bytes::reset_expert_usage(&model);
        let out = model
            .forward(&[t], &mut single, LogitRows::Last, &pool)
            .expect("decode");
        let (d, r) = pass_bytes::expert_reads(&model.layers);
        assert_eq!((d, r), (k * n_moe, k * n_moe));
        per_row_reads += r;
        let a: Vec<u32> = out.logits.iter().map(|v| v.to_bits()).collect();
        let b: Vec<u32> = verify.logits_row(i).iter().map(|v| v.to_bits()).collect();
        assert_eq!(a, b, "row {i} differs between verify and decode");
    }
    assert!(reads < per_row_reads);
}
