//! One decoder layer on the device: `h' = h1 + FFN(norm(h1))` with `h1 = h + Mixer(norm(h))`,
//! the mixer a gated attention or a gated delta net, the FFN dense SwiGLU or MoE with a shared
//! expert. The projections run once over all rows of the pass; attention and the recurrence run
//! per sequence on its own cache (one `Segment` each), as on the CPU.

use std::sync::Arc;

use nextn_gpu::kernels::attention as attn_k;
use nextn_gpu::kernels::delta_net as dn_k;
use nextn_gpu::kernels::elementwise::{add_rows, copy_rows, moe_combine, moe_route, swiglu, Rows};
use nextn_gpu::kernels::matvec::matvec_experts;
use nextn_gpu::kernels::norm::rms_norm;
use nextn_gpu::weights::DeviceExperts;
use nextn_gpu::{Gpu, Recorder};

use super::cache::{DeviceDeltaNetCache, DeviceKvCache};
use super::{gpu_err, scratch, u, vector, Mat};
use crate::attention::GatedAttention;
use crate::batch::Segment;
use crate::cache::{KvType, LayerCache};
use crate::config::{Qwen35Config, RopeScaling};
use crate::delta_net::GatedDeltaNet;
use crate::ffn::{DenseFfn, Ffn, MoeFfn};
use crate::model::{DecoderLayer, Mixer};
use crate::ModelError;

/// The activations of a pass, sized for the widest layer of the model and for the most rows a
/// pass has had, shared by every layer in turn (each layer's kernels run after the previous
/// layer's) and by the trunk and the head, kept from pass to pass.
pub(crate) struct PassBuffers {
    pub x: wgpu::Buffer,
    pub a: wgpu::Buffer,
    /// Projections: attention q|gate (or the delta net's q|k|v), k (or z), v (or β|α).
    pub p0: wgpu::Buffer,
    pub p1: wgpu::Buffer,
    pub p2: wgpu::Buffer,
    pub p3: wgpu::Buffer,
    /// Attention / recurrence output before the output projection, and the gated norm's output.
    pub o: wgpu::Buffer,
    pub y: wgpu::Buffer,
    /// FFN: gate, up, SwiGLU output (dense and shared expert).
    pub g: wgpu::Buffer,
    pub up: wgpu::Buffer,
    pub act: wgpu::Buffer,
    /// MoE: router logits, chosen experts, weights, per-slot gate|up, SwiGLU, outputs; shared
    /// expert output and gate.
    pub router: wgpu::Buffer,
    pub ids: wgpu::Buffer,
    pub weights: wgpu::Buffer,
    pub eg: wgpu::Buffer,
    pub eu: wgpu::Buffer,
    pub eact: wgpu::Buffer,
    pub ey: wgpu::Buffer,
    pub shared: wgpu::Buffer,
    pub shared_gate: wgpu::Buffer,
    /// Per sequence of the pass: the delta net's recurrence inputs and output of its rows.
    pub segments: Vec<SegmentBuffers>,
    /// Attention's per-chunk partial results.
    pub attention: attn_k::AttentionScratch,
    conv_dim: usize,
    v_heads: usize,
    inner: usize,
    /// Rows the buffers have room for.
    rows: usize,
    cfg: Qwen35Config,
    gpu: Arc<Gpu>,
}

/// One sequence's delta-net rows in a pass (made on first use, shared by every layer).
pub(crate) struct SegmentBuffers {
    pub conv: wgpu::Buffer,
    pub beta: wgpu::Buffer,
    pub decay: wgpu::Buffer,
    pub out: wgpu::Buffer,
    rows: usize,
}

