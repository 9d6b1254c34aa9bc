//! The NextN / MTP head (docs/MODEL.md, "NextN (MTP) head"): one full-attention decoder block
//! that takes the target's post-final-norm hidden state at position p−1 and the embedding of
//! token p, and predicts p+1.
//! It borrows the target's mapped weights (embedding, LM head) unless the file carries its own.

use std::sync::Arc;

use nextn_gguf::GgufFile;
use nextn_quant::kernels::ThreadPool;

use crate::batch::{
    finish_pass, ForwardOutput, HeadBatchItem, HiddenPrev, LogitRows, Readback, Segment,
};
use crate::cache::{KvLayer, KvType, LayerCache};
use crate::config::{LayerKind, Qwen35Config};
use crate::device::DeviceHead;
use crate::draft_vocab::DraftLmHead;
use crate::model::{DecoderLayer, Model};
use crate::ops;
use crate::weights::{Linear, WeightLoader};
use crate::ModelError;

pub struct NextnHead {
    /// Index N of the `blk.N` that holds the head.
    pub(crate) block: usize,
    pub(crate) embed: Linear,
    pub(crate) enorm: Vec<f32>,
    pub(crate) hnorm: Vec<f32>,
    /// `n_embd × 2·n_embd`: input is [normed embedding ‖ normed hidden].
    pub(crate) eh_proj: Linear,
    pub(crate) layer: DecoderLayer,
    pub(crate) shared_head_norm: Vec<f32>,
    /// The full-vocabulary LM head; drafting goes through [`NextnHead::lm_head_logits`], which uses
    /// the trimmed rows when a draft vocabulary is set.
    pub(crate) lm_head: Linear,
    /// The LM head restricted to a draft vocabulary (`--spec-draft-vocab`).
    draft: Option<DraftLmHead>,
    n_embd: usize,
    eps: f32,
    /// Kv heads and their dimension, for the head's own cache.
    pub(crate) kv_heads: (usize, usize),
    /// The head on the device, when the trunk is there.
    device: Option<DeviceHead>,
}

impl NextnHead {
    /// Bind the head from the target's own file.
    pub fn load(model: &Model) -> Result<NextnHead, ModelError> {
        Self::load_from(model, model.file.clone())
    }

    /// Bind the head from `file`, which is the target's file or an MTP-only sidecar (`-md`);
    /// tensors the head does not carry fall back to the target's.
    pub fn load_from(model: &Model, file: Arc<GgufFile>) -> Result<NextnHead, ModelError> {
        let cfg: &Qwen35Config = &model.config;
        if !std::ptr::eq(Arc::as_ptr(&file), Arc::as_ptr(&model.file)) {
            let side = crate::validate::validate(&file)?.config;
            if side.n_embd != cfg.n_embd || side.n_layer != cfg.n_layer || side.arch != cfg.arch {
                return Err(ModelError::BadValue {
                    key: "general.architecture".into(),
                    why: format!(
                        "the MTP file ({} n_embd {}, {} trunk layers) does not match the model ({} n_embd {}, {} layers)",
                        side.arch.name(),
                        side.n_embd,
                        side.n_layer,
                        cfg.arch.name(),
                        cfg.n_embd,
                        cfg.n_layer
                    ),
                });
            }
        }
        let Some(n) = cfg.nextn_block() else {
            return Err(ModelError::NoNextnHead(cfg.arch.name().to_string()));
        };
        // The head's block runs where the placement puts it (llama.cpp's `-ngl` counts it as the
        // block before the output).
        let on_device = model
            .device
            .as_ref()
            .filter(|d| d.placement().head_on_device);
        // On the device the head's tensors stay as mapped, except routed experts the placement
        // puts on the CPU (`--cpu-moe`, `-ot`), which the CPU's kernels read.
        let w = match on_device {
            Some(d) if d.placement().experts_on_host(n) => {
                let (placement, blocks) = (d.placement().clone(), crate::Blocks::of(cfg));
                WeightLoader::split(file, move |name| placement.tensor_on_host(name, blocks))
            }
            Some(_) => WeightLoader::mapped_only(file),
            None => WeightLoader::new(file),
        };
        let e = cfg.n_embd;
        let p = |x: &str| format!("blk.{n}.nextn.{x}");
        let embed = match w.optional_embedding(&p("embed_tokens.weight"), model.n_vocab, e)? {
            Some(l) => l,
            None => model.token_embd.clone(),
        };
        let own_lm_head = w.optional_linear(&p("shared_head_head.weight"), model.n_vocab, e)?;
        let lm_head_shared = own_lm_head.is_none();
        let lm_head = own_lm_head.unwrap_or_else(|| model.lm_head.clone());
        let shared_head_norm =
            match w.optional_vector(&p("shared_head_norm.weight"), &[e as u64])? {
                Some(v) => v,
                None => model.output_norm.clone(),
            };
        let mut head = NextnHead {
            block: n,
            embed,
            enorm: w.vector(&p("enorm.weight"), &[e as u64])?,
            hnorm: w.vector(&p("hnorm.weight"), &[e as u64])?,
            eh_proj: w.linear(&p("eh_proj.weight"), e, 2 * e)?,
            layer: DecoderLayer::load(&w, n, LayerKind::FullAttention, cfg)?,
            shared_head_norm,
            lm_head,
            draft: None,
            n_embd: e,
            eps: cfg.rms_eps,
            kv_heads: (cfg.n_head_kv[n], cfg.head_dim),
            device: None,
        };
        if let Some(d) = on_device {
            head.device = Some(DeviceHead::upload(d, &head, cfg, lm_head_shared)?);
        }
        Ok(head)
    }

