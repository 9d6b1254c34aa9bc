//! One validation pass between parsing a model file and sizing anything by it: the metadata
//! (through [`Qwen35Config::from_gguf`], which bounds every count by the file's own tensors
//! before allocating), every tensor the configuration implies (shape, type), and the tokenizer
//! arrays and special token ids. Loading, `nextn verify` and `nextn inspect` all run it, so a
//! file that passes is one the model, the head and the tokenizer can be built from.

use nextn_gguf::{GgmlType, GgufFile, MetadataValue};

use crate::config::Qwen35Config;
use crate::inventory::{self, ExpectedTensor, TensorProblem};
use crate::ModelError;

/// A file that passed: its configuration and what the checks found out about it.
#[derive(Clone, Debug)]
pub struct ValidModel {
    pub config: Qwen35Config,
    /// Rows of `token_embd.weight`, equal to the tokenizer's token count.
    pub n_vocab: usize,
    /// An MTP-only file: the NextN block with the embedding, final norm and head, no trunk.
    pub sidecar: bool,
    /// Tensors checked against the configuration.
    pub n_tensors_checked: usize,
}

/// Everything wrong with a file, each problem naming its key or tensor.
#[derive(Debug, thiserror::Error)]
#[error("{}", list(.0))]
pub struct InvalidModel(pub Vec<ModelError>);

fn list(problems: &[ModelError]) -> String {
    match problems {
        [one] => one.to_string(),
        many => {
            let items: Vec<String> = many.iter().map(|p| p.to_string()).collect();
            format!("{} problems: {}", many.len(), items.join("; "))
        }
    }
}

/// Special token ids the tokenizer and the engine use; each must name a token of the file.
const TOKEN_ID_KEYS: [&str; 9] = [
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.seperator_token_id",
    "tokenizer.ggml.cls_token_id",
    "tokenizer.ggml.mask_token_id",
];

/// An MTP-only file: the tensors of one block, the last, and none of the trunk's layers before
/// it. (A full model missing some trunk tensors is a damaged model, not a sidecar.)
pub fn is_sidecar(file: &GgufFile) -> bool {
    let layers = crate::config::layers_in_tensors(file);
    layers > 1
        && !file
            .tensors()
            .iter()
            .any(|t| crate::config::block_of(&t.name).is_some_and(|n| n + 1 < layers))
}

/// Check a model file (a full model or an MTP-only sidecar) without reading tensor data.
pub fn validate(file: &GgufFile) -> Result<ValidModel, InvalidModel> {
    let mut problems = Vec::new();
    let n_vocab = inventory::n_vocab(file);
    let sidecar = is_sidecar(file);
    let config = match Qwen35Config::from_gguf(file) {
        Ok(c) => Some(c),
        Err(e) => {
            problems.push(e);
            None
        }
    };
    let mut n_tensors_checked = 0;
    if n_vocab == 0 {
        problems.push(ModelError::MissingTensor("token_embd.weight".into()));
    } else if let Some(cfg) = &config {
        let expected = expected_tensors(cfg, file, n_vocab, sidecar);
        n_tensors_checked = expected.len();
        problems.extend(
            inventory::check(file, &expected)
                .into_iter()
                .map(tensor_error),
        );
        problems.extend(vector_types(file, &expected));
    }
    problems.extend(tokenizer_problems(file, n_vocab));
    match config {
        Some(config) if problems.is_empty() => Ok(ValidModel {
            config,
            n_vocab,
            sidecar,
            n_tensors_checked,
        }),
        _ => Err(InvalidModel(problems)),
    }
}

/// The tensors a configuration implies: the trunk and the NextN block, or for a sidecar the
/// block plus the embedding (its final norm and head are optional there).
pub fn expected_tensors(
    cfg: &Qwen35Config,
    file: &GgufFile,
    n_vocab: usize,
    sidecar: bool,
) -> Vec<ExpectedTensor> {
    let mut expected = inventory::nextn_tensors(cfg, file, n_vocab);
    if sidecar {
        expected.push(ExpectedTensor {
            name: "token_embd.weight".into(),
            dims: vec![cfg.n_embd as u64, n_vocab as u64],
            required: true,
        });
    } else {
        expected.extend(inventory::trunk_tensors(cfg, file, n_vocab));
    }
    expected
}

