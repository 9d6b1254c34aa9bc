//! One ViT block: layer norm, fused QKV, 2D rotary positions (y on the first half of each head's
//! rotated pairs, x on the second), full attention over the image's patches, output projection,
//! layer norm, GELU MLP; both with residuals. A deepstack block also projects its output into
//! extra features for the text model.

use nextn_quant::kernels::ThreadPool;

use crate::error::VisionError;
use crate::gemm::{gemm, Panels};
use crate::ops::{add_into, gelu_all, layer_norm, par_rows, softmax_scaled};
use crate::patch::Grid;
use crate::weights::{Linear, Norm};

/// Queries per attention chunk: bounds the score buffer at `chunk x n` floats.
const QUERY_CHUNK: usize = 256;
/// llama.cpp's rotary base for the qwen3vl tower.
pub(crate) const ROPE_BASE: f32 = 10000.0;

pub(crate) struct Block {
    pub(crate) ln1: Norm,
    pub(crate) qkv: Linear,
    pub(crate) out: Linear,
    pub(crate) ln2: Norm,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
    pub(crate) deepstack: Option<Merger>,
}

/// Shape of the attention in one block.
#[derive(Clone, Copy)]
pub(crate) struct Heads {
    pub(crate) n_head: usize,
    pub(crate) d_head: usize,
    pub(crate) eps: f32,
}

impl Block {
    /// Runs the block over `x` (`n` rows of `n_embd`) in place.
    pub(crate) fn forward(
        &self,
        x: &mut Vec<f32>,
        grid: Grid,
        heads: Heads,
        pool: &ThreadPool,
    ) -> Result<(), VisionError> {
        let n = grid.n();
        let cur = layer_norm(pool, x, &self.ln1, heads.eps);
        let mut qkv = self.qkv.forward(&cur, n, pool)?;
        rope_qk(&mut qkv, grid, heads, pool);
        let attn = attention(&qkv, n, heads, pool)?;
        let mut h = self.out.forward(&attn, n, pool)?;
        add_into(&mut h, x);
        let cur = layer_norm(pool, &h, &self.ln2, heads.eps);
        let mut up = self.up.forward(&cur, n, pool)?;
        gelu_all(pool, &mut up, self.up.rows());
        let mut ffn = self.down.forward(&up, n, pool)?;
        add_into(&mut ffn, &h);
        *x = ffn;
        Ok(())
    }
}

/// Layer norm over groups of merged patches, then `fc2(gelu(fc1(.)))`: the final merger and
/// every deepstack merger.
pub(crate) struct Merger {
    pub(crate) norm: Option<Norm>,
    pub(crate) fc1: Linear,
    pub(crate) fc2: Linear,
}

impl Merger {
    /// `x` holds `n` rows of `width`, already normalised when `norm` is `None`.
    pub(crate) fn forward(
        &self,
        x: &[f32],
        n: usize,
        eps: f32,
        pool: &ThreadPool,
    ) -> Result<Vec<f32>, VisionError> {
        let normed;
        let input = match &self.norm {
            Some(norm) => {
                normed = layer_norm(pool, x, norm, eps);
                &normed
            }
            None => x,
        };
        let mut h = self.fc1.forward(input, n, pool)?;
        gelu_all(pool, &mut h, self.fc1.rows());
        self.fc2.forward(&h, n, pool)
    }
}

/// ggml_rope_multi with GGML_ROPE_TYPE_VISION: `d_head/2` pairs `(i, i + d_head/2)`; pair `i`
/// turns by `y * base^(-2i/(d/2))` for `i < d/4` and by `x * base^(-2(i-d/4)/(d/2))` after,
/// the powers built by repeated multiplication in f32 as there.
fn rope_qk(qkv: &mut [f32], grid: Grid, heads: Heads, pool: &ThreadPool) {
    let d = heads.d_head;
    let n_embd = heads.n_head * d;
    let half = d / 2;
    let quarter = d / 4;
    let theta_scale = ROPE_BASE.powf(-2.0 / half as f32);
    par_rows(pool, qkv, 3 * n_embd, |k, row| {
        let (y, x) = grid.yx(k);
        let mut cs = vec![(0f32, 0f32); half];
        let (mut ty, mut tx) = (y as f32, x as f32);
        for (i, c) in cs.iter_mut().enumerate() {
            if i == quarter {
                tx = x as f32;
            }
            let theta = if i < quarter { ty } else { tx };
            *c = (theta.cos(), theta.sin());
            ty *= theta_scale;
            tx *= theta_scale;
        }
        for head in row[..2 * n_embd].chunks_exact_mut(d) {
            for (i, &(cos, sin)) in cs.iter().enumerate() {
                let (x0, x1) = (head[i], head[i + half]);
                head[i] = x0 * cos - x1 * sin;
                head[i + half] = x0 * sin + x1 * cos;
            }
        }
    });
}

/// Full (non-causal) attention per head: `softmax(K q / sqrt(d)) V`, in f32 as llama.cpp's
/// non-flash path; rows of the result hold the heads side by side.
fn attention(
    qkv: &[f32],
    n: usize,
    heads: Heads,
    pool: &ThreadPool,
) -> Result<Vec<f32>, VisionError> {
    let d = heads.d_head;
    let e = heads.n_head * d;
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![0f32; n * e];
    let mut q = vec![0f32; n * d];
    let mut k = vec![0f32; n * d];
    let mut v = vec![0f32; n * d];
    let mut scores = vec![0f32; QUERY_CHUNK.min(n) * n];
    let mut o = vec![0f32; QUERY_CHUNK.min(n) * d];
    for h in 0..heads.n_head {
        for t in 0..n {
            let row = &qkv[t * 3 * e..(t + 1) * 3 * e];
            q[t * d..(t + 1) * d].copy_from_slice(&row[h * d..(h + 1) * d]);
            k[t * d..(t + 1) * d].copy_from_slice(&row[e + h * d..e + (h + 1) * d]);
            v[t * d..(t + 1) * d].copy_from_slice(&row[2 * e + h * d..2 * e + (h + 1) * d]);
        }
        // Scores: one output per key; values: one output per value channel, over the keys.
        let keys = Panels::from_f32(&k, n, d);
        let values = Panels::from_f32_transposed(&v, n, d);
        for first in (0..n).step_by(QUERY_CHUNK) {
            let m = QUERY_CHUNK.min(n - first);
            let s = &mut scores[..m * n];
            gemm(&q[first * d..(first + m) * d], m, &keys, s, pool);
            par_rows(pool, s, n, |_, row| softmax_scaled(row, scale));
            let oc = &mut o[..m * d];
            gemm(s, m, &values, oc, pool);
            for (i, src) in oc.chunks_exact(d).enumerate() {
                let t = first + i;
                out[t * e + h * d..t * e + (h + 1) * d].copy_from_slice(src);
            }
        }
    }
    Ok(out)
}
