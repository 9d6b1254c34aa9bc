//! The tower's input: patches in merge order (each 2x2 group of patches consecutive, as the
//! merger later concatenates them; each patch read from the 8-bit picture and normalised as it
//! is copied), the patch embedding over the two temporal kernels, and the
//! learned position embeddings resized bilinearly to the patch grid.

use nextn_quant::kernels::ThreadPool;

use crate::config::VisionConfig;
use crate::error::VisionError;
use crate::preprocess::{normalised, PreparedImage};
use crate::weights::Linear;

/// The patch grid of one image: `nx` by `ny` patches, both even.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grid {
    pub(crate) nx: usize,
    pub(crate) ny: usize,
}

impl Grid {
    pub(crate) fn n(&self) -> usize {
        self.nx * self.ny
    }

    /// The `(y, x)` patch at merge-order index `k`: 2x2 blocks row by row, and inside a block
    /// (0,0) (0,1) (1,0) (1,1), as llama.cpp's `positions` input for qwen3vl.
    pub(crate) fn yx(&self, k: usize) -> (usize, usize) {
        let block = k / 4;
        let (dy, dx) = ((k % 4) / 2, k % 2);
        let bx = self.nx / 2;
        (2 * (block / bx) + dy, 2 * (block % bx) + dx)
    }
}

/// Patch embedding: `conv(W0, image) + conv(W1, image) + bias` (a still image fills both
/// temporal frames), rows in merge order.
pub(crate) struct PatchEmbed {
    pub(crate) frame0: Linear,
    pub(crate) frame1: Linear,
    pub(crate) bias: Vec<f32>,
    pub(crate) patch: usize,
}

impl PatchEmbed {
    pub(crate) fn forward(
        &self,
        img: &PreparedImage,
        grid: Grid,
        cfg: &VisionConfig,
        pool: &ThreadPool,
    ) -> Result<Vec<f32>, VisionError> {
        let x = patch_rows(img, grid, self.patch, cfg);
        let mut out = self.frame0.forward(&x, grid.n(), pool)?;
        let second = self.frame1.forward(&x, grid.n(), pool)?;
        let e = self.bias.len();
        for row in out.chunks_exact_mut(e).zip(second.chunks_exact(e)) {
            for ((o, s), b) in row.0.iter_mut().zip(row.1).zip(&self.bias) {
                *o = (*o + s) + b;
            }
        }
        Ok(out)
    }
}

/// The patches of `img` in merge order, one row of `3 * patch * patch` normalised values each
/// (channel, then row, then column inside the patch, as the convolution kernel is laid out).
pub(crate) fn patch_rows(
    img: &PreparedImage,
    grid: Grid,
    patch: usize,
    cfg: &VisionConfig,
) -> Vec<f32> {
    let p = patch;
    let cols = 3 * p * p;
    let w = img.width();
    let pixels = img.pixels();
    let mut x = vec![0f32; grid.n() * cols];
    for (k, row) in x.chunks_exact_mut(cols).enumerate() {
        let (py, px) = grid.yx(k);
        for c in 0..3 {
            for ky in 0..p {
                let first = (py * p + ky) * w + px * p;
                let dst = &mut row[(c * p + ky) * p..(c * p + ky + 1) * p];
                for (kx, d) in dst.iter_mut().enumerate() {
                    *d = normalised(pixels[(first + kx) * 3 + c], c, cfg);
                }
            }
        }
    }
    x
}

/// Learned absolute position embeddings on a `side x side` grid.
pub(crate) struct PositionEmbed {
    pub(crate) table: Vec<f32>,
    pub(crate) side: usize,
    pub(crate) n_embd: usize,
}

