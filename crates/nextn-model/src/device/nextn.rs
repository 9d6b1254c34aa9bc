//! The NextN head on the device: `[RMSNorm(embed(x_p); enorm) ‖ RMSNorm(H_{p−1}; hnorm)]`,
//! `eh_proj`, one full-attention decoder block on its own KV cache, the shared head norm and the
//! LM head (the trimmed one when a draft vocabulary is set). The LM head is the trunk's own
//! device matrix when the file ties them, so the 248k-row matrix is on the device once.

use std::sync::{Arc, Mutex};

use nextn_gpu::kernels::norm::norm_quant;
use nextn_gpu::{Gpu, Recorder};

use super::layer::Needs;
use super::layer::{DeviceLayer, PassBuffers};
use super::{
    gpu_err, grow, grow_quant, locked, record_tail, rows_read_back, u, vector, Mat, PassIo,
};
use crate::batch::{ForwardOutput, HeadBatchItem, Readback, Segment};
use crate::cache::{KvType, LayerCache};
use crate::config::Qwen35Config;
use crate::draft_vocab::DraftLmHead;
use crate::nextn::NextnHead;
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
}

impl DeviceHead {
    /// Upload `head`'s weights; `trunk_lm_head` is reused when the head's LM head is the trunk's.
    pub(crate) fn upload(
        gpu: Arc<Gpu>,
        head: &NextnHead,
        cfg: &Qwen35Config,
        trunk_lm_head: Option<Arc<Mat>>,
        counters: Arc<super::Counters>,
        pass: Arc<Mutex<PassBuffers>>,
    ) -> Result<DeviceHead, ModelError> {
        let lm_head_shared = trunk_lm_head.is_some();
        let lm_head = match trunk_lm_head {
            Some(m) => m,
            None => Arc::new(Mat::upload(&gpu, &head.lm_head)?),
        };
        let d = DeviceHead {
            norms: vector(
                &gpu,
                "nextn.enorm + nextn.hnorm",
                &[head.enorm.as_slice(), head.hnorm.as_slice()].concat(),
            )?,
            eh_proj: Mat::upload(&gpu, &head.eh_proj)?,
            layer: DeviceLayer::upload(&gpu, &head.layer, cfg)?,
            shared_head_norm: vector(&gpu, "nextn.shared_head_norm", &head.shared_head_norm)?,
            lm_head,
            lm_head_shared,
            draft: None,
            config: cfg.clone(),
            gpu,
            counters,
            pass,
            io: Mutex::new(PassIo::default()),
        };
        d.gpu.check().map_err(gpu_err)?;
        let mut kernels = Vec::new();
        d.eh_proj.kernels(&mut kernels);
        d.layer.kernels(&mut kernels);
        d.lm_head.kernels(&mut kernels);
        d.gpu.prepare(&kernels).map_err(gpu_err)?;
        Ok(d)
    }

    /// Device memory of the head's own weights (an LM head shared with the trunk not counted).
    pub(crate) fn weight_bytes(&self) -> u64 {
        self.eh_proj.device_bytes()
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

    /// [`NextnHead::forward_batch`] on the device.
    pub(crate) fn forward_batch(
        &self,
        head: &NextnHead,
        items: &mut [HeadBatchItem],
    ) -> Result<Vec<ForwardOutput>, ModelError> {
        let gpu = &*self.gpu;
        let e = self.config.n_embd;
        let eps = self.config.rms_eps;
        let n_vocab = head.n_vocab();
        let n: usize = items.iter().map(|it| it.tokens.len()).sum();
        if n == 0 {
            return Ok(items
                .iter()
                .map(|_| ForwardOutput::empty(n_vocab))
                .collect());
        }
        // [embedding row ‖ previous hidden row] per row, normed on the device.
        let mut cat_raw = vec![0.0f32; n * 2 * e];
        let mut starts = Vec::with_capacity(items.len());
        let mut at = 0;
        for it in items.iter() {
            if it.hidden_prev.len() != it.tokens.len() * e {
                return Err(ModelError::HiddenLength {
                    found: it.hidden_prev.len(),
                    rows: it.tokens.len(),
                    width: e,
                });
            }
            starts.push(at);
            for (i, &t) in it.tokens.iter().enumerate() {
                // An id outside the table is refused here (TokenOutOfRange).
                let dst = &mut cat_raw[(at + i) * 2 * e..(at + i + 1) * 2 * e];
                head.embed.dequantize_row(t as usize, &mut dst[..e])?;
                dst[e..].copy_from_slice(&it.hidden_prev[i * e..(i + 1) * e]);
            }
            at += it.tokens.len();
        }
        let mut io = locked(&self.io)?;
        let mut pass = locked(&self.pass)?;
        pass.reserve(n)?;
        let raw = grow(gpu, &mut io.raw, "nextn-in", n * 2 * e)?;
        let cat = grow(gpu, &mut io.cat, "nextn-cat", n * 2 * e)?;
        let h = grow(gpu, &mut io.h, "nextn-h", n * e)?;
        let mut rec = Recorder::new(gpu);
        rec.upload(&raw, 0, bytemuck::cast_slice(&cat_raw));
        let (nu, eu, e2) = (u(n)?, u(e)?, u(2 * e)?);
        // Both halves normed on their own in one dispatch, quantized whole for eh_proj.
        let needs = Needs::of(&self.eh_proj.m);
        let cat_q = grow_quant(gpu, &mut io.cat_q, "nextn-cat", n, 2 * e)?;
        norm_quant(
            &mut rec,
            &raw,
            0,
            e2,
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
            .zip(&starts)
            .filter(|(it, _)| !it.tokens.is_empty())
            .map(|(it, &s)| Segment {
                rows: s..s + it.tokens.len(),
                start_pos: it.start_pos,
                cache: &mut *it.cache,
                verify: false,
                positions: crate::ops::RowPositions::default(),
            })
            .collect();
        self.layer
            .forward(&mut rec, &h, n, &mut segments, &mut pass)?;
        drop(segments);
        drop(pass);
        let lm = self.draft.as_ref().unwrap_or(&self.lm_head);
        let width = lm.rows();
        let readbacks: Vec<Readback> = items.iter().map(|it| it.readback).collect();
        let tail = record_tail(
            &mut rec,
            &mut io,
            &h,
            n,
            e,
            &self.shared_head_norm,
            eps,
            lm,
            items
                .iter()
                .zip(&starts)
                .map(|(it, &s)| (s, it.tokens.len(), it.logits)),
            &readbacks,
        )?;
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
            .zip(&starts)
            .zip(logits.into_iter().zip(top1))
            .map(|((it, &s), (logits, top1))| ForwardOutput {
                hidden: hidden_host[s * e..(s + it.tokens.len()) * e].to_vec(),
                logits,
                n_vocab,
                top1,
            })
            .collect())
    }
}