fn tensor_error(p: TensorProblem) -> ModelError {
    match p {
        TensorProblem::Missing { name } => ModelError::MissingTensor(name),
        TensorProblem::Shape {
            name,
            expected,
            found,
        } => ModelError::TensorShape {
            tensor: name,
            expected,
            found,
        },
        TensorProblem::Type { name, ty } => ModelError::TensorType {
            tensor: name,
            found: ty.name().to_string(),
            expected: "a type nextn can dequantize",
        },
    }
}

/// Norm weights, biases and the other one-dimensional tensors are F32 in every file llama.cpp's
/// converter and quantizer write (they are never quantized); anything else is a damaged file.
fn vector_types(file: &GgufFile, expected: &[ExpectedTensor]) -> Vec<ModelError> {
    expected
        .iter()
        .filter(|x| x.dims.len() == 1)
        .filter_map(|x| file.tensor(&x.name))
        .filter(|t| t.ty != GgmlType::F32)
        .map(|t| ModelError::TensorType {
            tensor: t.name.clone(),
            found: t.ty.name().to_string(),
            expected: "F32 (norm and bias vectors are never quantized)",
        })
        .collect()
}

fn bad(key: &str, why: String) -> ModelError {
    ModelError::BadValue {
        key: key.to_string(),
        why,
    }
}