    /// The embedding rows of `tokens` from the head's table (`n × n_embd`).
    pub(crate) fn embed_rows(&self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let e = self.n_embd;
        let mut out = vec![0.0f32; tokens.len() * e];
        for (&t, row) in tokens.iter().zip(out.chunks_exact_mut(e)) {
            if t as usize >= self.embed.rows {
                return Err(ModelError::TokenOutOfRange {
                    token: t as u64,
                    n_vocab: self.embed.rows,
                });
            }
            self.embed.dequantize_row(t as usize, row)?;
        }
        Ok(out)
    }

    /// On the device: whether greedy drafts stay there until the verify pass (one submission a
    /// step), or come back to the host after each draft because the device had no room for the
    /// embedding table. `None` on the CPU.
    pub fn device_drafts_stay(&self) -> Option<bool> {
        self.device.as_ref().map(|d| d.drafts_stay())
    }

    /// Device memory of the head's own weights, when it runs on the device.
    pub fn device_weight_bytes(&self) -> Option<u64> {
        self.device.as_ref().map(|d| d.weight_bytes())
    }

    /// Restrict drafting to the token ids in `ids` (any order; duplicates ignored): the LM head
    /// computes only those rows, and logits elsewhere are −∞. The target still verifies over the
    /// whole vocabulary, so speculative output is unchanged; only acceptance can drop.
    pub fn restrict_vocab(&mut self, ids: &[u32]) -> Result<(), ModelError> {
        self.draft = Some(DraftLmHead::new(&self.lm_head, ids)?);
        if let Some(d) = &mut self.device {
            d.set_draft_vocab(self.draft.as_ref())?;
        }
        Ok(())
    }

    /// Draft over the full vocabulary again.
    pub fn clear_draft_vocab(&mut self) {
        self.draft = None;
        if let Some(d) = &mut self.device {
            // Dropping the trimmed matrix cannot fail.
            let _ = d.set_draft_vocab(None);
        }
    }

    /// The trimmed LM head, when a draft vocabulary is set.
    pub fn draft_vocab(&self) -> Option<&DraftLmHead> {
        self.draft.as_ref()
    }

    /// Tokens the head can draft: the draft vocabulary's size, else the full vocabulary.
    pub fn draft_vocab_size(&self) -> usize {
        self.draft
            .as_ref()
            .map_or(self.lm_head.rows, DraftLmHead::len)
    }

    /// Size of the full vocabulary (the width of every logits row the head returns).
    pub fn n_vocab(&self) -> usize {
        self.lm_head.rows
    }

