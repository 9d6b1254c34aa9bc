//! One decoder layer on the device: `h' = h1 + FFN(norm(h1))` with `h1 = h + Mixer(norm(h))`,
//! the mixer a gated attention or a gated delta net, the FFN dense SwiGLU or MoE with a shared
//! expert. The projections run once over all rows of the pass; attention and the recurrence run
//! per sequence on its own cache (one `Segment` each), as on the CPU.
//!
//! A layer of one sequence is ten dispatches or fewer: the norm quantizes its output for the
//! products that read it; the products over the same input are stacked into one per weight type
//! (q|k|v; the delta net's qkv|β|α|z; gate|up as a pair with SwiGLU in the epilogue); the
//! attention's norms, rotation and KV store are one kernel and its merge quantizes for the output
//! projection, as the delta net's gated norm does; the delta net's conv, gates and recurrence are
//! one kernel; the output and down projections add into the residual in their epilogue.

use std::sync::Arc;

use nextn_gpu::kernels::attention::{self as attn_k, steps, PrepRows, RotaryPositions};
use nextn_gpu::kernels::delta_net::{self as dn_k, RawRows, StepIo, StepWeights};
use nextn_gpu::kernels::elementwise::{moe_combine, moe_route, swiglu, Rows};
use nextn_gpu::kernels::matvec::{matvec_experts, quant_layout, ActBlocks, Acts, QuantOut};
use nextn_gpu::kernels::norm::{norm_quant, NormOut};
use nextn_gpu::kernels::Kernel;
use nextn_gpu::weights::DeviceExperts;
use nextn_gpu::{DeviceMatrix, Gpu, GpuError, Recorder};

use super::cache::{DeviceDeltaNetCache, DeviceKvCache};
use super::{gpu_err, scratch, u, vector, Mat};
use crate::attention::GatedAttention;
use crate::batch::Segment;
use crate::cache::{KvType, LayerCache};
use crate::config::{Qwen35Config, RopeScaling};
use crate::delta_net::GatedDeltaNet;
use crate::ffn::{DenseFfn, Ffn, MoeFfn};
use crate::model::{DecoderLayer, Mixer};
use crate::ops::RowPositions;
use crate::weights::Linear;
use crate::ModelError;
use nextn_quant::kernels::ThreadPool;

/// Which quantized forms of an activation its products read: Q8_0 rows, Q8_K rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Needs {
    pub q8_0: bool,
    pub q8k: bool,
}

impl Needs {
    pub(crate) fn of(m: &DeviceMatrix) -> Needs {
        match m.act_blocks() {
            Some(ActBlocks::Q8_0) => Needs {
                q8_0: true,
                q8k: false,
            },
            Some(ActBlocks::Q8K) => Needs {
                q8_0: false,
                q8k: true,
            },
            None => Needs::default(),
        }
    }

    /// The forms a kernel that quantizes its rows in parts of `width` values can make: a form
    /// whose blocks would straddle two parts is left to the product, which quantizes whole rows.
    pub(crate) fn in_parts_of(self, width: usize) -> Needs {
        Needs {
            q8_0: self.q8_0 && width.is_multiple_of(ActBlocks::Q8_0.values() as usize),
            q8k: self.q8k && width.is_multiple_of(ActBlocks::Q8K.values() as usize),
        }
    }

    pub(crate) fn or(self, o: Needs) -> Needs {
        Needs {
            q8_0: self.q8_0 || o.q8_0,
            q8k: self.q8k || o.q8k,
        }
    }
}

/// Rows of one activation quantized for the int8 products: Q8_0 and Q8_K forms, each sized for
/// the rows and width it was made for.
pub(crate) struct QuantRows {
    pub q8_0: wgpu::Buffer,
    pub q8k: wgpu::Buffer,
}

impl QuantRows {
    pub(crate) fn new(
        gpu: &Gpu,
        label: &str,
        rows: usize,
        width: usize,
    ) -> Result<Self, ModelError> {
        let words = |kind: ActBlocks| {
            // A width that is not whole blocks of the kind is never quantized in it.
            quant_layout(width, kind).map_or(1, |l| l.stride as usize * rows)
        };
        Ok(QuantRows {
            q8_0: gpu
                .buffer(
                    &format!("{label}-q8_0"),
                    (words(ActBlocks::Q8_0) * 4) as u64,
                )
                .map_err(gpu_err)?,
            q8k: gpu
                .buffer(&format!("{label}-q8k"), (words(ActBlocks::Q8K) * 4) as u64)
                .map_err(gpu_err)?,
        })
    }

    /// The products' view of f32 rows `x` (`stride` apart) with the forms `needs` says were made.
    pub(crate) fn acts<'a>(&'a self, x: &'a wgpu::Buffer, stride: u32, needs: Needs) -> Acts<'a> {
        Acts {
            x,
            off: 0,
            stride,
            q8_0: needs.q8_0.then_some(&self.q8_0),
            q8k: needs.q8k.then_some(&self.q8k),
        }
    }

