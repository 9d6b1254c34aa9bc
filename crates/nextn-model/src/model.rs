//! The Qwen3.5 trunk: embedding, decoder layers (docs/MODEL.md, "Decoder layer"), final norm and
//! LM head (docs/MODEL.md, "Final norm and LM head").

use std::sync::Arc;

use nextn_gguf::GgufFile;
use nextn_quant::kernels::ThreadPool;

use crate::attention::GatedAttention;
use crate::batch::{finish_pass, BatchItem, ForwardOutput, LogitRows, Readback, Segment};
use crate::cache::{KvLayer, KvType, LayerCache, SequenceState};
use crate::config::{LayerKind, Qwen35Config};
use crate::delta_net::GatedDeltaNet;
use crate::device::DeviceModel;
use crate::ffn::Ffn;
use crate::ops;
use crate::placement::{Blocks, Placement};
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

    /// Append to each segment's cache the keys and values this layer's attention would append
    /// for its rows of `h` (`n × n_embd`), without running the rest of the layer: the rows'
    /// outputs are not computed. Only an attention layer has them.
    pub fn store_keys_values(
        &self,
        h: &[f32],
        n: usize,
        segments: &mut [Segment],
        eps: f32,
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        let Mixer::Attention(m) = &self.mixer else {
            return Err(ModelError::WrongCacheKind {
                layer: "delta-net",
                found: "attention",
            });
        };
        let e = self.attn_norm.len();
        let mut x = vec![0.0f32; n * e];
        ops::rms_norm_rows(&h[..n * e], &self.attn_norm, eps, &mut x);
        m.store_keys_values(&x, n, segments, pool)
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
        ops::rms_norm_rows(&h[..n * e], &self.attn_norm, eps, &mut x);
        let mut a = vec![0.0f32; n * e];
        match &self.mixer {
            Mixer::Attention(m) => m.forward(&x, n, segments, &mut a, pool)?,
            Mixer::DeltaNet(m) => m.forward(&x, n, segments, &mut a, pool)?,
        }
        ops::add_in_place(h, &a);
        ops::rms_norm_rows(&h[..n * e], &self.post_attention_norm, eps, &mut x);
        self.ffn.forward(&x, n, &mut a, pool)?;
        ops::add_in_place(h, &a);
        Ok(())
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

    /// [`Model::load_with_progress`] for a model split by `placement`: the matrices of the layers
    /// that stay on the CPU are prepared for its kernels, the others left as mapped.
    pub fn load_for_placement(
        file: Arc<GgufFile>,
        placement: Placement,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Model, ModelError> {
        let blocks = crate::validate::validate(&file).map(|v| Blocks::of(&v.config))?;
        let w = WeightLoader::split(file.clone(), move |name| {
            placement.tensor_on_host(name, blocks)
        });
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
        self.offload_placed(gpu, Placement::all_on_device())
    }

    /// Run the trunk's layers from `placement.first_device_layer` on, the final norm and the LM
    /// head on `gpu` (llama.cpp's `-ngl N` below the layer count); the layers before stay on the
    /// CPU, and a pass crosses to the device once, after them.
    pub fn offload_placed(
        &mut self,
        gpu: Arc<nextn_gpu::Gpu>,
        placement: Placement,
    ) -> Result<(), ModelError> {
        self.device = Some(Arc::new(DeviceModel::upload(self, gpu, placement)?));
        Ok(())
    }

    /// Where the model's parts run: `None` on the CPU alone.
    pub fn placement(&self) -> Option<&Placement> {
        self.device.as_ref().map(|d| d.placement())
    }

    /// The trunk layers that run on the CPU: all of them without a device.
    pub(crate) fn host_layers(&self) -> usize {
        self.device
            .as_ref()
            .map_or(self.layers.len(), |d| d.placement().first_device_layer)
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
            let before = d.gpu().memory_budget().1;
            let caches = d.new_caches(self, n_ctx, k_type, v_type)?;
            d.gpu().check().map_err(crate::device::gpu_err)?;
            let bytes = d.gpu().memory_budget().1.saturating_sub(before);
            drop(caches);
            d.note_sequence(crate::device::CheckedSequence {
                n_ctx,
                k_type,
                v_type,
                bytes,
            })?;
        }
        Ok(())
    }

    /// Fresh caches for one sequence of at most `n_ctx` positions. On the device they are
    /// allocated now: a device without room for them (its memory, its budget, its largest buffer)
    /// is [`ModelError::DeviceMemory`] naming what did not fit. Host caches grow as they fill.
    pub fn new_sequence(
        &self,
        n_ctx: usize,
        k_type: KvType,
        v_type: KvType,
    ) -> Result<SequenceState, ModelError> {
        let cfg = &self.config;
        let mut layers: Vec<LayerCache> = self.layers[..self.host_layers()]
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
        if let Some(d) = &self.device {
            layers.extend(d.new_caches(self, n_ctx, k_type, v_type)?);
        }
        Ok(SequenceState {
            layers,
            n_past: 0,
            n_ctx,
            pending_rows: 0,
            images: Vec::new(),
        })
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
        let host = self.host_layers();
        for (layer, cache) in self.layers[..host].iter().zip(state.layers.iter_mut()) {
            if let (Mixer::DeltaNet(d), LayerCache::DeltaNet(c)) = (&layer.mixer, cache) {
                d.commit(c, keep)?;
            }
        }
        if let Some(d) = &self.device {
            d.commit(&mut state.layers[host..], keep, pending)?;
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
            readback: Readback::Logits,
            verify,
        }];
        let mut out = self.forward_batch(&mut items, pool)?;
        Ok(out
            .pop()
            .unwrap_or_else(|| ForwardOutput::empty(self.n_vocab)))
    }

    /// One forward pass over the rows of several sequences at once (continuous batching): every
    /// matrix product runs once over all rows; attention and the delta-net recurrence run per
    /// sequence on its own caches. Each row's result is the same as in a pass of its own.
    pub fn forward_batch(
        &self,
        items: &mut [BatchItem],
        pool: &ThreadPool,
    ) -> Result<Vec<ForwardOutput>, ModelError> {
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
        let host = self.host_layers();
        if let Some(d) = &self.device {
            if host == 0 {
                return d.forward_batch(self, items, None, pool);
            }
        }
        let n = tokens.len();
        let mut h = if n > 0 {
            self.embed(&tokens)?
        } else {
            Vec::new()
        };
        if n > 0 {
            for (il, layer) in self.layers[..host].iter().enumerate() {
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
        if let Some(d) = &self.device {
            // The rest of the pass on the device, from these rows.
            return d.forward_batch(self, items, Some(&h), pool);
        }
        let parts: Vec<_> = items
            .iter()
            .zip(&starts)
            .map(|(it, &s)| (s, it.tokens.len(), it.logits))
            .collect();
        let outs = finish_pass(
            &h,
            &self.output_norm,
            eps,
            &parts,
            self.n_vocab,
            |picked, n_picked| {
                let mut logits = vec![0.0f32; n_picked * self.n_vocab];
                if n_picked > 0 {
                    self.lm_head.forward(picked, n_picked, &mut logits, pool)?;
                }
                Ok(logits)
            },
        )?;
        for it in items.iter_mut() {
            let len = it.tokens.len();
            it.state.n_past += len;
            if it.verify {
                it.state.pending_rows = len;
            }
        }
        Ok(outs)
    }
}
