//! The NextN head on the device: `[RMSNorm(embed(x_p); enorm) ‖ RMSNorm(H_{p−1}; hnorm)]`,
//! `eh_proj`, one full-attention decoder block on its own KV cache, the shared head norm and the
//! LM head (the trimmed one when a draft vocabulary is set). The LM head is the trunk's own
//! device matrix when the file ties them, so the 248k-row matrix is on the device once.

use std::sync::{Arc, Mutex};

use std::sync::atomic::{AtomicU64, Ordering};

use nextn_gpu::kernels::matvec::embed_rows;
use nextn_gpu::kernels::norm::norm_quant;
use nextn_gpu::{Gpu, Recorder};
use nextn_quant::kernels::ThreadPool;

use super::layer::Needs;
use super::layer::{DeviceLayer, HostExperts, PassBuffers};
use super::{
    gpu_err, grow, grow_quant, locked, record_tail, rows_read_back, u, vector, Drafted, Mat,
    PassIo, TailOut,
};
use crate::batch::{
    is_device_token, DeviceRows, ForwardOutput, HeadBatchItem, HiddenPrev, LogitRows, Readback,
    RowTop1, Segment, DEVICE_TOKEN, DEVICE_TOKENS,
};
use crate::cache::{KvType, LayerCache};
use crate::config::Qwen35Config;
use crate::draft_vocab::DraftLmHead;
use crate::ffn::Ffn;
use crate::nextn::NextnHead;
use crate::ops::RowPositions;
use crate::ModelError;

pub(crate) struct DeviceHead {
    gpu: Arc<Gpu>,
    counters: Arc<super::Counters>,
    /// enorm then hnorm.
    norms: wgpu::Buffer,
    eh_proj: Mat,
    layer: DeviceLayer,
    shared_head_norm: wgpu::Buffer,
    lm_head: Arc<Mat>,
    lm_head_shared: bool,
    /// The trimmed LM head of a draft vocabulary.
    draft: Option<Mat>,
    config: Qwen35Config,
    /// The activations, shared with the trunk's passes.
    pass: Arc<Mutex<PassBuffers>>,
    io: Mutex<PassIo>,
    /// The head's embedding table on the device (the trunk's when they are one tensor), unless
    /// the device had no room for it: then the host gathers the rows and uploads them.
    embed: Option<Arc<Mat>>,
    /// Whether greedy drafts may stay on the device ([`DeviceHead::forward_batch`]).
    drafts_stay: bool,
    /// The drafted tokens left on the device, shared with the trunk.
    drafted: Arc<Mutex<Drafted>>,
    /// Passes so far: the number of the last, whose hidden rows the next pass may take.
    passes: AtomicU64,
    /// Device memory of the embedding table when the head uploaded it.
    embed_bytes: u64,
    /// The block's routed experts run on the CPU (`--cpu-moe`, `-ot`).
    experts_on_host: bool,
}

