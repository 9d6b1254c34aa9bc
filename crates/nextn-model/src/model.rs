//! The Qwen3.5 trunk: embedding, decoder layers (docs/MODEL.md, "Decoder layer"), final norm and
//! LM head (docs/MODEL.md, "Final norm and LM head").

use std::sync::Arc;

use nextn_gguf::GgufFile;
use nextn_quant::kernels::ThreadPool;

use crate::attention::GatedAttention;
use crate::cache::{KvLayer, KvType, LayerCache, SequenceState};
use crate::config::{LayerKind, Qwen35Config};
use crate::delta_net::GatedDeltaNet;
use crate::device::DeviceModel;
use crate::ffn::Ffn;
use crate::ops;
use crate::weights::{Linear, WeightLoader};
use crate::ModelError;

pub enum Mixer {
    Attention(GatedAttention),
    DeltaNet(GatedDeltaNet),
}

/// `h' = h1 + FFN(norm(h1))` with `h1 = h + Mixer(norm(h))`.
pub struct DecoderLayer {
    pub attn_norm: Vec<f32>,
    pub mixer: Mixer,
    pub post_attention_norm: Vec<f32>,
    pub ffn: Ffn,
}

impl DecoderLayer {
    pub fn load(
        w: &WeightLoader,
        il: usize,
        kind: LayerKind,
        cfg: &Qwen35Config,
    ) -> Result<Self, ModelError> {
        let e = cfg.n_embd as u64;
        Ok(DecoderLayer {
            attn_norm: w.vector(&format!("blk.{il}.attn_norm.weight"), &[e])?,
            mixer: match kind {
                LayerKind::FullAttention => Mixer::Attention(GatedAttention::load(w, il, cfg)?),
                LayerKind::DeltaNet => Mixer::DeltaNet(GatedDeltaNet::load(w, il, cfg)?),
            },
            post_attention_norm: w.vector(&format!("blk.{il}.post_attention_norm.weight"), &[e])?,
            ffn: Ffn::load(w, il, cfg)?,
        })
    }

    /// Advance `h` (`n × n_embd`, updated in place) through this layer. The rows belong to one
    /// or more sequences, one [`Segment`] each.
    pub fn forward(
        &self,
        h: &mut [f32],
        n: usize,
        segments: &mut [Segment],
        eps: f32,
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        let e = self.attn_norm.len();
        let mut x = vec![0.0f32; n * e];
        for i in 0..n {
            ops::rms_norm(
                &h[i * e..(i + 1) * e],
                &self.attn_norm,
                eps,
                &mut x[i * e..(i + 1) * e],
            );
        }
        let mut a = vec![0.0f32; n * e];
        match &self.mixer {
            Mixer::Attention(m) => m.forward(&x, n, segments, &mut a, pool)?,
            Mixer::DeltaNet(m) => m.forward(&x, n, segments, &mut a, pool)?,
        }
        ops::add_in_place(h, &a);
        for i in 0..n {
            ops::rms_norm(
                &h[i * e..(i + 1) * e],
                &self.post_attention_norm,
                eps,
                &mut x[i * e..(i + 1) * e],
            );
        }
        self.ffn.forward(&x, n, &mut a, pool)?;
        ops::add_in_place(h, &a);
        Ok(())
    }
}

/// One sequence's share of a batch inside a layer: its rows, where they start, its cache.
pub struct Segment<'c> {
    pub rows: std::ops::Range<usize>,
    pub start_pos: usize,
    pub cache: &'c mut LayerCache,
    /// Keep the rows pending (speculative verify) instead of committing them.
    pub verify: bool,
    /// The rotary positions of the rows.
    pub positions: crate::ops::RowPositions,
}

/// One sequence's part of a multi-sequence forward pass.
pub struct BatchItem<'s> {
    pub tokens: &'s [u32],
    pub state: &'s mut SequenceState,
    pub logits: LogitRows,
    /// A speculative verify: rows stay pending until [`Model::commit`].
    pub verify: bool,
}

/// Which rows of a batch need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    None,
    Last,
    All,
}

impl LogitRows {
    /// The first row and the number of rows that need logits among `len` rows.
    pub(crate) fn span(self, len: usize) -> (usize, usize) {
        match self {
            _ if len == 0 => (0, 0),
            LogitRows::None => (0, 0),
            LogitRows::Last => (len - 1, 1),
            LogitRows::All => (0, len),
        }
    }
}