/// The tokenizer's arrays exist, agree in length with each other and with the embedding, and
/// every special token id is one of the tokens.
fn tokenizer_problems(file: &GgufFile, n_vocab: usize) -> Vec<ModelError> {
    let mut problems = Vec::new();
    const MODEL: &str = "tokenizer.ggml.model";
    const TOKENS: &str = "tokenizer.ggml.tokens";
    const MERGES: &str = "tokenizer.ggml.merges";
    match file.get(MODEL).map(|v| v.as_str()) {
        None => problems.push(ModelError::MissingKey(MODEL.into())),
        Some(None) => problems.push(bad(MODEL, "is not a string".into())),
        Some(Some("gpt2")) => match file.get(MERGES).map(|v| v.as_array()) {
            None => problems.push(ModelError::MissingKey(MERGES.into())),
            Some(Some(a)) if a.as_strings().is_some() => {}
            Some(_) => problems.push(bad(MERGES, "is not an array of strings".into())),
        },
        Some(Some(other)) => problems.push(bad(
            MODEL,
            format!("tokenizer '{other}' is not supported (Qwen3.5/3.6 files use gpt2)"),
        )),
    }
    let n_tokens = match file
        .get(TOKENS)
        .map(|v| v.as_array().and_then(|a| a.as_strings()))
    {
        None => {
            problems.push(ModelError::MissingKey(TOKENS.into()));
            None
        }
        Some(None) => {
            problems.push(bad(TOKENS, "is not an array of strings".into()));
            None
        }
        Some(Some(tokens)) => Some(tokens.len()),
    };
    if let Some(n) = n_tokens {
        if n == 0 {
            problems.push(bad(TOKENS, "is empty".into()));
        } else if n_vocab > 0 && n != n_vocab {
            problems.push(bad(
                TOKENS,
                format!(
                    "{n} tokens, but token_embd.weight has {n_vocab} rows (a file's vocabulary and embedding have the same size)"
                ),
            ));
        }
        for key in ["tokenizer.ggml.token_type", "tokenizer.ggml.scores"] {
            if let Some(MetadataValue::Array(a)) = file.get(key) {
                if a.len() != n {
                    problems.push(bad(key, format!("{} entries for {n} tokens", a.len())));
                }
            } else if file.get(key).is_some() {
                problems.push(bad(key, "is not an array".into()));
            }
        }
    }
    let bound = match (n_tokens, n_vocab) {
        (Some(n), 0) => n,
        (Some(n), v) => n.min(v),
        (None, v) => v,
    };
    for key in TOKEN_ID_KEYS {
        let Some(value) = file.get(key) else {
            continue;
        };
        match value.as_u64() {
            Some(id) if bound > 0 && id >= bound as u64 => problems.push(bad(
                key,
                format!("token id {id} is outside the vocabulary of {bound} tokens"),
            )),
            Some(_) => {}
            None => problems.push(bad(key, "is not a non-negative integer".into())),
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;
    use nextn_gguf::{GgufWriter, MetadataArray};

    fn bundled() -> GgufFile {
        GgufFile::open(nextn_testdata::bundled_model()).expect("bundled model")
    }

    fn edited(edit: impl FnOnce(&mut GgufWriter)) -> GgufFile {
        let base = bundled();
        let mut w = GgufWriter::from_file(&base);
        edit(&mut w);
        w.discard_preserved_layout();
        GgufFile::from_bytes(w.to_bytes().expect("write")).expect("parse")
    }

    fn problems(f: &GgufFile) -> Vec<String> {
        match validate(f) {
            Ok(_) => Vec::new(),
            Err(e) => e.0.iter().map(|p| p.to_string()).collect(),
        }
    }

    #[test]
    fn the_bundled_model_passes() {
        let v = validate(&bundled()).expect("valid");
        assert_eq!(v.n_vocab, 8192);
        assert!(!v.sidecar);
        assert_eq!(v.n_tensors_checked, 126);
    }

    /// Every problem of a file is reported at once, each naming its key.
    #[test]
    fn problems_are_collected_and_name_their_keys() {
        let f = edited(|w| {
            w.set_kv("tokenizer.ggml.bos_token_id", 9000u32);
            w.set_kv(
                "tokenizer.ggml.token_type",
                MetadataArray::from(vec![1i32; 3]),
            );
            w.remove_kv("tokenizer.ggml.merges");
        });
        let p = problems(&f);
        assert_eq!(p.len(), 3, "{p:?}");
        for key in ["bos_token_id", "token_type", "tokenizer.ggml.merges"] {
            assert!(p.iter().any(|x| x.contains(key)), "{key} not in {p:?}");
        }
    }

    /// A layer count the tensors do not back is refused before anything is sized by it, and an
    /// allocation sized by a file value is refused rather than attempted when out of bounds.
    #[test]
    fn counts_are_bounded_by_the_file() {
        let f = edited(|w| w.set_kv("qwen35.block_count", 12u32));
        let p = problems(&f);
        assert!(
            p[0].contains("qwen35.block_count") && p[0].contains("9 layers"),
            "{p:?}"
        );
        let err = crate::config::file_sized_vec("k.block_count", usize::MAX / 2, 0u64).unwrap_err();
        assert!(err.to_string().contains("k.block_count"), "{err}");
        assert_eq!(
            crate::config::file_sized_vec("k", 3, 7u8).expect("small"),
            vec![7; 3]
        );
    }

    /// A file with only the last block (and the embedding) is a sidecar; a full model missing
    /// one trunk tensor is a damaged model.
    #[test]
    fn sidecars_are_files_without_trunk_layers() {
        let damaged = edited(|w| {
            w.remove_tensor("blk.0.attn_norm.weight");
        });
        assert!(!is_sidecar(&damaged));
        assert!(problems(&damaged)
            .iter()
            .any(|p| p.contains("blk.0.attn_norm.weight")));
        let base = bundled();
        let sidecar = edited(|w| {
            for t in base.tensors() {
                if t.name.starts_with("blk.") && !t.name.starts_with("blk.8.") {
                    w.remove_tensor(&t.name);
                }
            }
        });
        assert!(is_sidecar(&sidecar));
        assert!(validate(&sidecar).expect("valid sidecar").sidecar);
        assert!(!is_sidecar(&base));
    }
}