impl PassBuffers {
    /// The buffers of segment `i` of `rows` rows.
    pub(crate) fn reserve_segment(&mut self, i: usize, rows: usize) -> Result<(), ModelError> {
        while self.segments.len() <= i {
            self.segments.push(SegmentBuffers {
                conv: scratch(&self.gpu, "seg-conv", 0)?,
                beta: scratch(&self.gpu, "seg-beta", 0)?,
                decay: scratch(&self.gpu, "seg-decay", 0)?,
                out: scratch(&self.gpu, "seg-out", 0)?,
                rows: 0,
            });
        }
        if self.segments[i].rows < rows {
            let g = &self.gpu;
            let rows = rows.next_power_of_two();
            self.segments[i] = SegmentBuffers {
                conv: scratch(g, "seg-conv", rows * self.conv_dim)?,
                beta: scratch(g, "seg-beta", rows * self.v_heads)?,
                decay: scratch(g, "seg-decay", rows * self.v_heads)?,
                out: scratch(g, "seg-out", rows * self.inner)?,
                rows,
            };
        }
        Ok(())
    }

    /// Room for passes of `n` rows: the buffers are made for the next power of two and kept, so
    /// passes of a size seen before allocate nothing.
    pub(crate) fn reserve(&mut self, n: usize) -> Result<(), ModelError> {
        if n <= self.rows {
            return Ok(());
        }
        let segments = std::mem::take(&mut self.segments);
        let attention = std::mem::take(&mut self.attention);
        *self = PassBuffers::new(&self.gpu, &self.cfg, n.next_power_of_two())?;
        self.segments = segments;
        self.attention = attention;
        Ok(())
    }

    pub(crate) fn new(gpu: &Arc<Gpu>, cfg: &Qwen35Config, n: usize) -> Result<Self, ModelError> {
        let e = cfg.n_embd;
        let hd = cfg.head_dim;
        let max_head = cfg.n_head.iter().copied().max().unwrap_or(0);
        let max_kv = cfg.n_head_kv.iter().copied().max().unwrap_or(0);
        let conv_dim = cfg.conv_dim();
        let inner = cfg.ssm_inner;
        let hv = cfg.ssm_v_heads;
        let w0 = (2 * max_head * hd).max(conv_dim);
        let w1 = (max_kv * hd).max(inner);
        let w2 = (max_kv * hd).max(hv);
        let n_ff = cfg
            .n_ff
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .max(cfg.n_ff_shexp);
        let k = cfg.n_expert_used;
        let nf = cfg.n_ff_exp;
        let b = |label: &str, m: usize| scratch(gpu, label, m);
        Ok(PassBuffers {
            x: b("x", n * e)?,
            a: b("a", n * e)?,
            p0: b("proj0", n * w0)?,
            p1: b("proj1", n * w1)?,
            p2: b("proj2", n * w2)?,
            p3: b("proj3", n * hv)?,
            o: b("mixer-out", n * (max_head * hd).max(inner))?,
            y: b("gated-norm", n * inner)?,
            g: b("ffn-gate", n * n_ff)?,
            up: b("ffn-up", n * n_ff)?,
            act: b("ffn-act", n * n_ff)?,
            router: b("router", n * cfg.n_expert)?,
            ids: b("expert-ids", n * k)?,
            weights: b("expert-weights", n * k)?,
            eg: b("expert-gate", n * k * nf)?,
            eu: b("expert-up", n * k * nf)?,
            eact: b("expert-act", n * k * nf)?,
            ey: b("expert-out", n * k * e)?,
            shared: b("shared-out", n * e)?,
            shared_gate: b("shared-gate", n)?,
            segments: Vec::new(),
            attention: attn_k::AttentionScratch::new(),
            conv_dim,
            v_heads: hv,
            inner,
            rows: n,
            cfg: cfg.clone(),
            gpu: gpu.clone(),
        })
    }
}

pub(crate) struct DeviceAttention {
    wq: Mat,
    wk: Mat,
    wv: Mat,
    wo: Mat,
    q_norm: wgpu::Buffer,
    k_norm: wgpu::Buffer,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    n_rot: usize,
    rope_base: f32,
    rope_scale: f32,
    eps: f32,
}

pub(crate) struct DeviceDeltaNet {
    w_qkv: Mat,
    w_gate: Mat,
    w_beta: Mat,
    w_alpha: Mat,
    conv: wgpu::Buffer,
    dt_bias: wgpu::Buffer,
    a: wgpu::Buffer,
    norm: wgpu::Buffer,
    w_out: Mat,
    k_heads: usize,
    v_heads: usize,
    head_dim: usize,
    kernel: usize,
    eps: f32,
}

