//! Re-quantizing a model file (`nextn quantize`): the type of every tensor (llama-quantize's mix
//! and overrides, [`mix`]), then the file written tensor by tensor, each quantized row-parallel
//! while it is written, so the output never has to fit in memory.

pub mod imatrix;
pub mod mix;

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use nextn_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, MetadataValue, SplitLimit};
use nextn_quant::formats;
use nextn_quant::QuantError;

use crate::config::Qwen35Config;
use crate::ModelError;
pub use imatrix::Importance;
pub use mix::{FileType, MixOptions, ModelFacts};

#[derive(Debug, thiserror::Error)]
pub enum QuantizeError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("tensor '{tensor}': {source}")]
    Quant {
        tensor: String,
        #[source]
        source: QuantError,
    },
    #[error(
        "tensor '{tensor}' would be {ty}, which nextn cannot quantize to (it can: {supported})"
    )]
    NoQuantizer {
        tensor: String,
        ty: GgmlType,
        supported: String,
    },
    #[error("tensor '{tensor}' is already {from}: quantizing it again to {to} loses quality twice; pass --allow-requantize to do it anyway")]
    Requantize {
        tensor: String,
        from: GgmlType,
        to: GgmlType,
    },
    #[error("tensor '{tensor}': the importance matrix has {found} values for it, the tensor needs {expected} (its row length times its experts)")]
    ImportanceSize {
        tensor: String,
        found: usize,
        expected: usize,
    },
    #[error("tensor '{tensor}' has {ne0} values per row, which {ty} cannot hold in whole blocks of {block}")]
    PartialBlock {
        tensor: String,
        ty: GgmlType,
        ne0: u64,
        block: usize,
    },
}

/// One tensor of the output: where it comes from and what it becomes.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub source: GgmlType,
    pub target: GgmlType,
    pub source_bytes: u64,
    pub target_bytes: u64,
}

/// What to write.
#[derive(Clone, Debug)]
pub struct Plan {
    pub ftype: FileType,
    pub tensors: Vec<PlannedTensor>,
}

impl Plan {
    pub fn source_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.source_bytes).sum()
    }

    pub fn target_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.target_bytes).sum()
    }
}

/// The facts llama-quantize's rules read from a model's hyper-parameters.
pub fn model_facts(cfg: &Qwen35Config) -> ModelFacts {
    let (h, hkv) = (
        cfg.n_head.first().copied().unwrap_or(1),
        cfg.n_head_kv.first().copied().unwrap_or(1).max(1),
    );
    ModelFacts {
        n_layer_all: cfg.n_layer_all,
        n_expert: cfg.n_expert,
        n_gqa: h / hkv,
    }
}

/// The type of every tensor of `file` in `ftype` with `opts`, in the order they are written
/// (llama-quantize's). Refuses types nextn has no quantizer for, rows that a type cannot
/// divide into blocks, and re-quantizing an already quantized tensor unless `allow_requantize`.
pub fn plan(
    file: &GgufFile,
    ftype: FileType,
    opts: &MixOptions,
    allow_requantize: bool,
) -> Result<Plan, QuantizeError> {
    let cfg = Qwen35Config::from_gguf(file)?;
    let mut names: Vec<String> = file.tensors().iter().map(|t| t.name.clone()).collect();
    mix::llama_order(&mut names);
    let infos: Vec<_> = names.iter().filter_map(|n| file.tensor(n)).collect();
    let listed: Vec<(String, Vec<u64>, GgmlType)> = infos
        .iter()
        .map(|t| (t.name.clone(), t.dims.clone(), t.ty))
        .collect();
    let types = mix::choose_types(&listed, ftype, model_facts(&cfg), opts);
    let mut tensors = Vec::with_capacity(infos.len());
    for (info, target) in infos.into_iter().zip(types) {
        let name = info.name.clone();
        let ne0 = info.dims.first().copied().unwrap_or(1);
        if target != info.ty {
            if !formats::can_quantize(target) {
                let supported: Vec<&str> = GgmlType::all()
                    .filter(|&t| formats::can_quantize(t))
                    .map(|t| t.name())
                    .collect();
                return Err(QuantizeError::NoQuantizer {
                    tensor: name,
                    ty: target,
                    supported: supported.join(" "),
                });
            }
            if info.ty.is_quantized() && !allow_requantize {
                return Err(QuantizeError::Requantize {
                    tensor: name,
                    from: info.ty,
                    to: target,
                });
            }
            if !ne0.is_multiple_of(target.block_size() as u64) {
                return Err(QuantizeError::PartialBlock {
                    tensor: name,
                    ty: target,
                    ne0,
                    block: target.block_size(),
                });
            }
        }
        let target_bytes = target.row_bytes(ne0).unwrap_or(0) * info.n_rows();
        tensors.push(PlannedTensor {
            name,
            dims: info.dims.clone(),
            source: info.ty,
            target,
            source_bytes: info.n_bytes,
            target_bytes,
        });
    }
    Ok(Plan { ftype, tensors })
}