impl DeviceHead {
    /// Upload `head`'s weights beside the trunk's; the trunk's LM head is reused when the head's
    /// is the trunk's (`lm_head_shared`), and so is its embedding table when the head's is the
    /// same tensor (made resident on the device if the trunk had it on the host only).
    pub(crate) fn upload(
        trunk: &super::DeviceModel,
        head: &NextnHead,
        cfg: &Qwen35Config,
        lm_head_shared: bool,
    ) -> Result<DeviceHead, ModelError> {
        let gpu = trunk.gpu.clone();
        let trunk_lm_head = lm_head_shared.then(|| trunk.lm_head());
        // The table leaves room for the largest sequence checked so far, with the head's cache.
        let keep_free = match trunk.checked_sequence()? {
            Some(seq) => {
                let used = gpu.memory_budget().1;
                let cache = super::DeviceKvCache::new(
                    &gpu,
                    seq.k_type,
                    seq.v_type,
                    head.kv_heads.0,
                    head.kv_heads.1,
                    seq.n_ctx,
                )?;
                let head_bytes = gpu.memory_budget().1.saturating_sub(used);
                drop(cache);
                seq.bytes + head_bytes
            }
            None => 0,
        };
        // The head's own weights first: the embedding table takes only the room they leave.
        let lm_head = match trunk_lm_head {
            Some(m) => m,
            None => Arc::new(Mat::upload(&gpu, &head.lm_head)?),
        };
        let norms = vector(
            &gpu,
            "nextn.enorm + nextn.hnorm",
            &[head.enorm.as_slice(), head.hnorm.as_slice()].concat(),
        )?;
        let eh_proj = Mat::upload(&gpu, &head.eh_proj)?;
        let experts_on_host = trunk.placement().experts_on_host(head.block);
        let layer = DeviceLayer::upload(&gpu, &head.layer, cfg, experts_on_host)?;
        let shared_head_norm = vector(&gpu, "nextn.shared_head_norm", &head.shared_head_norm)?;
        // The table pays only when the drafts can stay: when the verifying trunk gathers its
        // embeddings on the device too (its first layer there).
        let (embed, embed_bytes) = if trunk.placement().first_device_layer > 0 {
            (None, 0)
        } else {
            match trunk.embeddings(&head.embed, keep_free)? {
                Some((m, bytes)) => (Some(m), bytes),
                None => (None, 0),
            }
        };
        // Drafts stay on the device only when both the head and the verifying trunk can
        // gather their embeddings there.
        let drafts_stay = embed.is_some() && trunk.gathers_embeddings()?;
        let d = DeviceHead {
            norms,
            eh_proj,
            layer,
            shared_head_norm,
            lm_head,
            lm_head_shared,
            draft: None,
            config: cfg.clone(),
            gpu,
            counters: trunk.counters.clone(),
            pass: trunk.pass.clone(),
            io: Mutex::new(PassIo::default()),
            embed,
            drafts_stay,
            drafted: trunk.drafted.clone(),
            passes: AtomicU64::new(0),
            embed_bytes,
            experts_on_host,
        };
        d.gpu.check().map_err(gpu_err)?;
        let mut kernels = Vec::new();
        d.eh_proj.kernels(&mut kernels);
        d.layer.kernels(&mut kernels);
        d.lm_head.kernels(&mut kernels);
        if let Some(m) = &d.embed {
            m.embed_kernels(&mut kernels);
        }
        d.gpu.prepare(&kernels).map_err(gpu_err)?;
        Ok(d)
    }

    /// Whether greedy drafts stay on the device between the head's passes and the verify pass
    /// (false when the device had no room for the embedding table).
    pub(crate) fn drafts_stay(&self) -> bool {
        self.drafts_stay
    }

    /// Device memory of the head's own weights (an LM head shared with the trunk not counted;
    /// the embedding table when it had to be put on the device for the head).
    pub(crate) fn weight_bytes(&self) -> u64 {
        self.embed_bytes
            + self.eh_proj.device_bytes()
            + self.layer.device_bytes()
            + if self.lm_head_shared {
                0
            } else {
                self.lm_head.device_bytes()
            }
            + self.draft.as_ref().map_or(0, Mat::device_bytes)
    }

    pub(crate) fn set_draft_vocab(&mut self, d: Option<&DraftLmHead>) -> Result<(), ModelError> {
        self.draft = match d {
            None => None,
            Some(d) => {
                let (ty, rows, cols, bytes, scale) = d.kept_matrix();
                let rb = ty.row_bytes(cols as u64).unwrap_or(0) as usize;
                let bytes = bytes.get(..rows * rb).ok_or_else(|| {
                    ModelError::Device(
                        "the draft vocabulary's rows are shorter than its ids".into(),
                    )
                })?;
                let m = Mat::from_parts(
                    &self.gpu,
                    "nextn.draft_lm_head",
                    ty,
                    rows,
                    cols,
                    bytes,
                    scale,
                )?;
                let mut kernels = Vec::new();
                m.kernels(&mut kernels);
                self.gpu.prepare(&kernels).map_err(gpu_err)?;
                Some(m)
            }
        };
        Ok(())
    }