pub(crate) enum DeviceMixer {
    Attention(DeviceAttention),
    DeltaNet(DeviceDeltaNet),
}

pub(crate) struct DeviceDense {
    gate: Mat,
    up: Mat,
    down: Mat,
}

pub(crate) struct DeviceMoe {
    router: Mat,
    /// Gate and up of every expert, each stack as the CPU binds it (a fused gate|up tensor gives
    /// the gate rows and the up rows of each expert).
    gate: DeviceExperts,
    up: DeviceExperts,
    down: DeviceExperts,
    n_used: usize,
    n_ff: usize,
    shared: Option<(Mat, DeviceDense)>,
}

// One per layer: the size of the variants does not matter.
#[allow(clippy::large_enum_variant)]
pub(crate) enum DeviceFfn {
    Dense(DeviceDense),
    Moe(DeviceMoe),
}

pub(crate) struct DeviceLayer {
    attn_norm: wgpu::Buffer,
    pub(crate) mixer: DeviceMixer,
    post_attention_norm: wgpu::Buffer,
    ffn: DeviceFfn,
    bytes: u64,
    n_embd: usize,
    eps: f32,
}

/// The bytes of a stack of expert matrices that sit one after another in the file.
fn stack_bytes(experts: &[crate::weights::Linear]) -> Vec<u8> {
    let mut out = Vec::with_capacity(experts.iter().map(|l| l.rows * l.row_bytes()).sum());
    for l in experts {
        out.extend_from_slice(l.bytes());
    }
    out
}

fn upload_experts(
    gpu: &Gpu,
    experts: &[crate::weights::Linear],
) -> Result<DeviceExperts, ModelError> {
    let first = experts
        .first()
        .ok_or_else(|| ModelError::MissingTensor("ffn_*_exps".into()))?;
    if experts.iter().any(|l| l.scale().is_some()) {
        return Err(ModelError::Device(format!(
            "tensor '{}': per-expert scales are not read on the GPU",
            first.name
        )));
    }
    DeviceExperts::upload(
        gpu,
        &first.name,
        first.ty,
        experts.len(),
        first.rows,
        first.cols,
        &stack_bytes(experts),
    )
    .map_err(gpu_err)
}

impl DeviceDense {
    fn upload(gpu: &Gpu, f: &DenseFfn) -> Result<Self, ModelError> {
        Ok(DeviceDense {
            gate: Mat::upload(gpu, &f.gate)?,
            up: Mat::upload(gpu, &f.up)?,
            down: Mat::upload(gpu, &f.down)?,
        })
    }

    fn bytes(&self) -> u64 {
        self.gate.device_bytes() + self.up.device_bytes() + self.down.device_bytes()
    }

    fn kernels(&self, out: &mut Vec<&'static nextn_gpu::kernels::Kernel>) {
        for w in [&self.gate, &self.up, &self.down] {
            w.kernels(out);
        }
    }

    /// `out = down · (SiLU(gate · x) ⊙ (up · x))` over `n` rows of `x` (`e` wide).
    fn forward(
        &self,
        rec: &mut Recorder,
        x: &wgpu::Buffer,
        n: usize,
        e: usize,
        b: &PassBuffers,
        out: &wgpu::Buffer,
    ) -> Result<(), ModelError> {
        let f = self.gate.rows();
        self.gate.forward(rec, x, 0, e, n, &b.g, 0, f)?;
        self.up.forward(rec, x, 0, e, n, &b.up, 0, f)?;
        swiglu(
            rec,
            Rows::new(&b.g, 0, u(f)?),
            Rows::new(&b.up, 0, u(f)?),
            &b.act,
            u(n)?,
            u(f)?,
        )
        .map_err(gpu_err)?;
        self.down.forward(rec, &b.act, 0, f, n, out, 0, e)
    }
}