impl PositionEmbed {
    /// Adds the embedding of every patch (the table resized to the grid, bilinear with aligned
    /// corners, as `ggml_interpolate` computes it) to `x`, rows in merge order.
    pub(crate) fn add_to(&self, x: &mut [f32], grid: Grid) {
        let e = self.n_embd;
        let s = self.side;
        if grid.nx == s && grid.ny == s {
            for (k, row) in x.chunks_exact_mut(e).enumerate() {
                let (y, xx) = grid.yx(k);
                let src = &self.table[(y * s + xx) * e..(y * s + xx + 1) * e];
                for (o, v) in row.iter_mut().zip(src) {
                    *o += *v;
                }
            }
            return;
        }
        let scale = |out: usize| {
            if out > 1 && s > 1 {
                (out - 1) as f32 / (s - 1) as f32
            } else {
                out as f32 / s as f32
            }
        };
        let (sf0, sf1) = (scale(grid.nx), scale(grid.ny));
        let axis = |i: usize, sf: f32| {
            let f = i as f32 / sf;
            let i0 = (f.floor() as i64).clamp(0, s as i64 - 1) as usize;
            let i1 = (i0 as i64 + 1).clamp(0, s as i64 - 1) as usize;
            let d = (f - i0 as f32).clamp(0.0, 1.0);
            (i0, i1, d)
        };
        for (k, row) in x.chunks_exact_mut(e).enumerate() {
            let (y, xx) = grid.yx(k);
            let (y0, y1, dy) = axis(y, sf1);
            let (x0, x1, dx) = axis(xx, sf0);
            let at = |yy: usize, xi: usize| &self.table[(yy * s + xi) * e..(yy * s + xi + 1) * e];
            let (a, b, c, d) = (at(y0, x0), at(y0, x1), at(y1, x0), at(y1, x1));
            for i in 0..e {
                let v = a[i] * (1.0 - dx) * (1.0 - dy)
                    + b[i] * dx * (1.0 - dy)
                    + c[i] * (1.0 - dx) * dy
                    + d[i] * dx * dy;
                row[i] += v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preprocess::{prepare, RgbImage};

    /// The patch rows as they were made while prepared images held f32 planes: the whole picture
    /// normalised into an R, a G and a B plane first, each patch row copied out of them.
    fn patch_rows_from_f32_planes(
        img: &RgbImage,
        grid: Grid,
        patch: usize,
        cfg: &VisionConfig,
    ) -> Vec<f32> {
        let (w, h) = (img.width() as usize, img.height() as usize);
        let n = w * h;
        let mut planes = vec![0f32; 3 * n];
        for i in 0..n {
            for c in 0..3 {
                let v = img.pixels()[i * 3 + c] as f32 / 255.0;
                planes[c * n + i] = (v - cfg.image_mean[c]) / cfg.image_std[c];
            }
        }
        let p = patch;
        let cols = 3 * p * p;
        let mut x = vec![0f32; grid.n() * cols];
        for (k, row) in x.chunks_exact_mut(cols).enumerate() {
            let (py, px) = grid.yx(k);
            for c in 0..3 {
                for ky in 0..p {
                    let src = c * w * h + (py * p + ky) * w + px * p;
                    row[(c * p + ky) * p..(c * p + ky + 1) * p]
                        .copy_from_slice(&planes[src..src + p]);
                }
            }
        }
        x
    }

    /// Normalising as the patches are read gives the bits of normalising the whole picture into
    /// f32 planes first, for every 8-bit value and channel, resized and padded pictures alike.
    #[test]
    fn patches_from_8_bit_pictures_have_the_f32_planes_bits() {
        let cfg = VisionConfig {
            n_embd: 64,
            n_ff: 128,
            n_layer: 2,
            n_head: 4,
            d_head: 16,
            eps: 1e-6,
            patch_size: 8,
            n_merge: 2,
            // Qwen3.5's normalisation, and values whose quotients round differently.
            image_mean: [0.5, 0.481_454_66, 0.408_210_73],
            image_std: [0.5, 0.268_629_54, 0.275_777_1],
            projection_dim: 256,
            min_tokens: 8,
            max_tokens: 4096,
        };
        // Every 8-bit value in every channel, on a picture that is resized and padded.
        let (w, h) = (101u32, 67u32);
        let px = (0..w * h * 3)
            .map(|i| ((i * 7919 + i / 3) % 256) as u8)
            .collect();
        let img = RgbImage::new(w, h, px).unwrap();
        for source in [
            img.clone(),
            RgbImage::new(32, 32, vec![0; 32 * 32 * 3]).unwrap(),
        ] {
            let prepared = prepare(&source, &cfg);
            let resized = RgbImage::new(
                prepared.width() as u32,
                prepared.height() as u32,
                prepared.pixels().to_vec(),
            )
            .unwrap();
            let side = cfg.patch_size * cfg.n_merge;
            let grid = Grid {
                nx: 2 * (prepared.width() / side),
                ny: 2 * (prepared.height() / side),
            };
            let new = patch_rows(&prepared, grid, cfg.patch_size, &cfg);
            let old = patch_rows_from_f32_planes(&resized, grid, cfg.patch_size, &cfg);
            assert_eq!(new.len(), old.len());
            for (i, (a, b)) in new.iter().zip(&old).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "value {i}: {a} vs {b}");
            }
        }
        for v in 0..=255u8 {
            for c in 0..3 {
                let old = (v as f32 / 255.0 - cfg.image_mean[c]) / cfg.image_std[c];
                assert_eq!(normalised(v, c, &cfg).to_bits(), old.to_bits());
            }
        }
    }

    #[test]
    fn merge_order_walks_two_by_two_blocks() {
        let g = Grid { nx: 4, ny: 2 };
        let order: Vec<_> = (0..8).map(|k| g.yx(k)).collect();
        assert_eq!(
            order,
            [
                (0, 0),
                (0, 1),
                (1, 0),
                (1, 1),
                (0, 2),
                (0, 3),
                (1, 2),
                (1, 3)
            ]
        );
    }

    #[test]
    fn resized_positions_keep_the_corners() {
        let side = 3;
        let table: Vec<f32> = (0..side * side).map(|i| i as f32).collect();
        let pe = PositionEmbed {
            table,
            side,
            n_embd: 1,
        };
        let g = Grid { nx: 6, ny: 4 };
        let mut x = vec![0f32; g.n()];
        pe.add_to(&mut x, g);
        let at = |y: usize, xx: usize| x[(0..g.n()).find(|&k| g.yx(k) == (y, xx)).unwrap()];
        assert_eq!(at(0, 0), 0.0);
        assert_eq!(at(0, 5), 2.0);
        assert_eq!(at(3, 0), 6.0);
        assert!((at(3, 5) - 8.0).abs() < 1e-5);
    }
}