/// `rows` rows of `ne0` values from `source` bytes into `target` bytes, the rows spread over
/// `threads` threads. Each row is dequantized to f32 and quantized alone, so the bytes do not
/// depend on the thread count. `importance` (`ne0` weights per expert, the experts' rows
/// `rows_per_expert` each) goes to the quantizers that use it.
#[allow(clippy::too_many_arguments)]
pub fn convert_rows(
    tensor: &str,
    data: &[u8],
    source: GgmlType,
    target: GgmlType,
    ne0: usize,
    rows_per_expert: usize,
    importance: Option<&[f32]>,
    threads: usize,
) -> Result<Vec<u8>, QuantizeError> {
    let quant = |source| QuantizeError::Quant {
        tensor: tensor.to_string(),
        source,
    };
    let src_row = source.row_bytes(ne0 as u64).unwrap_or(0) as usize;
    let dst_row = target.row_bytes(ne0 as u64).unwrap_or(0) as usize;
    let rows = data.len().checked_div(src_row).unwrap_or(0);
    let mut out = vec![0u8; rows * dst_row];
    let threads = threads.clamp(1, rows.max(1));
    let per_thread = rows.div_ceil(threads).max(1);
    let rows_per_expert = rows_per_expert.max(1);
    std::thread::scope(|scope| {
        let workers: Vec<_> = out
            .chunks_mut(per_thread * dst_row)
            .zip(data.chunks(per_thread * src_row))
            .enumerate()
            .map(|(chunk, (dst, src))| {
                scope.spawn(move || -> Result<(), QuantError> {
                    let mut values = vec![0.0f32; ne0];
                    let first = chunk * per_thread;
                    for (r, (d, s)) in dst
                        .chunks_exact_mut(dst_row)
                        .zip(src.chunks_exact(src_row))
                        .enumerate()
                    {
                        let expert = (first + r) / rows_per_expert;
                        let weights =
                            importance.and_then(|w| w.get(expert * ne0..(expert + 1) * ne0));
                        formats::dequantize(source, s, &mut values)?;
                        formats::quantize_with_importance(target, &values, d, weights)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            match w.join() {
                Ok(r) => r.map_err(quant)?,
                Err(_) => {
                    return Err(quant(QuantError::NoSuchOp {
                        ty: target,
                        op: "quantize (a worker thread failed)",
                    }))
                }
            }
        }
        Ok(())
    })?;
    Ok(out)
}

/// Where the output goes.
#[derive(Clone, Debug)]
pub enum Output {
    File(PathBuf),
    /// Shards `<stem>-0000k-of-0000N.gguf`.
    Split {
        stem: PathBuf,
        limit: SplitLimit,
    },
}

/// Write `plan` from `file` to `output`; `progress(done_bytes, total_bytes, tensor)` is called
/// as each tensor is written. Returns the paths written.
pub fn write(
    file: &GgufFile,
    plan: &Plan,
    output: &Output,
    importance: Option<&Importance>,
    threads: usize,
    progress: &mut dyn FnMut(u64, u64, &str),
) -> Result<Vec<PathBuf>, QuantizeError> {
    // Every entry is checked before the first byte is written.
    let mut weights: HashMap<&str, &[f32]> = HashMap::new();
    for t in plan.tensors.iter().filter(|t| t.source != t.target) {
        let Some(values) = importance.and_then(|m| m.entries.get(&t.name)) else {
            continue;
        };
        let expected = t.dims[0] as usize * t.dims.get(2).copied().unwrap_or(1) as usize;
        if values.len() == expected {
            weights.insert(&t.name, values);
        } else if t.name != "token_embd.weight" {
            // llama-quantize skips a mismatched embedding entry and refuses any other.
            return Err(QuantizeError::ImportanceSize {
                tensor: t.name.clone(),
                found: values.len(),
                expected,
            });
        }
    }
    let mut w = GgufWriter::from_file(file);
    for t in file.tensors() {
        w.remove_tensor(&t.name);
    }
    // As llama-quantize: the source's metadata, with the quantization version and file type.
    w.set_kv("general.quantization_version", MetadataValue::U32(2));
    w.set_kv(
        "general.file_type",
        MetadataValue::U32(plan.ftype.llama_ftype()),
    );
    let by_name: HashMap<&str, &PlannedTensor> =
        plan.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    for t in &plan.tensors {
        if t.target == t.source {
            let info = file
                .tensor(&t.name)
                .ok_or_else(|| ModelError::MissingTensor(t.name.clone()))?;
            w.add_tensor(
                t.name.clone(),
                t.dims.clone(),
                t.source,
                file.tensor_data(info),
            )?;
        } else {
            w.add_tensor_deferred(t.name.clone(), t.dims.clone(), t.target)?;
        }
    }
    w.discard_preserved_layout();
    let total = plan.target_bytes();
    let mut done = 0u64;
    let mut failure: Option<QuantizeError> = None;
    let mut source = |name: &str, out: &mut dyn Write| -> std::io::Result<()> {
        let result = (|| -> Result<Vec<u8>, QuantizeError> {
            let t = by_name
                .get(name)
                .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
            let info = file
                .tensor(name)
                .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
            convert_rows(
                name,
                file.tensor_data(info),
                t.source,
                t.target,
                t.dims[0] as usize,
                t.dims.get(1).copied().unwrap_or(1) as usize,
                weights.get(name).copied(),
                threads,
            )
        })();
        match result {
            Ok(bytes) => {
                out.write_all(&bytes)?;
                done += bytes.len() as u64;
                progress(done, total, name);
                Ok(())
            }
            Err(e) => {
                let message = e.to_string();
                failure = Some(e);
                Err(std::io::Error::other(message))
            }
        }
    };
    let written = match output {
        Output::File(path) => w
            .write_file_with(path, &mut source)
            .map(|()| vec![path.clone()]),
        Output::Split { stem, limit } => w.write_split_with(stem, *limit, &mut source),
    };
    match (written, failure) {
        (_, Some(e)) => Err(e),
        (Ok(paths), None) => Ok(paths),
        (Err(e), None) => Err(e.into()),
    }
}

/// The shard stem for `--split-max-size`: `OUT` without its `.gguf`.
pub fn split_stem(out: &Path) -> PathBuf {
    match out.to_str().and_then(|s| s.strip_suffix(".gguf")) {
        Some(stem) => PathBuf::from(stem),
        None => out.to_path_buf(),
    }
}