/// The hidden rows (`e` wide) that need logits, copied together for one LM-head product, from
/// parts `(first row, rows, which need logits)` of a batch; and for each part, where its logit
/// rows start in the product and how many there are.
pub(crate) fn gather_logit_rows(
    hidden: &[f32],
    e: usize,
    parts: impl Iterator<Item = (usize, usize, LogitRows)>,
) -> (Vec<f32>, Vec<(usize, usize)>) {
    let mut picked = Vec::new();
    let mut ranges = Vec::new();
    for (start, len, rows) in parts {
        let (first, count) = rows.span(len);
        ranges.push((picked.len() / e.max(1), count));
        picked.extend_from_slice(&hidden[(start + first) * e..(start + first + count) * e]);
    }
    (picked, ranges)
}

/// What a forward pass returns.
#[derive(Clone, Debug)]
pub struct ForwardOutput {
    /// Post-final-norm hidden state of every row (`n × n_embd`): the NextN head's seed.
    pub hidden: Vec<f32>,
    /// Logits of the requested rows (`rows × n_vocab`), in row order.
    pub logits: Vec<f32>,
    pub n_vocab: usize,
}

impl ForwardOutput {
    pub fn logits_row(&self, i: usize) -> &[f32] {
        &self.logits[i * self.n_vocab..(i + 1) * self.n_vocab]
    }
}

pub struct Model {
    pub config: Qwen35Config,
    pub file: Arc<GgufFile>,
    pub token_embd: Linear,
    pub layers: Vec<DecoderLayer>,
    pub output_norm: Vec<f32>,
    /// `output.weight`, or `token_embd` when the file ties them.
    pub lm_head: Linear,
    pub n_vocab: usize,
    /// The trunk's weights on a GPU, when [`Model::offload`] put them there: every pass, commit
    /// and new sequence then runs on the device.
    pub device: Option<Arc<DeviceModel>>,
}

impl Model {
    /// Bind every trunk tensor of a `qwen35` / `qwen35moe` file (NextN tensors are bound by the head).
    pub fn load(file: Arc<GgufFile>) -> Result<Model, ModelError> {
        Self::load_with_progress(file, &mut |_, _| {})
    }