impl DeviceLayer {
    pub(crate) fn upload(
        gpu: &Gpu,
        l: &DecoderLayer,
        cfg: &Qwen35Config,
    ) -> Result<DeviceLayer, ModelError> {
        let mut bytes = 0u64;
        let mixer = match &l.mixer {
            Mixer::Attention(m) => {
                let d = DeviceAttention::upload(gpu, m, cfg)?;
                bytes += d.wq.device_bytes()
                    + d.wk.device_bytes()
                    + d.wv.device_bytes()
                    + d.wo.device_bytes();
                DeviceMixer::Attention(d)
            }
            Mixer::DeltaNet(m) => {
                let d = DeviceDeltaNet::upload(gpu, m)?;
                bytes += d.w_qkv.device_bytes()
                    + d.w_gate.device_bytes()
                    + d.w_beta.device_bytes()
                    + d.w_alpha.device_bytes()
                    + d.w_out.device_bytes();
                DeviceMixer::DeltaNet(d)
            }
        };
        let ffn = match &l.ffn {
            Ffn::Dense(f) => {
                let d = DeviceDense::upload(gpu, f)?;
                bytes += d.bytes();
                DeviceFfn::Dense(d)
            }
            Ffn::Moe(m) => {
                let d = DeviceMoe::upload(gpu, m)?;
                bytes += d.bytes();
                DeviceFfn::Moe(d)
            }
        };
        Ok(DeviceLayer {
            attn_norm: vector(gpu, "attn_norm", &l.attn_norm)?,
            mixer,
            post_attention_norm: vector(gpu, "post_attention_norm", &l.post_attention_norm)?,
            ffn,
            bytes,
            n_embd: cfg.n_embd,
            eps: cfg.rms_eps,
        })
    }

    pub(crate) fn device_bytes(&self) -> u64 {
        self.bytes
    }

    /// The kernels this layer's products run (the rest are every model's).
    pub(crate) fn kernels(&self, out: &mut Vec<&'static nextn_gpu::kernels::Kernel>) {
        match &self.mixer {
            DeviceMixer::Attention(m) => {
                for w in [&m.wq, &m.wk, &m.wv, &m.wo] {
                    w.kernels(out);
                }
            }
            DeviceMixer::DeltaNet(m) => {
                for w in [&m.w_qkv, &m.w_gate, &m.w_beta, &m.w_alpha, &m.w_out] {
                    w.kernels(out);
                }
            }
        }
        match &self.ffn {
            DeviceFfn::Dense(f) => f.kernels(out),
            DeviceFfn::Moe(m) => {
                m.router.kernels(out);
                for s in [&m.gate, &m.up, &m.down] {
                    out.extend(s.kernels());
                }
                if let Some((g, f)) = &m.shared {
                    g.kernels(out);
                    f.kernels(out);
                }
            }
        }
    }

    pub(crate) fn new_cache(
        &self,
        gpu: &Arc<Gpu>,
        cfg: &Qwen35Config,
        il: usize,
        n_ctx: usize,
        k_type: KvType,
        v_type: KvType,
    ) -> Result<LayerCache, ModelError> {
        Ok(match &self.mixer {
            DeviceMixer::Attention(_) => LayerCache::DeviceAttention(DeviceKvCache::new(
                gpu,
                k_type,
                v_type,
                cfg.n_head_kv[il],
                cfg.head_dim,
                n_ctx,
            )?),
            DeviceMixer::DeltaNet(d) => {
                let conv_dim = d.conv_dim();
                LayerCache::DeviceDeltaNet(DeviceDeltaNetCache::new(
                    gpu,
                    (d.kernel - 1) * conv_dim,
                    d.v_heads * d.head_dim * d.head_dim,
                    conv_dim,
                    d.v_heads,
                    d.v_heads * d.head_dim,
                )?)
            }
        })
    }

