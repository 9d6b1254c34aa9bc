//! `nextn graft`: one file from the trunk, tokenizer and metadata of one model file (BODY) and the
//! NextN block of another (HEAD: a full MTP model or an MTP-only sidecar), after checking that
//! they belong together.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::Path;

use nextn_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, MetadataValue};

use crate::config::{block_of, Qwen35Config};
use crate::quantize::{self, QuantizeError};
use crate::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum GraftError {
    #[error("{file}: {source}")]
    Model {
        file: &'static str,
        #[source]
        source: ModelError,
    },
    #[error("the files do not belong together: {what} differs (BODY {body}, HEAD {head})")]
    Mismatch {
        what: &'static str,
        body: String,
        head: String,
    },
    #[error("HEAD has no NextN block (its nextn_predict_layers is 0 or absent)")]
    NoHead,
    #[error("HEAD's NextN block is blk.{head_block}, but BODY has {body_layers} trunk layers: the head must follow BODY's last layer (blk.{body_layers})")]
    Layering {
        head_block: usize,
        body_layers: usize,
    },
    #[error("HEAD has no tensors for its NextN block blk.{0}")]
    EmptyHead(usize),
    #[error(transparent)]
    Quantize(#[from] QuantizeError),
    #[error(transparent)]
    Gguf(#[from] GgufError),
}

/// What a graft takes from where.
#[derive(Clone, Debug)]
pub struct GraftPlan {
    /// `blk.N` of the NextN block in the output (BODY's trunk layer count).
    pub block: usize,
    /// BODY tensors kept (the trunk, embedding, norms, output head).
    pub body_tensors: Vec<String>,
    /// HEAD tensors taken, with the type each is written in.
    pub head_tensors: Vec<(String, GgmlType)>,
    /// BODY's own NextN tensors that the HEAD's replace.
    pub replaced: Vec<String>,
    /// Hash of the tokenizer both files share (tokens and merges).
    pub tokenizer_hash: u64,
}

fn tokenizer_hash(f: &GgufFile) -> u64 {
    let mut h = DefaultHasher::new();
    for key in ["tokenizer.ggml.tokens", "tokenizer.ggml.merges"] {
        if let Some(strings) = f
            .get(key)
            .and_then(|v| v.as_array())
            .and_then(|a| a.as_strings())
        {
            strings.hash(&mut h);
        }
    }
    h.finish()
}

/// Check that BODY and HEAD belong together and list what comes from each. `head_type`
/// re-quantizes the head's quantizable tensors.
pub fn plan(
    body: &GgufFile,
    head: &GgufFile,
    head_type: Option<GgmlType>,
) -> Result<GraftPlan, GraftError> {
    let bcfg = Qwen35Config::from_gguf(body).map_err(|source| GraftError::Model {
        file: "BODY",
        source,
    })?;
    let hcfg = Qwen35Config::from_gguf(head).map_err(|source| GraftError::Model {
        file: "HEAD",
        source,
    })?;
    let mismatch = |what, b: String, h: String| -> Result<(), GraftError> {
        if b == h {
            Ok(())
        } else {
            Err(GraftError::Mismatch {
                what,
                body: b,
                head: h,
            })
        }
    };
    mismatch(
        "architecture",
        bcfg.arch.name().into(),
        hcfg.arch.name().into(),
    )?;
    mismatch(
        "hidden size (embedding_length)",
        bcfg.n_embd.to_string(),
        hcfg.n_embd.to_string(),
    )?;
    let rows = |f: &GgufFile| {
        f.tensor("token_embd.weight")
            .and_then(|t| t.dims.get(1).copied())
            .unwrap_or(0)
            .to_string()
    };
    mismatch("vocabulary (token_embd rows)", rows(body), rows(head))?;
    let (bh, hh) = (tokenizer_hash(body), tokenizer_hash(head));
    mismatch(
        "tokenizer (hash of tokens and merges)",
        format!("{bh:016x}"),
        format!("{hh:016x}"),
    )?;
    mismatch(
        "attention head dim",
        bcfg.head_dim.to_string(),
        hcfg.head_dim.to_string(),
    )?;
    let Some(head_block) = hcfg.nextn_block() else {
        return Err(GraftError::NoHead);
    };
    if head_block != bcfg.n_layer {
        return Err(GraftError::Layering {
            head_block,
            body_layers: bcfg.n_layer,
        });
    }
    let prefix = format!("blk.{head_block}.");
    let head_tensors: Vec<(String, GgmlType)> = head
        .tensors()
        .iter()
        .filter(|t| t.name.starts_with(&prefix))
        .map(|t| {
            let ty = match head_type {
                Some(ty) if quantize::mix::allows_quantization(&t.name, &t.dims, false) => {
                    quantize::mix::fallback(ty, t.dims[0])
                }
                _ => t.ty,
            };
            (t.name.clone(), ty)
        })
        .collect();
    if head_tensors.is_empty() {
        return Err(GraftError::EmptyHead(head_block));
    }
    let (body_tensors, replaced): (Vec<String>, Vec<String>) = body
        .tensors()
        .iter()
        .map(|t| t.name.clone())
        .partition(|n| block_of(n).is_none_or(|l| l < bcfg.n_layer));
    Ok(GraftPlan {
        block: head_block,
        body_tensors,
        head_tensors,
        replaced,
        tokenizer_hash: bh,
    })
}

/// Write the grafted file: BODY's metadata with `block_count` and `nextn_predict_layers` for one
/// NextN block (per-layer arrays extended by HEAD's entry for it), BODY's tensors, HEAD's block.
pub fn write(
    body: &GgufFile,
    head: &GgufFile,
    plan: &GraftPlan,
    out: &Path,
    threads: usize,
) -> Result<(), GraftError> {
    let arch = body
        .get("general.architecture")
        .and_then(|v| v.as_str())
        .unwrap_or("qwen35")
        .to_string();
    let body_blocks = body
        .get(&format!("{arch}.block_count"))
        .and_then(|v| v.as_u64())
        .unwrap_or(0) as usize;
    let mut w = GgufWriter::from_file(body);
    for t in body.tensors() {
        w.remove_tensor(&t.name);
    }
    // Per-layer arrays of BODY end with its own last layer; HEAD's entry for the block follows.
    for (key, value) in body.metadata() {
        let (MetadataValue::Array(b), Some(MetadataValue::Array(h))) = (value, head.get(key))
        else {
            continue;
        };
        if !key.starts_with(&format!("{arch}.")) || b.len() != body_blocks {
            continue;
        }
        let kept = b.len().min(plan.block);
        let (Some(bv), Some(hv)) = (b.as_i64_vec(), h.as_i64_vec()) else {
            continue;
        };
        let Some(&entry) = hv.get(plan.block) else {
            continue;
        };
        let mut merged: Vec<i64> = bv[..kept].to_vec();
        merged.push(entry);
        let array = match b {
            nextn_gguf::MetadataArray::U32(_) => {
                nextn_gguf::MetadataArray::U32(merged.iter().map(|&x| x as u32).collect())
            }
            nextn_gguf::MetadataArray::I32(_) => {
                nextn_gguf::MetadataArray::I32(merged.iter().map(|&x| x as i32).collect())
            }
            nextn_gguf::MetadataArray::Bool(_) => {
                nextn_gguf::MetadataArray::Bool(merged.iter().map(|&x| x != 0).collect())
            }
            _ => nextn_gguf::MetadataArray::I64(merged),
        };
        w.set_kv(key.clone(), MetadataValue::Array(array));
    }
    w.set_kv(
        format!("{arch}.block_count"),
        MetadataValue::U32(plan.block as u32 + 1),
    );
    w.set_kv(
        format!("{arch}.nextn_predict_layers"),
        MetadataValue::U32(1),
    );
    for name in &plan.body_tensors {
        let t = body
            .tensor(name)
            .ok_or_else(|| QuantizeError::Model(ModelError::MissingTensor(name.clone())))?;
        w.add_tensor(name.clone(), t.dims.clone(), t.ty, body.tensor_data(t))?;
    }
    for (name, ty) in &plan.head_tensors {
        let t = head
            .tensor(name)
            .ok_or_else(|| QuantizeError::Model(ModelError::MissingTensor(name.clone())))?;
        if *ty == t.ty {
            w.add_tensor(name.clone(), t.dims.clone(), t.ty, head.tensor_data(t))?;
        } else {
            w.add_tensor_deferred(name.clone(), t.dims.clone(), *ty)?;
        }
    }
    w.discard_preserved_layout();
    let mut failure: Option<QuantizeError> = None;
    let mut source = |name: &str, sink: &mut dyn std::io::Write| -> std::io::Result<()> {
        let converted = head
            .tensor(name)
            .ok_or_else(|| QuantizeError::Model(ModelError::MissingTensor(name.to_string())))
            .and_then(|t| {
                let ty = plan
                    .head_tensors
                    .iter()
                    .find(|(n, _)| n == name)
                    .map_or(t.ty, |&(_, ty)| ty);
                quantize::convert_rows(
                    name,
                    head.tensor_data(t),
                    t.ty,
                    ty,
                    t.dims[0] as usize,
                    1,
                    None,
                    threads,
                )
            });
        match converted {
            Ok(bytes) => sink.write_all(&bytes),
            Err(e) => {
                let message = e.to_string();
                failure = Some(e);
                Err(std::io::Error::other(message))
            }
        }
    };
    let written = w.write_file_with(out, &mut source);
    match (written, failure) {
        (_, Some(e)) => Err(e.into()),
        (Ok(()), None) => Ok(()),
        (Err(e), None) => Err(e.into()),
    }
}