    /// [`Model::load`], calling `progress(done, total)` as layers are bound.
    pub fn load_with_progress(
        file: Arc<GgufFile>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Model, ModelError> {
        let w = WeightLoader::new(file.clone());
        Self::load_from(w, progress)
    }

    /// [`Model::load_with_progress`] for a model that will be offloaded: the matrices stay as
    /// mapped (no host copy in the CPU kernels' layout).
    pub fn load_for_device(
        file: Arc<GgufFile>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Model, ModelError> {
        let w = WeightLoader::mapped_only(file.clone());
        Self::load_from(w, progress)
    }

    fn load_from(
        w: WeightLoader,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Model, ModelError> {
        let file = w.file().clone();
        let valid = crate::validate::validate(&file)?;
        if valid.sidecar {
            return Err(ModelError::SidecarOnly);
        }
        let config = valid.config;
        let e = config.n_embd;
        let embd_info = file
            .tensor("token_embd.weight")
            .ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
        let n_vocab = embd_info.dims.get(1).copied().unwrap_or(0) as usize;
        if n_vocab == 0 {
            return Err(ModelError::TensorShape {
                tensor: "token_embd.weight".into(),
                expected: vec![e as u64, 0],
                found: embd_info.dims.clone(),
            });
        }
        let token_embd = w.embedding("token_embd.weight", n_vocab, e)?;
        let lm_head = match w.optional_linear("output.weight", n_vocab, e)? {
            Some(l) => l,
            // Tied: the same tensor, loaded for products (repacked where the kernels want it).
            None => w.linear("token_embd.weight", n_vocab, e)?,
        };
        let layers = config
            .layer_kinds
            .iter()
            .enumerate()
            .map(|(il, &kind)| {
                let layer = DecoderLayer::load(&w, il, kind, &config);
                progress(il + 1, config.n_layer);
                layer
            })
            .collect::<Result<Vec<_>, _>>()?;
        let output_norm = w.vector("output_norm.weight", &[e as u64])?;
        Ok(Model {
            config,
            file,
            token_embd,
            layers,
            output_norm,
            lm_head,
            n_vocab,
            device: None,
        })
    }

    /// Run the whole trunk on `gpu` from now on (llama.cpp's `-ngl` all layers): every weight is
    /// uploaded (the embedding table stays in host memory), and sequences made after this keep
    /// their caches on the device. A tensor type the device kernels do not read is an error
    /// naming the tensor.
    pub fn offload(&mut self, gpu: Arc<nextn_gpu::Gpu>) -> Result<(), ModelError> {
        self.device = Some(Arc::new(DeviceModel::upload(self, gpu)?));
        Ok(())
    }

    /// Whether a sequence of `n_ctx` positions fits where the model runs: on the device its caches
    /// are allocated once and dropped (host caches grow as they fill, so there it always does).
    pub fn check_sequence(
        &self,
        n_ctx: usize,
        k_type: KvType,
        v_type: KvType,
    ) -> Result<(), ModelError> {
        if let Some(d) = &self.device {
            let caches = d.new_caches(self, n_ctx, k_type, v_type)?;
            d.gpu().check().map_err(crate::device::gpu_err)?;
            drop(caches);
        }
        Ok(())
    }

    /// Fresh caches for one sequence of at most `n_ctx` positions.
    pub fn new_sequence(&self, n_ctx: usize, k_type: KvType, v_type: KvType) -> SequenceState {
        if let Some(d) = &self.device {
            // The sizes were checked when the device was chosen; what fails here is the device.
            let layers = d
                .new_caches(self, n_ctx, k_type, v_type)
                .unwrap_or_else(|e| panic!("allocating a sequence's caches on the device: {e}"));
            return SequenceState {
                layers,
                n_past: 0,
                n_ctx,
                pending_rows: 0,
                images: Vec::new(),
            };
        }
        let cfg = &self.config;
        let layers = self
            .layers
            .iter()
            .enumerate()
            .map(|(il, l)| match &l.mixer {
                Mixer::Attention(_) => LayerCache::Attention(KvLayer::new(
                    k_type,
                    v_type,
                    cfg.n_head_kv[il],
                    cfg.head_dim,
                )),
                Mixer::DeltaNet(d) => LayerCache::DeltaNet(d.new_cache()),
            })
            .collect();
        SequenceState {
            layers,
            n_past: 0,
            n_ctx,
            pending_rows: 0,
            images: Vec::new(),
        }
    }

    /// Embedding rows of `tokens` (`n × n_embd`).
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let e = self.config.n_embd;
        let mut h = vec![0.0f32; tokens.len() * e];
        for (i, &t) in tokens.iter().enumerate() {
            if t as usize >= self.n_vocab {
                return Err(ModelError::TokenOutOfRange {
                    token: t as u64,
                    n_vocab: self.n_vocab,
                });
            }
            self.token_embd
                .dequantize_row(t as usize, &mut h[i * e..(i + 1) * e])?;
        }
        Ok(h)
    }

    /// Run `tokens` at positions `state.n_past..` through the trunk and commit them to `state`.
    /// Decode (1 row), prefill chunks and verify batches (1+k rows) all come through here; every
    /// row's result is independent of the others in its batch.
    pub fn forward(
        &self,
        tokens: &[u32],
        state: &mut SequenceState,
        logit_rows: LogitRows,
        pool: &ThreadPool,
    ) -> Result<ForwardOutput, ModelError> {
        self.run_rows(tokens, state, logit_rows, false, pool)
    }

    /// A speculative verify pass: like [`Model::forward`] with logits for every row, but the rows
    /// stay pending until [`Model::commit`] keeps a prefix of them.
    pub fn forward_verify(
        &self,
        tokens: &[u32],
        state: &mut SequenceState,
        pool: &ThreadPool,
    ) -> Result<ForwardOutput, ModelError> {
        self.run_rows(tokens, state, LogitRows::All, true, pool)
    }

    /// Keep the first `keep` rows of the pending verify batch and roll back the rest: attention KV
    /// is truncated, delta-net states take the buffer of the last row (all kept) or replay the kept
    /// rows (some rejected).
    pub fn commit(&self, state: &mut SequenceState, keep: usize) -> Result<(), ModelError> {
        let pending = state.pending_rows;
        if keep > pending {
            return Err(ModelError::KeepBeyondPending { keep, pending });
        }
        if let Some(d) = &self.device {
            d.commit(state, keep)?;
        } else {
            for (layer, cache) in self.layers.iter().zip(state.layers.iter_mut()) {
                if let (Mixer::DeltaNet(d), LayerCache::DeltaNet(c)) = (&layer.mixer, cache) {
                    d.commit(c, keep)?;
                }
            }
        }
        state.n_past = state.n_past - pending + keep;
        state.truncate_kv(state.n_past);
        state.pending_rows = 0;
        Ok(())
    }

    fn run_rows(
        &self,
        tokens: &[u32],
        state: &mut SequenceState,
        logit_rows: LogitRows,
        verify: bool,
        pool: &ThreadPool,
    ) -> Result<ForwardOutput, ModelError> {
        let mut items = [BatchItem {
            tokens,
            state,
            logits: logit_rows,
            verify,
        }];
        let mut out = self.forward_batch(&mut items, pool)?;
        Ok(out.pop().unwrap_or(ForwardOutput {
            hidden: Vec::new(),
            logits: Vec::new(),
            n_vocab: self.n_vocab,
        }))
    }

    /// One forward pass over the rows of several sequences at once (continuous batching): every
    /// matrix product runs once over all rows; attention and the delta-net recurrence run per
    /// sequence on its own caches. Each row's result is the same as in a pass of its own.
    pub fn forward_batch(
        &self,
        items: &mut [BatchItem],
        pool: &ThreadPool,
    ) -> Result<Vec<ForwardOutput>, ModelError> {
        let e = self.config.n_embd;
        let eps = self.config.rms_eps;
        let mut tokens = Vec::new();
        let mut starts = Vec::with_capacity(items.len());
        for it in items.iter() {
            if it.state.pending_rows > 0 {
                return Err(ModelError::UncommittedVerify {
                    pending: it.state.pending_rows,
                });
            }
            if it.state.layers.len() != self.layers.len() {
                return Err(ModelError::ForeignState {
                    found: it.state.layers.len(),
                    expected: self.layers.len(),
                });
            }
            it.state.check_room(it.tokens.len())?;
            starts.push(tokens.len());
            tokens.extend_from_slice(it.tokens);
        }
        if let Some(d) = &self.device {
            return d.forward_batch(self, items);
        }
        let n = tokens.len();
        let mut h = if n > 0 {
            self.embed(&tokens)?
        } else {
            Vec::new()
        };
        if n > 0 {
            for (il, layer) in self.layers.iter().enumerate() {
                let mut segments: Vec<Segment> = items
                    .iter_mut()
                    .zip(&starts)
                    .filter(|(it, _)| !it.tokens.is_empty())
                    .map(|(it, &s)| Segment {
                        rows: s..s + it.tokens.len(),
                        start_pos: it.state.n_past,
                        positions: crate::ops::RowPositions::Text {
                            shift: it.state.rope_shift(),
                        },
                        cache: &mut it.state.layers[il],
                        verify: it.verify,
                    })
                    .collect();
                layer.forward(&mut h, n, &mut segments, eps, pool)?;
            }
        }
        let mut hidden = vec![0.0f32; n * e];
        for i in 0..n {
            ops::rms_norm(
                &h[i * e..(i + 1) * e],
                &self.output_norm,
                eps,
                &mut hidden[i * e..(i + 1) * e],
            );
        }
        // One LM-head product over every requested row of every sequence.
        let (picked, ranges) = gather_logit_rows(
            &hidden,
            e,
            items
                .iter()
                .zip(&starts)
                .map(|(it, &s)| (s, it.tokens.len(), it.logits)),
        );
        let n_picked = picked.len() / e.max(1);
        let mut logits = vec![0.0f32; n_picked * self.n_vocab];
        if n_picked > 0 {
            self.lm_head.forward(&picked, n_picked, &mut logits, pool)?;
        }
        let mut outs = Vec::with_capacity(items.len());
        for ((it, &s), &(lr, count)) in items.iter_mut().zip(&starts).zip(&ranges) {
            let len = it.tokens.len();
            it.state.n_past += len;
            if it.verify {
                it.state.pending_rows = len;
            }
            outs.push(ForwardOutput {
                hidden: hidden[s * e..(s + len) * e].to_vec(),
                logits: logits[lr * self.n_vocab..(lr + count) * self.n_vocab].to_vec(),
                n_vocab: self.n_vocab,
            });
        }
        Ok(outs)
    }
}
