//! Elementwise and per-row primitives (docs/MODEL.md, "Primitives"), with ggml's accumulation
//! choices (norm sums in f64, RoPE angles by repeated f32 multiplication) so results track
//! llama.cpp.

/// `y = x / sqrt(mean(x²) + eps) ⊙ w`. The weight already carries the +1 of Qwen's zero-centred norm.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let sum: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0f32 / (mean + eps).sqrt();
    for ((o, &v), &g) in y.iter_mut().zip(x).zip(w) {
        *o = (v * scale) * g;
    }
}

/// [`rms_norm`] of every `w.len()`-wide row of `x` into the same row of `y`.
pub fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let e = w.len();
    for (xr, yr) in x.chunks_exact(e).zip(y.chunks_exact_mut(e)) {
        rms_norm(xr, w, eps, yr);
    }
}

/// In-place RMSNorm of every `w.len()`-sized chunk of `x` (per-head q/k norms).
pub fn rms_norm_heads(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    let mut tmp = vec![0.0f32; d];
    for head in x.chunks_exact_mut(d) {
        rms_norm(head, w, eps, &mut tmp);
        head.copy_from_slice(&tmp);
    }
}

/// `x / max(‖x‖, eps)`, in place (ggml_l2_norm; FLA uses `sqrt(Σx² + eps)`, which differs only near zero).
pub fn l2_norm(x: &mut [f32], eps: f32) {
    let sum: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let scale = 1.0f32 / (sum as f32).sqrt().max(eps);
    x.iter_mut().for_each(|v| *v *= scale);
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Numerically safe softmax in place; sum accumulated in f64 as ggml does.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}

pub fn add_in_place(acc: &mut [f32], x: &[f32]) {
    acc.iter_mut().zip(x).for_each(|(a, &b)| *a += b);
}

#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight lane sums over chunks of eight, reduced in a fixed pairwise order, then the tail:
    // keeps the compiler free to vectorise while staying deterministic.
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// Rotary tables for one position: the interleaved multi-section RoPE (docs/MODEL.md, "Rotary
/// position embedding") for a text token (position vector (p, p, p, 0)), which reduces to
/// NeoX-style partial rotation of the first `n_rot` dims.
pub struct RopeTable {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

/// Where a segment's rows sit in the rotary position space (M-RoPE): the (temporal, height,
/// width) position of each row, as llama.cpp's mtmd assigns them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowPositions {
    /// Text rows: row `i` at `(p, p, p)` with `p = start_pos + i - shift`, where `shift` counts
    /// the cache rows earlier images took beyond the positions they advanced.
    Text { shift: usize },
    /// The rows of one image, raster order over an `nx`-wide grid of tokens, the first at rotary
    /// position `p0`: row `i` at `(p0, p0 + i / nx, p0 + i % nx)`.
    Image { p0: usize, nx: usize },
}

impl Default for RowPositions {
    fn default() -> Self {
        RowPositions::Text { shift: 0 }
    }
}

impl RowPositions {
    /// The (t, h, w) position of row `i` of a segment whose first row is cache row `start_pos`.
    pub fn at(&self, start_pos: usize, i: usize) -> [usize; 3] {
        match *self {
            RowPositions::Text { shift } => {
                let p = start_pos + i - shift;
                [p, p, p]
            }
            RowPositions::Image { p0, nx } => [p0, p0 + i / nx.max(1), p0 + i % nx.max(1)],
        }
    }
}

impl RopeTable {
    pub fn new(
        pos: usize,
        n_rot: usize,
        freq_base: f32,
        freq_scale: f32,
        sections: [i32; 4],
    ) -> Self {
        Self::new_3d([pos; 3], n_rot, freq_base, freq_scale, sections)
    }

    /// The tables of one (t, h, w) position: the sections' pairs turn by their own component.
    pub fn new_3d(
        pos: [usize; 3],
        n_rot: usize,
        freq_base: f32,
        freq_scale: f32,
        sections: [i32; 4],
    ) -> Self {
        let half = n_rot / 2;
        let theta_scale = freq_base.powf(-2.0 / n_rot as f32);
        // ggml keeps one running angle per position component; text uses (p, p, p, 0).
        let mut theta_t = pos[0] as f32;
        let mut theta_h = pos[1] as f32;
        let mut theta_w = pos[2] as f32;
        let mut theta_e = 0.0f32;
        let (s_t, s_h, s_w) = (
            sections[0].max(0) as usize,
            sections[1].max(0) as usize,
            sections[2].max(0) as usize,
        );
        let mut cos = Vec::with_capacity(half);
        let mut sin = Vec::with_capacity(half);
        for i in 0..half {
            let theta = if i % 3 == 1 && i < 3 * s_h {
                theta_h
            } else if i % 3 == 2 && i < 3 * s_w {
                theta_w
            } else if i % 3 == 0 && i < 3 * s_t {
                theta_t
            } else {
                theta_e
            };
            let t = theta * freq_scale;
            cos.push(t.cos());
            sin.push(t.sin());
            theta_t *= theta_scale;
            theta_h *= theta_scale;
            theta_w *= theta_scale;
            theta_e *= theta_scale;
        }
        RopeTable { cos, sin }
    }

    /// Rotate pairs `(x[i], x[i + n_rot/2])` of one head; dims ≥ n_rot are untouched.
    pub fn apply(&self, head: &mut [f32]) {
        let half = self.cos.len();
        for i in 0..half {
            let (x0, x1) = (head[i], head[i + half]);
            head[i] = x0 * self.cos[i] - x1 * self.sin[i];
            head[i + half] = x0 * self.sin[i] + x1 * self.cos[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_weight_gives_unit_rms() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let mut y = vec![0.0; 64];
        rms_norm(&x, &vec![1.0; 64], 0.0, &mut y);
        let rms = (y.iter().map(|v| v * v).sum::<f32>() / 64.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-5, "{rms}");
    }

    #[test]
    fn rope_at_zero_is_identity_and_preserves_norm() {
        let t0 = RopeTable::new(0, 16, 1e7, 1.0, [3, 3, 2, 0]);
        let mut h: Vec<f32> = (0..32).map(|i| i as f32).collect();
        let orig = h.clone();
        t0.apply(&mut h);
        assert_eq!(h, orig);
        let t = RopeTable::new(17, 16, 1e7, 1.0, [3, 3, 2, 0]);
        t.apply(&mut h);
        let n0: f32 = orig[..16].iter().map(|v| v * v).sum();
        let n1: f32 = h[..16].iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() / n0 < 1e-5);
        assert_eq!(&h[16..], &orig[16..]);
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = vec![1.0, 2.0, 3.0, -1e30];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(x[3], 0.0);
    }

    #[test]
    fn l2_norm_guards_zero() {
        let mut z = vec![0.0f32; 8];
        l2_norm(&mut z, 1e-6);
        assert!(z.iter().all(|v| *v == 0.0));
    }
}