    /// Advance `h` (`n × n_embd`, in place) through this layer.
    pub(crate) fn forward(
        &self,
        rec: &mut Recorder,
        h: &wgpu::Buffer,
        n: usize,
        segments: &mut [Segment],
        b: &mut PassBuffers,
    ) -> Result<(), ModelError> {
        let e = self.n_embd;
        let (nu, eu) = (u(n)?, u(e)?);
        rms_norm(rec, h, 0, &self.attn_norm, 0, &b.x, 0, nu, eu, eu, self.eps).map_err(gpu_err)?;
        match &self.mixer {
            DeviceMixer::Attention(m) => m.forward(rec, n, segments, b)?,
            DeviceMixer::DeltaNet(m) => m.forward(rec, n, segments, b)?,
        }
        add_rows(rec, Rows::new(h, 0, eu), Rows::new(&b.a, 0, eu), nu, eu).map_err(gpu_err)?;
        rms_norm(
            rec,
            h,
            0,
            &self.post_attention_norm,
            0,
            &b.x,
            0,
            nu,
            eu,
            eu,
            self.eps,
        )
        .map_err(gpu_err)?;
        match &self.ffn {
            DeviceFfn::Dense(f) => f.forward(rec, &b.x, n, e, b, &b.a)?,
            DeviceFfn::Moe(f) => f.forward(rec, n, e, b)?,
        }
        add_rows(rec, Rows::new(h, 0, eu), Rows::new(&b.a, 0, eu), nu, eu).map_err(gpu_err)?;
        Ok(())
    }

    /// Keep `keep` of a verify pass's `pending` rows in this layer's cache.
    pub(crate) fn commit(
        &self,
        rec: &mut Recorder,
        cache: &mut LayerCache,
        keep: usize,
        pending: usize,
    ) -> Result<(), ModelError> {
        match (&self.mixer, cache) {
            (DeviceMixer::DeltaNet(d), LayerCache::DeviceDeltaNet(c)) => {
                d.commit(rec, c, keep, pending)
            }
            (DeviceMixer::Attention(_), LayerCache::DeviceAttention(_)) => Ok(()),
            (_, other) => Err(ModelError::WrongCacheKind {
                layer: "device",
                found: other.kind_name(),
            }),
        }
    }
}

impl DeviceAttention {
    fn upload(gpu: &Gpu, m: &GatedAttention, cfg: &Qwen35Config) -> Result<Self, ModelError> {
        Ok(DeviceAttention {
            wq: Mat::upload(gpu, &m.wq)?,
            wk: Mat::upload(gpu, &m.wk)?,
            wv: Mat::upload(gpu, &m.wv)?,
            wo: Mat::upload(gpu, &m.wo)?,
            q_norm: vector(gpu, "attn_q_norm", &m.q_norm)?,
            k_norm: vector(gpu, "attn_k_norm", &m.k_norm)?,
            n_head: m.n_head,
            n_head_kv: m.n_head_kv,
            head_dim: m.head_dim,
            n_rot: cfg.n_rot,
            rope_base: cfg.rope_freq_base,
            rope_scale: match cfg.rope_scaling {
                RopeScaling::None => 1.0,
                RopeScaling::Linear { freq_scale } => freq_scale,
            },
            eps: cfg.rms_eps,
        })
    }