    pub(crate) fn new_cache(
        &self,
        k_type: KvType,
        v_type: KvType,
        n_ctx: usize,
        kv_heads: (usize, usize),
    ) -> Result<LayerCache, ModelError> {
        Ok(LayerCache::DeviceAttention(super::DeviceKvCache::new(
            &self.gpu, k_type, v_type, kv_heads.0, kv_heads.1, n_ctx,
        )?))
    }

    /// [`NextnHead::forward_batch`] on the device. The rows' embeddings are gathered on the
    /// device (drafted tokens among them) and hidden rows the head's previous pass left there are
    /// copied on the device. When every row that needs logits is a greedy draft (its top-1 is
    /// all that is asked) and the drafted tokens have room, nothing is read back: the pass is
    /// recorded to run with the next submission, its drafts stand as [`DEVICE_TOKEN`] ids and its
    /// hidden rows stay on the device ([`ForwardOutput::device_hidden`]), so a chain of drafts
    /// and the target pass that verifies them are one submission and one wait.
    pub(crate) fn forward_batch(
        &self,
        head: &NextnHead,
        items: &mut [HeadBatchItem],
        pool: &ThreadPool,
    ) -> Result<Vec<ForwardOutput>, ModelError> {
        self.run_pass(head, items, None, pool)
    }

    /// [`NextnHead::forward_image`] on the device: `item` (no tokens, its `hidden_prev` the
    /// target's rows before the image's) with the image's embeddings `embd` in place of token
    /// embeddings, at the image's positions (rotary `p0`, `nx` wide). Only the keys and values
    /// matter; the pass runs with the next submission.
    pub(crate) fn forward_image(
        &self,
        head: &NextnHead,
        item: HeadBatchItem,
        embd: &[f32],
        nx: usize,
        p0: usize,
        pool: &ThreadPool,
    ) -> Result<(), ModelError> {
        let at = RowPositions::Image { p0, nx };
        self.run_pass(head, &mut [item], Some((embd, at)), pool)
            .map(drop)
    }