    /// Logits of `n` post-norm hidden rows, `n × n_vocab`: through the trimmed LM head (−∞ outside
    /// the draft vocabulary) when one is set, else the full one. Batched callers use this too.
    pub fn lm_head_logits(
        &self,
        hidden: &[f32],
        n: usize,
        pool: &ThreadPool,
    ) -> Result<Vec<f32>, ModelError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        match &self.draft {
            Some(d) => d.forward(hidden, n, pool),
            None => {
                let mut logits = vec![0.0f32; n * self.lm_head.rows];
                self.lm_head.forward(hidden, n, &mut logits, pool)?;
                Ok(logits)
            }
        }
    }

    /// Drop the head's cache entries at positions `>= pos`.
    pub fn truncate(cache: &mut LayerCache, pos: usize) {
        cache.truncate_attention(pos);
    }

    /// The head's own single-layer KV cache for a sequence of at most `n_ctx` positions (on the
    /// device when the head runs there, allocated now: no room there is
    /// [`ModelError::DeviceMemory`]).
    pub fn new_cache(
        &self,
        k_type: KvType,
        v_type: KvType,
        n_ctx: usize,
    ) -> Result<LayerCache, ModelError> {
        let (n_heads, head_dim) = self.kv_heads;
        if let Some(d) = &self.device {
            return d.new_cache(k_type, v_type, n_ctx, self.kv_heads);
        }
        Ok(LayerCache::Attention(KvLayer::new(
            k_type, v_type, n_heads, head_dim,
        )))
    }

    /// Index N of the `blk.N` that holds the head.
    pub fn block(&self) -> usize {
        self.block
    }

    /// The head's decoder block (a full-attention layer with its own FFN).
    pub fn layer(&self) -> &DecoderLayer {
        &self.layer
    }

    /// Rows `(tokens[i] at position start_pos+i, hidden_prev[i] = H at the position before)`,
    /// appended to `cache`. Returns the head's post-norm output of the rows asked for by
    /// `logits` (its `hidden`, which seeds the next chained draft) and their logits; the other
    /// rows only leave their keys and values (see [`NextnHead::forward_batch`]).
    pub fn forward(
        &self,
        tokens: &[u32],
        hidden_prev: &[f32],
        start_pos: usize,
        cache: &mut LayerCache,
        logits: LogitRows,
        pool: &ThreadPool,
    ) -> Result<ForwardOutput, ModelError> {
        let mut items = [HeadBatchItem {
            tokens,
            hidden_prev: HiddenPrev::Host(hidden_prev),
            start_pos,
            rope_shift: 0,
            cache,
            logits,
            readback: Readback::Logits,
        }];
        let mut out = self.forward_batch(&mut items, pool)?;
        Ok(out
            .pop()
            .unwrap_or_else(|| ForwardOutput::empty(self.n_vocab())))
    }

    /// The head over the rows of several sequences in one pass: one `eh_proj` product, the keys
    /// and values of every row into its sequence's head cache, one pass of the decoder block
    /// (attention per sequence) over the rows whose logits are asked for, and one LM-head
    /// product for those. Each row's result equals a pass over its sequence alone, because every
    /// matrix product treats rows independently and attention computes each row alone. One
    /// output per item, in order, whose `hidden` holds the rows `logits` asks for (none, the
    /// last, or all).
    pub fn forward_batch(
        &self,
        items: &mut [HeadBatchItem],
        pool: &ThreadPool,
    ) -> Result<Vec<ForwardOutput>, ModelError> {
        if let Some(d) = &self.device {
            return d.forward_batch(self, items, pool);
        }
        let e = self.n_embd;
        let n_vocab = self.n_vocab();
        let n: usize = items.iter().map(|it| it.tokens.len()).sum();
        let mut cat = vec![0.0f32; n * 2 * e];
        let mut starts = Vec::with_capacity(items.len());
        let mut at = 0;
        for it in items.iter() {
            let HiddenPrev::Host(hidden_prev) = it.hidden_prev else {
                return Err(ModelError::Device(
                    "hidden rows left on the device went to the head on the CPU".into(),
                ));
            };
            if hidden_prev.len() != it.tokens.len() * e {
                return Err(ModelError::HiddenLength {
                    found: hidden_prev.len(),
                    rows: it.tokens.len(),
                    width: e,
                });
            }
            starts.push(at);
            let rows = self.embed_rows(it.tokens)?;
            for (i, row) in rows.chunks_exact(e).enumerate() {
                let dst = &mut cat[(at + i) * 2 * e..(at + i + 1) * 2 * e];
                ops::rms_norm(row, &self.enorm, self.eps, &mut dst[..e]);
                ops::rms_norm(
                    &hidden_prev[i * e..(i + 1) * e],
                    &self.hnorm,
                    self.eps,
                    &mut dst[e..],
                );
            }
            at += it.tokens.len();
        }
        let mut h = vec![0.0f32; n * e];
        if n > 0 {
            self.eh_proj.forward(&cat, n, &mut h, pool)?;
        }
        // The head is one block: a row's output feeds only its own logits and the draft chain,
        // so only the rows whose logits are asked for run the whole block. The others (a
        // prompt's rows, the lag before the row a draft comes from) only leave their keys and
        // values in the head's cache, as the whole block would, for later rows to attend to:
        // no attention over the context and no FFN for them.
        let outputs: Vec<usize> = items
            .iter()
            .map(|it| output_rows(it.logits, it.tokens.len()))
            .collect();
        let gather = |rows: &dyn Fn(usize, usize, usize) -> std::ops::Range<usize>| {
            let mut picked = Vec::new();
            let mut at = Vec::with_capacity(items.len());
            for ((it, &s), &o) in items.iter().zip(&starts).zip(&outputs) {
                at.push(picked.len() / e.max(1));
                let r = rows(s, it.tokens.len(), o);
                picked.extend_from_slice(&h[r.start * e..r.end * e]);
            }
            (picked, at)
        };
        let (kv_rows, kv_at) = gather(&|s, len, o| s..s + len - o);
        let (mut out_rows, out_at) = gather(&|s, len, o| s + len - o..s + len);
        let n_kv = kv_rows.len() / e.max(1);
        if n_kv > 0 {
            let mut segments: Vec<Segment> = items
                .iter_mut()
                .zip(&kv_at)
                .zip(&outputs)
                .filter(|((it, _), &o)| it.tokens.len() > o)
                .map(|((it, &s), &o)| Segment {
                    rows: s..s + it.tokens.len() - o,
                    start_pos: it.start_pos,
                    cache: &mut *it.cache,
                    verify: false,
                    positions: crate::ops::RowPositions::Text {
                        shift: it.rope_shift,
                    },
                })
                .collect();
            self.layer
                .store_keys_values(&kv_rows, n_kv, &mut segments, self.eps, pool)?;
        }
        let n_out = out_rows.len() / e.max(1);
        if n_out > 0 {
            let mut segments: Vec<Segment> = items
                .iter_mut()
                .zip(&out_at)
                .zip(&outputs)
                .filter(|(_, &o)| o > 0)
                .map(|((it, &s), &o)| Segment {
                    rows: s..s + o,
                    start_pos: it.start_pos + it.tokens.len() - o,
                    cache: &mut *it.cache,
                    verify: false,
                    positions: crate::ops::RowPositions::Text {
                        shift: it.rope_shift,
                    },
                })
                .collect();
            self.layer
                .forward(&mut out_rows, n_out, &mut segments, self.eps, pool)?;
        }
        let parts: Vec<_> = items
            .iter()
            .zip(&out_at)
            .zip(&outputs)
            .map(|((it, &s), &o)| (s, o, it.logits))
            .collect();
        finish_pass(
            &out_rows,
            &self.shared_head_norm,
            self.eps,
            &parts,
            n_vocab,
            |picked, n_picked| self.lm_head_logits(picked, n_picked, pool),
        )
    }

    /// The head over one image's rows, appended to `cache` at cache rows `start_pos..`: row `i`
    /// pairs image embedding `embd[i]` (in place of a token embedding, as llama.cpp's MTP graph
    /// takes a batch of embeddings) with `hidden_prev[i]`, the target's hidden state of the row
    /// before, at the image's M-RoPE position (rotary position `p0`, an `nx`-wide grid) as the
    /// trunk ran it. Only the rows' keys and values are computed: no later pass reads an image
    /// row's output.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_image(
        &self,
        embd: &[f32],
        hidden_prev: &[f32],
        nx: usize,
        start_pos: usize,
        p0: usize,
        cache: &mut LayerCache,
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        let e = self.n_embd;
        let n = hidden_prev.len() / e;
        if hidden_prev.len() != n * e
            || embd.len() != n * e
            || n == 0
            || nx == 0
            || !n.is_multiple_of(nx)
        {
            return Err(ModelError::ImageShape {
                found: embd.len(),
                nx,
                ny: n / nx.max(1),
                n_embd: e,
            });
        }
        if let Some(d) = &self.device {
            let item = HeadBatchItem {
                tokens: &[],
                hidden_prev: HiddenPrev::Host(hidden_prev),
                start_pos,
                rope_shift: start_pos.saturating_sub(p0),
                cache,
                logits: LogitRows::None,
                readback: Readback::Logits,
            };
            return d.forward_image(self, item, embd, nx, p0, pool);
        }
        let mut cat = vec![0.0f32; n * 2 * e];
        for (i, dst) in cat.chunks_exact_mut(2 * e).enumerate() {
            ops::rms_norm(
                &embd[i * e..(i + 1) * e],
                &self.enorm,
                self.eps,
                &mut dst[..e],
            );
            ops::rms_norm(
                &hidden_prev[i * e..(i + 1) * e],
                &self.hnorm,
                self.eps,
                &mut dst[e..],
            );
        }
        let mut h = vec![0.0f32; n * e];
        self.eh_proj.forward(&cat, n, &mut h, pool)?;
        let mut segments = [Segment {
            rows: 0..n,
            start_pos,
            cache,
            verify: false,
            positions: crate::ops::RowPositions::Image { p0, nx },
        }];
        // No image row's output is read (see `forward_batch`): only its keys and values.
        self.layer
            .store_keys_values(&h, n, &mut segments, self.eps, pool)
    }
}

/// How many of an item's `len` rows run the whole block: those whose logits are asked for.
fn output_rows(logits: LogitRows, len: usize) -> usize {
    match logits {
        LogitRows::None => 0,
        LogitRows::Last => len.min(1),
        LogitRows::All => len,
    }
}