    /// Gated attention of every segment's rows; `b.x` in, `b.a` out.
    pub(crate) fn forward(
        &self,
        rec: &mut Recorder,
        n: usize,
        segments: &mut [Segment],
        b: &mut PassBuffers,
    ) -> Result<(), ModelError> {
        let e = self.wq.m.cols();
        let hd = self.head_dim;
        let (qw, kvw, ow) = (2 * self.n_head * hd, self.n_head_kv * hd, self.n_head * hd);
        self.wq.forward(rec, &b.x, 0, e, n, &b.p0, 0, qw)?;
        self.wk.forward(rec, &b.x, 0, e, n, &b.p1, 0, kvw)?;
        self.wv.forward(rec, &b.x, 0, e, n, &b.p2, 0, kvw)?;
        // The per-head norms are row-local: one dispatch each over all rows.
        attn_k::rms_norm_heads_inplace(
            rec,
            &b.p0,
            0,
            u(qw)?,
            u(n)?,
            u(self.n_head)?,
            u(2 * hd)?,
            u(hd)?,
            &self.q_norm,
            0,
            self.eps,
        )
        .map_err(gpu_err)?;
        attn_k::rms_norm_heads_inplace(
            rec,
            &b.p1,
            0,
            u(kvw)?,
            u(n)?,
            u(self.n_head_kv)?,
            u(hd)?,
            u(hd)?,
            &self.k_norm,
            0,
            self.eps,
        )
        .map_err(gpu_err)?;
        for seg in segments.iter_mut() {
            let LayerCache::DeviceAttention(kv) = &mut *seg.cache else {
                return Err(ModelError::WrongCacheKind {
                    layer: "device attention",
                    found: seg.cache.kind_name(),
                });
            };
            let (r0, len) = (seg.rows.start, seg.rows.len());
            if seg.start_pos != kv.len() {
                return Err(ModelError::CachePosition {
                    layer: "attention",
                    cached: kv.len(),
                    start: seg.start_pos,
                });
            }
            let (pos, m) = (u(seg.start_pos)?, u(len)?);
            attn_k::rope_neox_inplace(
                rec,
                &b.p0,
                u(r0 * qw)?,
                u(qw)?,
                m,
                u(self.n_head)?,
                u(2 * hd)?,
                u(self.n_rot)?,
                pos,
                self.rope_base,
                self.rope_scale,
            )
            .map_err(gpu_err)?;
            attn_k::rope_neox_inplace(
                rec,
                &b.p1,
                u(r0 * kvw)?,
                u(kvw)?,
                m,
                u(self.n_head_kv)?,
                u(hd)?,
                u(self.n_rot)?,
                pos,
                self.rope_base,
                self.rope_scale,
            )
            .map_err(gpu_err)?;
            attn_k::kv_store(
                rec,
                &mut kv.kv,
                &b.p1,
                u(r0 * kvw)?,
                &b.p2,
                u(r0 * kvw)?,
                u(kvw)?,
                m,
                pos,
            )
            .map_err(gpu_err)?;
            attn_k::attention(
                rec,
                &mut b.attention,
                &b.p0,
                u(r0 * qw)?,
                u(qw)?,
                u(2 * hd)?,
                u(hd)?,
                u(self.n_head)?,
                &kv.kv,
                m,
                pos,
                &b.o,
                u(r0 * ow)?,
                u(ow)?,
            )
            .map_err(gpu_err)?;
        }
        self.wo.forward(rec, &b.o, 0, ow, n, &b.a, 0, e)
    }
}

impl DeviceDeltaNet {
    fn upload(gpu: &Gpu, m: &GatedDeltaNet) -> Result<Self, ModelError> {
        let (k_heads, v_heads, head_dim, kernel, eps) = m.shape();
        Ok(DeviceDeltaNet {
            w_qkv: Mat::upload(gpu, &m.w_qkv)?,
            w_gate: Mat::upload(gpu, &m.w_gate)?,
            w_beta: Mat::upload(gpu, &m.w_beta)?,
            w_alpha: Mat::upload(gpu, &m.w_alpha)?,
            conv: vector(gpu, "ssm_conv1d", &m.conv)?,
            dt_bias: vector(gpu, "ssm_dt.bias", &m.dt_bias)?,
            a: vector(gpu, "ssm_a", &m.a)?,
            norm: vector(gpu, "ssm_norm", &m.norm)?,
            w_out: Mat::upload(gpu, &m.w_out)?,
            k_heads,
            v_heads,
            head_dim,
            kernel,
            eps,
        })
    }

    fn conv_dim(&self) -> usize {
        2 * self.k_heads * self.head_dim + self.v_heads * self.head_dim
    }

    fn shape(&self) -> Result<dn_k::DeltaNetShape, ModelError> {
        Ok(dn_k::DeltaNetShape {
            k_heads: u(self.k_heads)?,
            v_heads: u(self.v_heads)?,
            key_head: u(self.head_dim)?,
            value_head: u(self.head_dim)?,
            kernel: u(self.kernel)?,
        })
    }