    /// One head pass over `items`' tokens, or over the host's embeddings of one image's rows
    /// at the positions given with them.
    fn run_pass(
        &self,
        head: &NextnHead,
        items: &mut [HeadBatchItem],
        image: Option<(&[f32], RowPositions)>,
        pool: &ThreadPool,
    ) -> Result<Vec<ForwardOutput>, ModelError> {
        let gpu = &*self.gpu;
        let e = self.config.n_embd;
        let eps = self.config.rms_eps;
        let n_vocab = head.n_vocab();
        let mut lens: Vec<usize> = items.iter().map(|it| it.tokens.len()).collect();
        if let Some((embd, _)) = image {
            if items.len() != 1 || !items[0].tokens.is_empty() {
                return Err(ModelError::Device(
                    "an image's rows go through the head for one sequence, without tokens".into(),
                ));
            }
            lens[0] = embd.len() / e.max(1);
        }
        let n: usize = lens.iter().sum();
        if n == 0 {
            return Ok(items
                .iter()
                .map(|_| ForwardOutput::empty(n_vocab))
                .collect());
        }
        let mut starts = Vec::with_capacity(items.len());
        let mut tokens = Vec::with_capacity(n);
        for it in items.iter() {
            starts.push(tokens.len());
            for &t in it.tokens {
                if !is_device_token(t) && t as usize >= n_vocab {
                    return Err(ModelError::TokenOutOfRange {
                        token: t as u64,
                        n_vocab,
                    });
                }
            }
            tokens.extend_from_slice(it.tokens);
        }
        let mut io = locked(&self.io)?;
        let mut pass = locked(&self.pass)?;
        let mut drafted = locked(&self.drafted)?;
        let this_pass = self.passes.fetch_add(1, Ordering::Relaxed) + 1;
        // The hidden rows of the head's last pass, which a chained draft pairs with its token.
        let previous = io.hidden.clone();
        pass.reserve(n)?;
        // [embedding rows (n × e) | previous hidden rows (n × e)], normed half by half.
        let raw = grow(gpu, &mut io.raw, "nextn-in", n * 2 * e)?;
        let cat = grow(gpu, &mut io.cat, "nextn-cat", n * 2 * e)?;
        let h = grow(gpu, &mut io.h, "nextn-h", n * e)?;
        let ids = grow(gpu, &mut io.ids, "nextn token ids", n)?;
        let mut rec = Recorder::new(gpu);
        match (&self.embed, image) {
            (_, Some((embd, _))) => rec.upload(&raw, 0, bytemuck::cast_slice(embd)),
            (Some(table), None) => {
                rec.upload(&ids, 0, bytemuck::cast_slice(&tokens));
                embed_rows(
                    &mut rec,
                    &table.m,
                    &ids,
                    0,
                    &drafted.buf,
                    u(n)?,
                    &raw,
                    0,
                    u(e)?,
                )
                .map_err(gpu_err)?;
            }
            (None, None) => rec.upload(&raw, 0, bytemuck::cast_slice(&head.embed_rows(&tokens)?)),
        }
        for ((it, &s), &rows) in items.iter().zip(&starts).zip(&lens) {
            let at = ((n + s) * e * 4) as u64;
            match it.hidden_prev {
                HiddenPrev::Host(hidden) => {
                    if hidden.len() != rows * e {
                        return Err(ModelError::HiddenLength {
                            found: hidden.len(),
                            rows,
                            width: e,
                        });
                    }
                    rec.upload(&raw, at, bytemuck::cast_slice(hidden));
                }
                HiddenPrev::Device(d) => {
                    let prev = previous.as_ref().filter(|_| d.pass + 1 == this_pass);
                    let Some(prev) = prev.filter(|_| d.count == rows) else {
                        return Err(ModelError::Device(format!(
                            "hidden rows of head pass {} given to head pass {this_pass} for {rows} rows",
                            d.pass
                        )));
                    };
                    rec.copy(
                        prev,
                        (d.first * e * 4) as u64,
                        &raw,
                        at,
                        (rows * e * 4) as u64,
                    );
                }
            }
        }
        let (nu, eu, e2) = (u(n)?, u(e)?, u(2 * e)?);
        // Both halves normed on their own in one dispatch, quantized for eh_proj there when its
        // blocks fit in a half (as the CPU quantizes the whole row: no block crosses the halves);
        // otherwise eh_proj quantizes the whole normed rows itself.
        let needs = Needs::of(&self.eh_proj.m).in_parts_of(e);
        let cat_q = grow_quant(gpu, &mut io.cat_q, "nextn-cat", n, 2 * e)?;
        norm_quant(
            &mut rec,
            &raw,
            0,
            eu,
            u(n * e)?,
            nu,
            2,
            eu,
            &self.norms,
            0,
            eu,
            &cat_q.norm_out(&cat, e2, needs),
            eps,
        )
        .map_err(gpu_err)?;
        let acts = cat_q.acts(&cat, e2, needs);
        self.eh_proj.forward(&mut rec, &acts, n, &h, 0, e, false)?;
        let mut segments: Vec<Segment> = items
            .iter_mut()
            .zip(starts.iter().zip(&lens))
            .filter(|(_, (_, &len))| len > 0)
            .map(|(it, (&s, &len))| Segment {
                rows: s..s + len,
                start_pos: it.start_pos,
                positions: match image {
                    Some((_, at)) => at,
                    None => RowPositions::Text {
                        shift: it.rope_shift,
                    },
                },
                cache: &mut *it.cache,
                verify: false,
            })
            .collect();
        // Routed experts in host memory are computed there, as the trunk's.
        let host = match &head.layer.ffn {
            Ffn::Moe(ffn) if self.experts_on_host => Some(HostExperts {
                ffn,
                pool,
                counters: &self.counters,
            }),
            _ => None,
        };
        self.layer
            .forward(&mut rec, &h, n, &mut segments, &mut pass, host)?;
        drop(segments);
        drop(pass);
        let lm = self.draft.as_ref().unwrap_or(&self.lm_head);
        let width = lm.rows();
        let parts = || {
            items
                .iter()
                .zip(starts.iter().zip(&lens))
                .map(|(it, (&s, &len))| (s, len, it.logits))
        };
        let logit_rows: usize = items
            .iter()
            .zip(&lens)
            .map(|(it, &len)| it.logits.span(len).1)
            .sum();
        // A trimmed LM head's top-1 is an index into its own rows, which the host maps to ids.
        let defer = self.drafts_stay
            && self.draft.is_none()
            && items
                .iter()
                .all(|it| it.logits == LogitRows::None || it.readback == Readback::Top1)
            && drafted.next as usize + logit_rows <= DEVICE_TOKENS as usize;
        if defer {
            let at = drafted.next;
            let (_, ranges) = record_tail(
                &mut rec,
                &mut io,
                &h,
                n,
                e,
                &self.shared_head_norm,
                eps,
                lm,
                parts(),
                TailOut::Drafts {
                    buf: &drafted.buf,
                    at,
                },
            )?;
            drafted.next += u(logit_rows)?;
            self.counters.defer(rec)?;
            return Ok(items
                .iter()
                .zip(starts.iter().zip(&lens))
                .zip(&ranges)
                .map(|((_, (&s, &len)), &(first, count))| ForwardOutput {
                    hidden: Vec::new(),
                    device_hidden: Some(DeviceRows {
                        pass: this_pass,
                        first: s,
                        count: len,
                    }),
                    tokens: Vec::new(),
                    logits: Vec::new(),
                    n_vocab,
                    // The drafts stand for themselves until the target pass reads them; their
                    // logits are not known, so nothing here stops a chain.
                    top1: (first..first + count)
                        .map(|k| RowTop1 {
                            id: Some(DEVICE_TOKEN + at + k as u32),
                            logit: f32::INFINITY,
                        })
                        .collect(),
                })
                .collect());
        }
        drop(drafted);
        let readbacks: Vec<Readback> = items.iter().map(|it| it.readback).collect();
        let (tail, _) = record_tail(
            &mut rec,
            &mut io,
            &h,
            n,
            e,
            &self.shared_head_norm,
            eps,
            lm,
            parts(),
            TailOut::ReadBack(&readbacks),
        )?;
        let tail = tail.ok_or_else(|| ModelError::Device("no read-back recorded".into()))?;
        let mut back = self.counters.submit_read(rec, false)?;
        let hidden_host = back.f32s(tail.hidden);
        // A trimmed LM head's rows and top-1 are in its own ids; the sampler sees the full
        // vocabulary. Its ids ascend, so the lowest trimmed index among equal logits is the
        // lowest token id too.
        let trimmed = self.draft.as_ref().and(head.draft_vocab());
        let logits = rows_read_back(&mut back, tail.rows, &tail.ranges, trimmed);
        let mut top1 = tail.top1.read(&mut back);
        self.counters
            .read_back(super::read_bytes(n * e, &tail.ranges, &readbacks, width));
        if let Some(d) = trimmed {
            for t in top1.iter_mut().flatten() {
                t.id = t.id.and_then(|i| d.ids().get(i as usize).copied());
            }
        }
        Ok(items
            .iter()
            .zip(starts.iter().zip(&lens))
            .zip(logits.into_iter().zip(top1))
            .map(|((_, (&s, &len)), (logits, top1))| ForwardOutput {
                hidden: hidden_host[s * e..(s + len) * e].to_vec(),
                device_hidden: None,
                tokens: Vec::new(),
                logits,
                n_vocab,
                top1,
            })
            .collect())
    }
}