    /// Where a kernel quantizes its output rows for `needs`.
    pub(crate) fn out(&self, needs: Needs, row0: u32) -> QuantOut<'_> {
        QuantOut {
            q8_0: needs.q8_0.then_some(&self.q8_0),
            q8k: needs.q8k.then_some(&self.q8k),
            row0,
        }
    }

    /// Where [`norm_quant`] writes the forms `needs` says.
    pub(crate) fn norm_out<'a>(
        &'a self,
        y: &'a wgpu::Buffer,
        stride: u32,
        needs: Needs,
    ) -> NormOut<'a> {
        NormOut {
            y: Some((y, 0, stride)),
            q8_0: needs.q8_0.then_some(&self.q8_0),
            q8k: needs.q8k.then_some(&self.q8k),
            ..NormOut::default()
        }
    }
}

/// The activations of a pass, sized for the widest layer of the model and for the most rows a
/// pass has had, shared by every layer in turn (each layer's kernels run after the previous
/// layer's) and by the trunk and the head, kept from pass to pass.
pub(crate) struct PassBuffers {
    /// The normed input of the mixer or the FFN, f32 and quantized.
    pub x: wgpu::Buffer,
    pub xq: QuantRows,
    /// The stacked input projections of a mixer.
    pub proj: wgpu::Buffer,
    /// The mixer's output before its output projection (attention's, the delta net's gated
    /// norm's) and its quantized form; the delta net's recurrence output.
    pub o: wgpu::Buffer,
    pub oq: QuantRows,
    pub rec_out: wgpu::Buffer,
    /// FFN: SwiGLU output, and gate and up apart when they are not a pair.
    pub act: wgpu::Buffer,
    pub g: wgpu::Buffer,
    pub up: wgpu::Buffer,
    /// MoE: router logits (and the shared expert's gate), chosen experts, weights, per-slot
    /// gate and up, SwiGLU, outputs; the shared expert's output.
    pub router: wgpu::Buffer,
    pub ids: wgpu::Buffer,
    pub weights: wgpu::Buffer,
    pub eg: wgpu::Buffer,
    pub eu: wgpu::Buffer,
    pub eact: wgpu::Buffer,
    pub ey: wgpu::Buffer,
    pub shared: wgpu::Buffer,
    /// Attention's per-chunk partial results.
    pub attention: attn_k::AttentionScratch,
    /// Rows the buffers have room for.
    rows: usize,
    widths: PassWidths,
    gpu: Arc<Gpu>,
}

/// The widest activations of a model's layers (the trunk's and the head's).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PassWidths {
    pub embd: usize,
    pub proj: usize,
    pub mixer_out: usize,
    pub ff: usize,
    pub router: usize,
    pub expert_slots: usize,
    pub expert_ff: usize,
}

impl PassWidths {
    pub(crate) fn of(cfg: &Qwen35Config) -> PassWidths {
        let hd = cfg.head_dim;
        let max_head = cfg.n_head.iter().copied().max().unwrap_or(0);
        let max_kv = cfg.n_head_kv.iter().copied().max().unwrap_or(0);
        let inner = cfg.ssm_inner;
        let hv = cfg.ssm_v_heads;
        let attn = 2 * max_head * hd + 2 * max_kv * hd;
        let dn = cfg.conv_dim() + 2 * hv + inner;
        PassWidths {
            embd: cfg.n_embd,
            proj: attn.max(dn),
            mixer_out: (max_head * hd).max(inner),
            ff: cfg
                .n_ff
                .iter()
                .copied()
                .max()
                .unwrap_or(0)
                .max(cfg.n_ff_shexp),
            router: cfg.n_expert + 1,
            expert_slots: cfg.n_expert_used,
            expert_ff: cfg.n_ff_exp,
        }
    }
}

impl PassBuffers {
    /// Room for passes of `n` rows: the buffers are made for the next power of two and kept, so
    /// passes of a size seen before allocate nothing.
    pub(crate) fn reserve(&mut self, n: usize) -> Result<(), ModelError> {
        if n <= self.rows {
            return Ok(());
        }
        let attention = std::mem::take(&mut self.attention);
        *self = PassBuffers::new(&self.gpu, self.widths, n.next_power_of_two())?;
        self.attention = attention;
        Ok(())
    }