    /// The delta net over every segment's rows; `b.x` in, `b.a` out.
    pub(crate) fn forward(
        &self,
        rec: &mut Recorder,
        n: usize,
        segments: &mut [Segment],
        b: &mut PassBuffers,
    ) -> Result<(), ModelError> {
        let e = self.w_qkv.m.cols();
        let cd = self.conv_dim();
        let hv = self.v_heads;
        let inner = hv * self.head_dim;
        let shape = self.shape()?;
        self.w_qkv.forward(rec, &b.x, 0, e, n, &b.p0, 0, cd)?;
        self.w_gate.forward(rec, &b.x, 0, e, n, &b.p1, 0, inner)?;
        self.w_beta.forward(rec, &b.x, 0, e, n, &b.p2, 0, hv)?;
        self.w_alpha.forward(rec, &b.x, 0, e, n, &b.p3, 0, hv)?;
        for (si, seg) in segments.iter_mut().enumerate() {
            let LayerCache::DeviceDeltaNet(c) = &mut *seg.cache else {
                return Err(ModelError::WrongCacheKind {
                    layer: "device delta-net",
                    found: seg.cache.kind_name(),
                });
            };
            let (r0, len) = (seg.rows.start, seg.rows.len());
            let m = u(len)?;
            b.reserve_segment(si, len)?;
            let raw = dn_k::Rows {
                buffer: &b.p0,
                offset: u(r0 * cd)?,
                stride: u(cd)?,
            };
            let rows_of = |buf, width| dn_k::Rows {
                buffer: buf,
                offset: (r0 * width) as u32,
                stride: width as u32,
            };
            // A verify pass keeps its rows' recurrence inputs in the sequence's own buffers until
            // commit; other rows use buffers of the pass, one set per sequence.
            if seg.verify {
                c.reserve(len)?;
                copy_rows(
                    rec,
                    Rows::new(&b.p0, u(r0 * cd)?, u(cd)?),
                    Rows::new(&c.raw, 0, u(cd)?),
                    m,
                    u(cd)?,
                )
                .map_err(gpu_err)?;
            }
            let tmp = &b.segments[si];
            let (conv, beta, decay) = if seg.verify {
                (&c.conv, &c.beta, &c.decay)
            } else {
                (&tmp.conv, &tmp.beta, &tmp.decay)
            };
            dn_k::conv_silu(rec, &shape, raw, m, &c.window, &self.conv, self.eps, conv)
                .map_err(gpu_err)?;
            dn_k::gates(
                rec,
                &shape,
                rows_of(&b.p2, hv),
                rows_of(&b.p3, hv),
                &self.dt_bias,
                &self.a,
                m,
                beta,
                decay,
            )
            .map_err(gpu_err)?;
            let state = if seg.verify {
                dn_k::StateIo::Separate {
                    input: &c.state,
                    output: &c.spare,
                }
            } else {
                dn_k::StateIo::InPlace(&c.state)
            };
            dn_k::recurrence(rec, &shape, state, conv, beta, decay, m, &tmp.out)
                .map_err(gpu_err)?;
            copy_rows(
                rec,
                Rows::new(&tmp.out, 0, u(inner)?),
                Rows::new(&b.o, u(r0 * inner)?, u(inner)?),
                m,
                u(inner)?,
            )
            .map_err(gpu_err)?;
            if seg.verify {
                c.pending = len;
            } else {
                dn_k::conv_window_advance(rec, &shape, &c.window, raw, m).map_err(gpu_err)?;
                c.pending = 0;
            }
        }
        dn_k::gated_norm(
            rec,
            &shape,
            &b.o,
            dn_k::Rows::packed(&b.p1, u(inner)?),
            &self.norm,
            u(n)?,
            self.eps,
            &b.y,
        )
        .map_err(gpu_err)?;
        self.w_out.forward(rec, &b.y, 0, inner, n, &b.a, 0, e)
    }

