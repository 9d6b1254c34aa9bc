//! Random-weight Qwen3.5 / Qwen3.6 GGUF files with real shapes (`nextn synth`): benchmarks and
//! memory planning without downloading checkpoints.
//!
//! A file is: the metadata of docs/MODEL.md, "GGUF metadata", for a [`SynthSpec`], the real Qwen
//! tokenizer ([`vocab`]), and every tensor of docs/MODEL.md, "Tensor names", in llama-quantize's
//! order and per-tensor type mix
//! ([`plan`]), filled with deterministic random values scaled so that activations stay O(1) and
//! the logits are finite and far from uniform ([`random`]). Big presets stream to disk tensor by
//! tensor ([`write`]).

pub mod plan;
pub mod random;
pub mod spec;
pub mod vocab;
pub mod write;

use std::path::{Path, PathBuf};

use nextn_gguf::GgufError;
use nextn_quant::QuantError;

pub use plan::{plan, FileType, PlannedTensor};
pub use spec::{SynthSpec, PRESETS, QWEN35_N_VOCAB};
pub use vocab::{RawVocab, Vocab};
pub use write::Progress;

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("--{field}: {why}")]
    BadSpec { field: &'static str, why: String },
    #[error("vocabulary data, byte {offset}: {why}")]
    Vocab { offset: u64, why: String },
    #[error("tensor '{tensor}': {why}")]
    Plan { tensor: String, why: String },
    #[error("tensor '{tensor}': {source}")]
    Quantize { tensor: String, source: QuantError },
    #[error("tensor '{tensor}': a worker thread panicked")]
    Worker { tensor: String },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Gguf(#[from] GgufError),
}

/// What [`synthesize`] wrote.
#[derive(Clone, Debug)]
pub struct Summary {
    pub tensors: Vec<PlannedTensor>,
    pub file_bytes: u64,
    pub n_params: u64,
}

/// Writes a random-weight model for `spec` at `ftype` to `path`. Deterministic for a `seed`
/// (whatever `threads` is). `progress` is called after each tensor.
pub fn synthesize(
    path: &Path,
    spec: &SynthSpec,
    ftype: FileType,
    vocab: &Vocab,
    seed: u64,
    threads: usize,
    progress: &mut dyn FnMut(&Progress),
) -> Result<Summary, SynthError> {
    spec.validate()?;
    if vocab.tokens.len() != spec.n_vocab {
        return Err(SynthError::BadSpec {
            field: "vocab",
            why: format!(
                "the tokenizer has {} tokens, the embedding {} rows",
                vocab.tokens.len(),
                spec.n_vocab
            ),
        });
    }
    let tensors = plan(spec, ftype);
    let kvs = spec.metadata(ftype, vocab, seed);
    let file_bytes = write::write_gguf(path, &kvs, &tensors, seed, threads.max(1), progress)?;
    let n_params = tensors.iter().map(|t| t.dims.iter().product::<u64>()).sum();
    Ok(Summary {
        tensors,
        file_bytes,
        n_params,
    })
}

/// Bytes the file will take (header excluded: it is small next to the tensors).
pub fn estimated_bytes(spec: &SynthSpec, ftype: FileType) -> u64 {
    plan(spec, ftype).iter().map(|t| t.n_bytes()).sum()
}