    pub(crate) fn new(gpu: &Arc<Gpu>, w: PassWidths, n: usize) -> Result<Self, ModelError> {
        let b = |label: &str, m: usize| scratch(gpu, label, m);
        let (k, nf) = (w.expert_slots, w.expert_ff);
        Ok(PassBuffers {
            x: b("x", n * w.embd)?,
            xq: QuantRows::new(gpu, "x", n, w.embd)?,
            proj: b("proj", n * w.proj)?,
            o: b("mixer-out", n * w.mixer_out)?,
            oq: QuantRows::new(gpu, "mixer-out", n, w.mixer_out)?,
            rec_out: b("recurrence-out", n * w.mixer_out)?,
            act: b("ffn-act", n * w.ff)?,
            g: b("ffn-gate", n * w.ff)?,
            up: b("ffn-up", n * w.ff)?,
            router: b("router", n * w.router)?,
            ids: b("expert-ids", n * k)?,
            weights: b("expert-weights", n * k)?,
            eg: b("expert-gate", n * k * nf)?,
            eu: b("expert-up", n * k * nf)?,
            eact: b("expert-act", n * k * nf)?,
            ey: b("expert-out", n * k * w.embd)?,
            shared: b("shared-out", n * w.embd)?,
            attention: attn_k::AttentionScratch::new(),
            rows: n,
            widths: w,
            gpu: gpu.clone(),
        })
    }
}

/// Matrices over the same input multiplied as few products as their types allow: those of one
/// type (and scale) stacked into one matrix. Part `i`'s outputs sit from column `cols[i]` of an
/// output row `width` wide.
pub(crate) struct Stack {
    groups: Vec<(Mat, usize)>,
    pub(crate) cols: Vec<usize>,
    pub(crate) width: usize,
}