    /// Keep `keep` of `pending` verify rows: all kept, the spare state becomes the committed
    /// one (a swap, no copy); some rejected, the kept rows are replayed on the committed state.
    fn commit(
        &self,
        rec: &mut Recorder,
        c: &mut DeviceDeltaNetCache,
        keep: usize,
        pending: usize,
    ) -> Result<(), ModelError> {
        if c.pending != pending {
            return Err(ModelError::KeepBeyondPending {
                keep,
                pending: c.pending,
            });
        }
        let shape = self.shape()?;
        let k = u(keep)?;
        if keep == pending && keep > 0 {
            std::mem::swap(&mut c.state, &mut c.spare);
        } else if keep > 0 {
            dn_k::recurrence(
                rec,
                &shape,
                dn_k::StateIo::InPlace(&c.state),
                &c.conv,
                &c.beta,
                &c.decay,
                k,
                &c.replay_out,
            )
            .map_err(gpu_err)?;
        }
        if keep > 0 {
            let raw = dn_k::Rows::packed(&c.raw, u(self.conv_dim())?);
            dn_k::conv_window_advance(rec, &shape, &c.window, raw, k).map_err(gpu_err)?;
        }
        c.pending = 0;
        Ok(())
    }
}

impl DeviceMoe {
    fn upload(gpu: &Gpu, m: &MoeFfn) -> Result<Self, ModelError> {
        let n_ff = m.gate.first().map_or(0, |l| l.rows);
        let shared = match &m.shared {
            Some((gate_inp, ffn)) => {
                Some((Mat::upload(gpu, gate_inp)?, DeviceDense::upload(gpu, ffn)?))
            }
            None => None,
        };
        Ok(DeviceMoe {
            router: Mat::upload(gpu, &m.router)?,
            gate: upload_experts(gpu, &m.gate)?,
            up: upload_experts(gpu, &m.up)?,
            down: upload_experts(gpu, &m.down)?,
            n_used: m.n_used,
            n_ff,
            shared,
        })
    }

    fn bytes(&self) -> u64 {
        let gu = self.gate.device_bytes() + self.up.device_bytes();
        self.router.device_bytes()
            + gu
            + self.down.device_bytes()
            + self
                .shared
                .as_ref()
                .map_or(0, |(g, f)| g.device_bytes() + f.bytes())
    }

    /// Routed experts plus the shared expert for `n` rows of `b.x`; `b.a` out.
    fn forward(
        &self,
        rec: &mut Recorder,
        n: usize,
        e: usize,
        b: &PassBuffers,
    ) -> Result<(), ModelError> {
        let ne = self.router.rows();
        let (k, nf) = (self.n_used, self.n_ff);
        let (nu, ku) = (u(n)?, u(k)?);
        self.router.forward(rec, &b.x, 0, e, n, &b.router, 0, ne)?;
        moe_route(rec, &b.router, &b.ids, &b.weights, nu, u(ne)?, ku).map_err(gpu_err)?;
        let (e32, nf32) = (u(e)?, u(nf)?);
        for (stack, out) in [(&self.gate, &b.eg), (&self.up, &b.eu)] {
            matvec_experts(
                rec, stack, &b.ids, 0, ku, &b.x, 0, e32, false, nu, out, 0, nf32,
            )
            .map_err(gpu_err)?;
        }
        swiglu(
            rec,
            Rows::new(&b.eg, 0, nf32),
            Rows::new(&b.eu, 0, nf32),
            &b.eact,
            u(n * k)?,
            nf32,
        )
        .map_err(gpu_err)?;
        matvec_experts(
            rec,
            &self.down,
            &b.ids,
            0,
            ku,
            &b.eact,
            0,
            u(nf)?,
            true,
            nu,
            &b.ey,
            0,
            u(e)?,
        )
        .map_err(gpu_err)?;
        let shared = match &self.shared {
            Some((gate_inp, ffn)) => {
                gate_inp.forward(rec, &b.x, 0, e, n, &b.shared_gate, 0, 1)?;
                ffn.forward(rec, &b.x, n, e, b, &b.shared)?;
                Some((&b.shared, &b.shared_gate))
            }
            None => None,
        };
        moe_combine(rec, &b.ey, &b.weights, shared, &b.a, nu, ku, u(e)?).map_err(gpu_err)
    }
}