impl Stack {
    pub(crate) fn upload(gpu: &Gpu, name: &str, parts: &[&Linear]) -> Result<Stack, ModelError> {
        let first = parts
            .first()
            .ok_or_else(|| ModelError::Device(format!("{name}: no matrices to stack")))?;
        let cols = first.cols;
        // Groups of one type and scale, in the order their first part comes.
        let mut keys: Vec<(nextn_gguf::GgmlType, Option<u32>)> = Vec::new();
        for p in parts {
            if p.cols != cols {
                return Err(ModelError::Device(format!(
                    "{}: {} columns stacked with {cols}",
                    p.name, p.cols
                )));
            }
            let key = (p.ty, p.scale().map(f32::to_bits));
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
        let mut at = 0;
        let mut part_cols = vec![0; parts.len()];
        let mut groups = Vec::with_capacity(keys.len());
        for key in keys {
            let members: Vec<usize> = (0..parts.len())
                .filter(|&i| (parts[i].ty, parts[i].scale().map(f32::to_bits)) == key)
                .collect();
            let group_at = at;
            let mut slices = Vec::with_capacity(members.len());
            for &i in &members {
                part_cols[i] = at;
                at += parts[i].rows;
                slices.push((parts[i].rows, parts[i].bytes()));
            }
            let label = if members.len() == 1 {
                parts[members[0]].name.clone()
            } else {
                format!(
                    "{name} ({})",
                    members
                        .iter()
                        .map(|&i| parts[i].name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            };
            let m =
                DeviceMatrix::upload_stacked(gpu, &label, key.0, cols, &slices).map_err(gpu_err)?;
            groups.push((
                Mat {
                    m,
                    scale: key.1.map(f32::from_bits),
                },
                group_at,
            ));
        }
        Ok(Stack {
            groups,
            cols: part_cols,
            width: at,
        })
    }

    pub(crate) fn needs(&self) -> Needs {
        self.groups
            .iter()
            .fold(Needs::default(), |n, (m, _)| n.or(Needs::of(&m.m)))
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.groups.iter().map(|(m, _)| m.device_bytes()).sum()
    }

    pub(crate) fn kernels(&self, out: &mut Vec<&'static Kernel>) {
        for (m, _) in &self.groups {
            m.kernels(out);
        }
    }

    /// Every part over `n` rows of `acts`, into rows of `y` `width` apart.
    pub(crate) fn forward(
        &self,
        rec: &mut Recorder,
        acts: &Acts,
        n: usize,
        y: &wgpu::Buffer,
    ) -> Result<(), ModelError> {
        for (m, col) in &self.groups {
            m.forward(rec, acts, n, y, *col, self.width, false)?;
        }
        Ok(())
    }
}

pub(crate) struct DeviceAttention {
    qkv: Stack,
    wo: Mat,
    /// q_norm then k_norm.
    norms: wgpu::Buffer,
    n_head: usize,
    head_dim: usize,
    n_rot: usize,
    rope_base: f32,
    rope_scale: f32,
    /// The t, h and w sections of the rotated pairs (`rope.dimension_sections`).
    rope_sections: [u32; 3],
    eps: f32,
}

pub(crate) struct DeviceDeltaNet {
    /// qkv | β | α | z (stacked by type, so the columns are the stack's).
    in_proj: Stack,
    /// conv weights | dt_bias | a.
    vecs: wgpu::Buffer,
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

/// Gate and up: one pair when they share a type and a buffer can hold both, else apart with
/// SwiGLU after them.
enum GateUp {
    Pair(Mat),
    Apart(Mat, Mat),
}

pub(crate) struct DeviceDense {
    gate_up: GateUp,
    down: Mat,
}

pub(crate) struct DeviceMoe {
    /// The router, and the shared expert's gate in the same product when they stack.
    router: Stack,
    /// The routed experts, when they are on the device; `None`: in host memory, computed there
    /// ([`HostExperts`]).
    experts: Option<RoutedExperts>,
    n_used: usize,
    n_ff: usize,
    n_expert: usize,
    shared: Option<DeviceDense>,
}

/// Gate and up of every expert, each stack as the CPU binds it (a fused gate|up tensor gives the
/// gate rows and the up rows of each expert), and down.
pub(crate) struct RoutedExperts {
    gate: DeviceExperts,
    up: DeviceExperts,
    down: DeviceExperts,
}

/// A layer's routed experts in host memory: the CPU's weights and threads, and the counters the
/// crossing's submission is counted in.
pub(crate) struct HostExperts<'a> {
    pub(crate) ffn: &'a MoeFfn,
    pub(crate) pool: &'a ThreadPool,
    pub(crate) counters: &'a super::Counters,
}

// One per layer: the size of the variants does not matter.
#[allow(clippy::large_enum_variant)]
pub(crate) enum DeviceFfn {
    Dense(DeviceDense),
    Moe(DeviceMoe),
}

pub(crate) struct DeviceLayer {
    /// attn_norm then post_attention_norm.
    norms: wgpu::Buffer,
    pub(crate) mixer: DeviceMixer,
    ffn: DeviceFfn,
    bytes: u64,
    n_embd: usize,
    eps: f32,
    /// What the mixer's and the FFN's input products read.
    mixer_needs: Needs,
    ffn_needs: Needs,
}

/// The bytes of a stack of expert matrices that sit one after another in the file.
fn stack_bytes(experts: &[Linear]) -> Vec<u8> {
    let mut out = Vec::with_capacity(experts.iter().map(|l| l.rows * l.row_bytes()).sum());
    for l in experts {
        out.extend_from_slice(l.bytes());
    }
    out
}

fn upload_experts(gpu: &Gpu, experts: &[Linear]) -> Result<DeviceExperts, ModelError> {
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
        let (g, up) = (&f.gate, &f.up);
        let same =
            g.ty == up.ty && g.scale() == up.scale() && (g.rows, g.cols) == (up.rows, up.cols);
        let pair = if same {
            let name = format!("{} + {}", g.name, up.name);
            match DeviceMatrix::upload_pair(gpu, &name, g.ty, g.rows, g.cols, g.bytes(), up.bytes())
            {
                Ok(m) => Some(Mat {
                    m,
                    scale: g.scale(),
                }),
                // Two matrices past one binding: multiplied apart.
                Err(GpuError::BufferTooLarge { .. }) => None,
                Err(e) => return Err(gpu_err(e)),
            }
        } else {
            None
        };
        let gate_up = match pair {
            Some(m) => GateUp::Pair(m),
            None => GateUp::Apart(Mat::upload(gpu, g)?, Mat::upload(gpu, up)?),
        };
        Ok(DeviceDense {
            gate_up,
            down: Mat::upload(gpu, &f.down)?,
        })
    }

    fn bytes(&self) -> u64 {
        let gu = match &self.gate_up {
            GateUp::Pair(m) => m.device_bytes(),
            GateUp::Apart(g, u) => g.device_bytes() + u.device_bytes(),
        };
        gu + self.down.device_bytes()
    }

    fn kernels(&self, out: &mut Vec<&'static Kernel>) {
        match &self.gate_up {
            GateUp::Pair(m) => m.kernels(out),
            GateUp::Apart(g, u) => {
                g.kernels(out);
                u.kernels(out);
            }
        }
        self.down.kernels(out);
    }

    fn needs(&self) -> Needs {
        match &self.gate_up {
            GateUp::Pair(m) => Needs::of(&m.m),
            GateUp::Apart(g, u) => Needs::of(&g.m).or(Needs::of(&u.m)),
        }
    }

    /// `out (+)= down · (SiLU(gate · x) ⊙ (up · x))` over `n` rows of `x` (`e` wide); the SwiGLU
    /// rows in `b.act`.
    fn forward(
        &self,
        rec: &mut Recorder,
        x: &Acts,
        n: usize,
        b: &PassBuffers,
        out: &wgpu::Buffer,
        add: bool,
    ) -> Result<(), ModelError> {
        let f = self.down.m.cols();
        match &self.gate_up {
            GateUp::Pair(m) => m.forward(rec, x, n, &b.act, 0, f, false)?,
            GateUp::Apart(g, up) => {
                g.forward(rec, x, n, &b.g, 0, f, false)?;
                up.forward(rec, x, n, &b.up, 0, f, false)?;
                swiglu(
                    rec,
                    Rows::new(&b.g, 0, u(f)?),
                    Rows::new(&b.up, 0, u(f)?),
                    &b.act,
                    u(n)?,
                    u(f)?,
                )
                .map_err(gpu_err)?;
            }
        }
        let e = self.down.rows();
        self.down
            .forward(rec, &Acts::f32(&b.act, 0, u(f)?), n, out, 0, e, add)
    }
}

impl DeviceLayer {
    /// Upload layer `l`; `experts_on_host`: its routed experts (a MoE layer's) stay in host
    /// memory and run on the CPU.
    pub(crate) fn upload(
        gpu: &Gpu,
        l: &DecoderLayer,
        cfg: &Qwen35Config,
        experts_on_host: bool,
    ) -> Result<DeviceLayer, ModelError> {
        let mixer = match &l.mixer {
            Mixer::Attention(m) => DeviceMixer::Attention(DeviceAttention::upload(gpu, m, cfg)?),
            Mixer::DeltaNet(m) => DeviceMixer::DeltaNet(DeviceDeltaNet::upload(gpu, m)?),
        };
        let ffn = match &l.ffn {
            Ffn::Dense(f) => DeviceFfn::Dense(DeviceDense::upload(gpu, f)?),
            Ffn::Moe(m) => DeviceFfn::Moe(DeviceMoe::upload(gpu, m, experts_on_host)?),
        };
        let (mixer_bytes, mixer_needs) = match &mixer {
            DeviceMixer::Attention(a) => (a.qkv.bytes() + a.wo.device_bytes(), a.qkv.needs()),
            DeviceMixer::DeltaNet(d) => (
                d.in_proj.bytes() + d.w_out.device_bytes(),
                d.in_proj.needs(),
            ),
        };
        let (ffn_bytes, ffn_needs) = match &ffn {
            DeviceFfn::Dense(d) => (d.bytes(), d.needs()),
            DeviceFfn::Moe(m) => (m.bytes(), m.needs()),
        };
        let norms: Vec<f32> = l
            .attn_norm
            .iter()
            .chain(&l.post_attention_norm)
            .copied()
            .collect();
        Ok(DeviceLayer {
            norms: vector(gpu, "attn_norm + post_attention_norm", &norms)?,
            mixer,
            ffn,
            bytes: mixer_bytes + ffn_bytes,
            n_embd: cfg.n_embd,
            eps: cfg.rms_eps,
            mixer_needs,
            ffn_needs,
        })
    }

    pub(crate) fn device_bytes(&self) -> u64 {
        self.bytes
    }

    /// The kernels this layer's products run (the rest are every model's).
    pub(crate) fn kernels(&self, out: &mut Vec<&'static Kernel>) {
        match &self.mixer {
            DeviceMixer::Attention(m) => {
                m.qkv.kernels(out);
                m.wo.kernels(out);
            }
            DeviceMixer::DeltaNet(m) => {
                m.in_proj.kernels(out);
                m.w_out.kernels(out);
            }
        }
        match &self.ffn {
            DeviceFfn::Dense(f) => f.kernels(out),
            DeviceFfn::Moe(m) => {
                m.router.kernels(out);
                if let Some(x) = &m.experts {
                    for s in [&x.gate, &x.up, &x.down] {
                        out.extend(s.kernels());
                    }
                }
                if let Some(f) = &m.shared {
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

    /// Advance `h` (`n × n_embd`, in place) through this layer. `x` is `h` normed by this
    /// layer's input norm when the caller made it already (the head's first layer reads its
    /// projection directly).
    pub(crate) fn forward(
        &self,
        rec: &mut Recorder,
        h: &wgpu::Buffer,
        n: usize,
        segments: &mut [Segment],
        b: &mut PassBuffers,
        host: Option<HostExperts>,
    ) -> Result<(), ModelError> {
        let e = self.n_embd;
        let (nu, eu) = (u(n)?, u(e)?);
        let norm = |rec: &mut Recorder, b: &PassBuffers, w_off: u32, needs: Needs| {
            norm_quant(
                rec,
                h,
                0,
                eu,
                eu,
                nu,
                1,
                eu,
                &self.norms,
                w_off,
                0,
                &b.xq.norm_out(&b.x, eu, needs),
                self.eps,
            )
            .map_err(gpu_err)
        };
        norm(rec, b, 0, self.mixer_needs)?;
        match &self.mixer {
            DeviceMixer::Attention(m) => m.forward(rec, self.mixer_needs, h, n, segments, b)?,
            DeviceMixer::DeltaNet(m) => m.forward(rec, self.mixer_needs, h, n, segments, b)?,
        }
        norm(rec, b, eu, self.ffn_needs)?;
        let x = b.xq.acts(&b.x, eu, self.ffn_needs);
        match &self.ffn {
            DeviceFfn::Dense(f) => f.forward(rec, &x, n, b, h, true),
            DeviceFfn::Moe(f) => f.forward(rec, &x, n, e, b, h, host),
        }
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
        let norms: Vec<f32> = m.q_norm.iter().chain(&m.k_norm).copied().collect();
        Ok(DeviceAttention {
            qkv: Stack::upload(gpu, "attn_q|k|v", &[&m.wq, &m.wk, &m.wv])?,
            wo: Mat::upload(gpu, &m.wo)?,
            norms: vector(gpu, "attn_q_norm + attn_k_norm", &norms)?,
            n_head: m.n_head,
            head_dim: m.head_dim,
            n_rot: cfg.n_rot,
            rope_base: cfg.rope_freq_base,
            rope_scale: match cfg.rope_scaling {
                RopeScaling::None => 1.0,
                RopeScaling::Linear { freq_scale } => freq_scale,
            },
            rope_sections: [0, 1, 2].map(|c| cfg.rope_sections[c].max(0) as u32),
            eps: cfg.rms_eps,
        })
    }

    /// Where a segment's rows turn: its text shift, or its image's grid.
    fn rotary(
        &self,
        positions: RowPositions,
        start_pos: usize,
    ) -> Result<RotaryPositions, ModelError> {
        let (shift, image_nx) = match positions {
            RowPositions::Text { shift } => (shift, 0),
            RowPositions::Image { p0, nx } => (start_pos.saturating_sub(p0), nx),
        };
        Ok(RotaryPositions {
            shift: u(shift)?,
            image_nx: u(image_nx)?,
            sections: self.rope_sections,
        })
    }

    /// Gated attention of every segment's rows over the normed rows in `b.x` (quantized as
    /// `needs` says), added into `h`.
    pub(crate) fn forward(
        &self,
        rec: &mut Recorder,
        needs: Needs,
        h: &wgpu::Buffer,
        n: usize,
        segments: &mut [Segment],
        b: &mut PassBuffers,
    ) -> Result<(), ModelError> {
        let hd = self.head_dim;
        let (qw, ow) = (2 * self.n_head * hd, self.n_head * hd);
        let width = self.qkv.width;
        // The normed rows are n_embd wide, the output projection's rows.
        let x = b.xq.acts(&b.x, u(self.wo.rows())?, needs);
        self.qkv.forward(rec, &x, n, &b.proj)?;
        let out_needs = Needs::of(&self.wo.m);
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
            let rows = PrepRows {
                x_off: u(r0 * width)?,
                x_stride: u(width)?,
                n: m,
                n_head: u(self.n_head)?,
                n_kv: u(kv.kv.n_kv_heads())?,
                head_dim: u(hd)?,
                q_head_stride: u(2 * hd)?,
                k_col: u(self.qkv.cols[1])?,
                v_col: u(self.qkv.cols[2])?,
                qn_off: 0,
                kn_off: u(hd)?,
                n_rot: u(self.n_rot)?,
                start_pos: pos,
                freq_base: self.rope_base,
                freq_scale: self.rope_scale,
                eps: self.eps,
                rotary: self.rotary(seg.positions, seg.start_pos)?,
            };
            attn_k::prep(
                rec,
                &b.proj,
                &self.norms,
                Some(&mut kv.kv),
                &rows,
                steps::NORM | steps::ROPE | steps::STORE,
            )
            .map_err(gpu_err)?;
            attn_k::attention_quant(
                rec,
                &mut b.attention,
                &b.proj,
                u(r0 * width + self.qkv.cols[0])?,
                u(width)?,
                u(2 * hd)?,
                u(hd)?,
                u(self.n_head)?,
                &kv.kv,
                m,
                pos,
                &b.o,
                u(r0 * ow)?,
                u(ow)?,
                &b.oq.out(out_needs, u(r0)?),
            )
            .map_err(gpu_err)?;
        }
        debug_assert_eq!(qw, self.qkv.cols[1] - self.qkv.cols[0]);
        let o = b.oq.acts(&b.o, u(ow)?, out_needs);
        self.wo.forward(rec, &o, n, h, 0, self.wo.rows(), true)
    }
}

impl DeviceDeltaNet {
    fn upload(gpu: &Gpu, m: &GatedDeltaNet) -> Result<Self, ModelError> {
        let (k_heads, v_heads, head_dim, kernel, eps) = m.shape();
        let vecs: Vec<f32> = m
            .conv
            .iter()
            .chain(&m.dt_bias)
            .chain(&m.a)
            .copied()
            .collect();
        Ok(DeviceDeltaNet {
            in_proj: Stack::upload(gpu, "ssm in", &[&m.w_qkv, &m.w_beta, &m.w_alpha, &m.w_gate])?,
            vecs: vector(gpu, "ssm_conv1d + ssm_dt.bias + ssm_a", &vecs)?,
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

    fn weights(&self) -> Result<StepWeights<'_>, ModelError> {
        let cd = self.conv_dim();
        Ok(StepWeights {
            buffer: &self.vecs,
            conv: 0,
            dt_bias: u(cd * self.kernel)?,
            a: u(cd * self.kernel + self.v_heads)?,
        })
    }

    /// The delta net over every segment's rows of the normed rows in `b.x` (quantized as `needs`
    /// says), added into `h`.
    pub(crate) fn forward(
        &self,
        rec: &mut Recorder,
        needs: Needs,
        h: &wgpu::Buffer,
        n: usize,
        segments: &mut [Segment],
        b: &mut PassBuffers,
    ) -> Result<(), ModelError> {
        let hv = self.v_heads;
        let inner = hv * self.head_dim;
        let shape = self.shape()?;
        let width = self.in_proj.width;
        let [c_qkv, c_beta, c_alpha, c_z] = [0, 1, 2, 3].map(|i| self.in_proj.cols[i]);
        // The normed rows are n_embd wide, the output projection's rows.
        let x = b.xq.acts(&b.x, u(self.w_out.rows())?, needs);
        self.in_proj.forward(rec, &x, n, &b.proj)?;
        let weights = self.weights()?;
        for seg in segments.iter_mut() {
            let LayerCache::DeviceDeltaNet(c) = &mut *seg.cache else {
                return Err(ModelError::WrongCacheKind {
                    layer: "device delta-net",
                    found: seg.cache.kind_name(),
                });
            };
            let (r0, len) = (seg.rows.start, seg.rows.len());
            if seg.verify {
                c.reserve(len)?;
            }
            let raw = RawRows {
                rows: dn_k::Rows {
                    buffer: &b.proj,
                    offset: u(r0 * width + c_qkv)?,
                    stride: u(width)?,
                },
                beta_col: u(c_beta - c_qkv)?,
                alpha_col: u(c_alpha - c_qkv)?,
            };
            // A verify pass leaves the committed state and window as they are and keeps its rows'
            // raw projections for a replay; other rows update the state in place. Either way the
            // window after the rows goes to the other copy.
            let ((s0, s1), (w0, w1)) = (c.state_offsets(), c.window_offsets());
            let io = StepIo {
                states: &c.states,
                state: s0,
                state_out: if seg.verify { s1 } else { s0 },
                windows: &c.windows,
                window: w0,
                window_out: Some(w1),
                keep: seg.verify.then_some(&c.keep),
            };
            dn_k::step(
                rec,
                &shape,
                &raw,
                &weights,
                &io,
                u(len)?,
                self.eps,
                dn_k::Rows {
                    buffer: &b.rec_out,
                    offset: u(r0 * inner)?,
                    stride: u(inner)?,
                },
            )
            .map_err(gpu_err)?;
            if seg.verify {
                let (_, io) = self.replay(c)?;
                dn_k::prepare_step(rec.gpu(), &c.keep, &weights, &io, &c.replay_out)
                    .map_err(gpu_err)?;
                c.pending = len;
            } else {
                c.window_at = 1 - c.window_at;
                c.pending = 0;
            }
        }
        let out_needs = Needs::of(&self.w_out.m);
        dn_k::gated_norm(
            rec,
            &shape,
            dn_k::Rows::packed(&b.rec_out, u(inner)?),
            dn_k::Rows {
                buffer: &b.proj,
                offset: u(c_z)?,
                stride: u(width)?,
            },
            &self.norm,
            u(n)?,
            self.eps,
            dn_k::Rows::packed(&b.o, u(inner)?),
            &b.oq.out(out_needs, 0),
        )
        .map_err(gpu_err)?;
        let y = b.oq.acts(&b.o, u(inner)?, out_needs);
        self.w_out
            .forward(rec, &y, n, h, 0, self.w_out.rows(), true)
    }

    /// Keep `keep` of `pending` verify rows: all kept, the other copies of the state and window
    /// become the committed ones (no copy); some rejected, the kept rows are replayed on the
    /// committed state from their raw projections, the window after them into the other copy.
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
        if keep == pending && keep > 0 {
            c.state_at = 1 - c.state_at;
            c.window_at = 1 - c.window_at;
        } else if keep > 0 {
            let (raw, io) = self.replay(c)?;
            dn_k::step(
                rec,
                &self.shape()?,
                &raw,
                &self.weights()?,
                &io,
                u(keep)?,
                self.eps,
                dn_k::Rows::packed(&c.replay_out, u(self.v_heads * self.head_dim)?),
            )
            .map_err(gpu_err)?;
            c.window_at = 1 - c.window_at;
        }
        c.pending = 0;
        Ok(())
    }

    /// A commit's replay of kept verify rows: their raw projections, and the committed state
    /// updated in place with the window after them going to the other copy.
    fn replay<'a>(
        &self,
        c: &'a DeviceDeltaNetCache,
    ) -> Result<(RawRows<'a>, StepIo<'a>), ModelError> {
        let cd = self.conv_dim();
        let hv = self.v_heads;
        let raw = RawRows {
            rows: dn_k::Rows::packed(&c.keep, u(cd + 2 * hv)?),
            beta_col: u(cd)?,
            alpha_col: u(cd + hv)?,
        };
        let ((s0, _), (w0, w1)) = (c.state_offsets(), c.window_offsets());
        let io = StepIo {
            states: &c.states,
            state: s0,
            state_out: s0,
            windows: &c.windows,
            window: w0,
            window_out: Some(w1),
            keep: None,
        };
        Ok((raw, io))
    }
}

impl DeviceMoe {
    /// `experts_on_host`: the routed experts stay in host memory.
    fn upload(gpu: &Gpu, m: &MoeFfn, experts_on_host: bool) -> Result<Self, ModelError> {
        let n_ff = m.gate.first().map_or(0, |l| l.rows);
        let mut router_parts = vec![&m.router];
        if let Some((gate_inp, _)) = &m.shared {
            router_parts.push(gate_inp);
        }
        let experts = if experts_on_host {
            None
        } else {
            Some(RoutedExperts {
                gate: upload_experts(gpu, &m.gate)?,
                up: upload_experts(gpu, &m.up)?,
                down: upload_experts(gpu, &m.down)?,
            })
        };
        Ok(DeviceMoe {
            router: Stack::upload(gpu, "ffn_gate_inp", &router_parts)?,
            experts,
            n_used: m.n_used,
            n_ff,
            n_expert: m.router.rows,
            shared: match &m.shared {
                Some((_, ffn)) => Some(DeviceDense::upload(gpu, ffn)?),
                None => None,
            },
        })
    }

    fn bytes(&self) -> u64 {
        self.router.bytes()
            + self.experts.as_ref().map_or(0, |x| {
                x.gate.device_bytes() + x.up.device_bytes() + x.down.device_bytes()
            })
            + self.shared.as_ref().map_or(0, DeviceDense::bytes)
    }

    fn needs(&self) -> Needs {
        let shared = self.shared.as_ref().map_or(Needs::default(), |s| s.needs());
        // The experts quantize their input themselves (each token's row for its slots).
        self.router.needs().or(shared)
    }

    /// Routed experts plus the shared expert for `n` rows of `x`, added into `h`. With the
    /// experts in host memory (`host`) the pass crosses once: what was recorded so far is
    /// submitted with the rows and their routing read back, the CPU computes each row's weighted
    /// sum of its experts, and the sum goes up to be added as one expert of weight 1.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        rec: &mut Recorder,
        x: &Acts,
        n: usize,
        e: usize,
        b: &PassBuffers,
        h: &wgpu::Buffer,
        host: Option<HostExperts>,
    ) -> Result<(), ModelError> {
        let ne = self.n_expert;
        let (k, nf) = (self.n_used, self.n_ff);
        let (nu, ku) = (u(n)?, u(k)?);
        let rw = self.router.width;
        self.router.forward(rec, x, n, &b.router)?;
        moe_route(rec, &b.router, u(rw)?, &b.ids, &b.weights, nu, u(ne)?, ku).map_err(gpu_err)?;
        let (e32, nf32) = (u(e)?, u(nf)?);
        let shared = match &self.shared {
            Some(ffn) => {
                ffn.forward(rec, x, n, b, &b.shared, false)?;
                Some((&b.shared, &b.router, u(self.router.cols[1])?, u(rw)?))
            }
            None => None,
        };
        let Some(experts) = &self.experts else {
            let host = host.ok_or_else(|| {
                ModelError::Device("a layer's routed experts are on neither side".into())
            })?;
            let (n4, nk4) = ((n * e * 4) as u64, (n * k * 4) as u64);
            let rows = rec.read_back(x.x, 0, n4);
            let ids = rec.read_back(&b.ids, 0, nk4);
            let weights = rec.read_back(&b.weights, 0, nk4);
            let gpu = rec.gpu();
            let before = std::mem::replace(rec, Recorder::new(gpu));
            let mut back = host.counters.submit_crossing(before)?;
            let (rows, ids, weights) = (back.f32s(rows), back.u32s(ids), back.f32s(weights));
            host.counters.read_back(rows.len() * 4 + ids.len() * 8);
            let routing = crate::ffn::Routing::from_ids(k, &ids, &weights, n, ne)?;
            let mut sum = vec![0.0f32; n * e];
            host.ffn
                .forward_experts(&rows, n, &routing, &mut sum, host.pool)?;
            rec.upload(&b.ey, 0, bytemuck::cast_slice(&sum));
            rec.upload(&b.weights, 0, bytemuck::cast_slice(&vec![1.0f32; n]));
            return moe_combine(rec, &b.ey, &b.weights, shared, h, nu, 1, e32, true)
                .map_err(gpu_err);
        };
        for (stack, out) in [(&experts.gate, &b.eg), (&experts.up, &b.eu)] {
            matvec_experts(
                rec, stack, &b.ids, 0, ku, x.x, 0, e32, false, nu, out, 0, nf32,
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
            &experts.down,
            &b.ids,
            0,
            ku,
            &b.eact,
            0,
            nf32,
            true,
            nu,
            &b.ey,
            0,
            e32,
        )
        .map_err(gpu_err)?;
        moe_combine(rec, &b.ey, &b.weights, shared, h, nu, ku, e32, true).map_err(gpu_err)
    }
}
