//! `VisionTower`: an mmproj file loaded and checked, and the encoder forward of one image.

use std::path::Path;
use std::sync::Arc;

use nextn_gguf::GgufFile;
use nextn_quant::kernels::ThreadPool;

use crate::block::{Block, Heads, Merger};
use crate::config::VisionConfig;
use crate::device::DeviceTower;
use crate::error::VisionError;
use crate::patch::{Grid, PatchEmbed, PositionEmbed};
use crate::preprocess::{prepare, prepared_size, PreparedImage, RgbImage};
use crate::weights::{Binder, Norm};

/// A Qwen3.5 / Qwen3.6 vision tower (`qwen3vl_merger`).
pub struct VisionTower {
    cfg: VisionConfig,
    pub(crate) patch: PatchEmbed,
    pub(crate) pos: PositionEmbed,
    pub(crate) pre_ln: Option<Norm>,
    pub(crate) blocks: Vec<Block>,
    pub(crate) post_ln: Option<Norm>,
    pub(crate) merger: Merger,
    /// [`GgufFile::fingerprint`] of the mmproj file.
    file_fingerprint: u64,
    /// The same weights on a device, where encodes then run ([`VisionTower::offload`]).
    device: Option<DeviceTower>,
}

/// The embeddings of one image: `nx * ny` tokens (row by row) of `width` floats each.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageEmbedding {
    pub nx: usize,
    pub ny: usize,
    pub width: usize,
    pub data: Vec<f32>,
}

impl ImageEmbedding {
    pub fn n_tokens(&self) -> usize {
        self.nx * self.ny
    }
}

impl VisionTower {
    /// Opens and checks an mmproj file: its metadata, and every tensor the configuration
    /// implies present with the implied shape and a type the kernels read.
    pub fn load(path: impl AsRef<Path>) -> Result<VisionTower, VisionError> {
        let shown = path.as_ref().display().to_string();
        let file = GgufFile::open(path.as_ref()).map_err(|source| VisionError::Open {
            path: shown.clone(),
            source,
        })?;
        Self::from_file(Arc::new(file), &shown)
    }

    /// As [`load`](Self::load), for a file already opened.
    pub fn from_file(file: Arc<GgufFile>, path: &str) -> Result<VisionTower, VisionError> {
        let cfg = VisionConfig::from_gguf(&file, path)?;
        let file_fingerprint = file.fingerprint();
        let b = Binder { file };
        let e = cfg.n_embd;
        let p = cfg.patch_size as u64;
        let patch_dims = [p, p, 3, e as u64];
        let patch = PatchEmbed {
            frame0: b.conv_kernel("v.patch_embd.weight", &patch_dims)?,
            frame1: b.conv_kernel("v.patch_embd.weight.1", &patch_dims)?,
            bias: b.vector("v.patch_embd.bias", e)?,
            patch: cfg.patch_size,
        };
        let pos = position_embed(&b, e)?;
        let pre_ln = optional_norm(&b, "v.pre_ln", e)?;
        let post_ln = optional_norm(&b, "v.post_ln", e)?;
        let merged = 4 * e;
        let mut blocks = Vec::with_capacity(cfg.n_layer);
        for il in 0..cfg.n_layer {
            let pre = format!("v.blk.{il}");
            let deepstack = if b.has(&format!("v.deepstack.{il}.fc1.weight")) {
                Some(Merger {
                    norm: Some(b.norm(&format!("v.deepstack.{il}.norm"), merged)?),
                    fc1: b.linear(&format!("v.deepstack.{il}.fc1"), merged, merged)?,
                    fc2: b.linear(&format!("v.deepstack.{il}.fc2"), merged, cfg.projection_dim)?,
                })
            } else {
                None
            };
            blocks.push(Block {
                ln1: b.norm(&format!("{pre}.ln1"), e)?,
                qkv: b.linear(&format!("{pre}.attn_qkv"), e, 3 * e)?,
                out: b.linear(&format!("{pre}.attn_out"), e, e)?,
                ln2: b.norm(&format!("{pre}.ln2"), e)?,
                up: b.linear(&format!("{pre}.ffn_up"), e, cfg.n_ff)?,
                down: b.linear(&format!("{pre}.ffn_down"), cfg.n_ff, e)?,
                deepstack,
            });
        }
        let merger = Merger {
            norm: None,
            fc1: b.linear("mm.0", merged, merged)?,
            fc2: b.linear("mm.2", merged, cfg.projection_dim)?,
        };
        Ok(VisionTower {
            cfg,
            patch,
            pos,
            pre_ln,
            blocks,
            post_ln,
            merger,
            file_fingerprint,
            device: None,
        })
    }

    /// What an image's embeddings depend on besides its pixels: the mmproj file, the token
    /// bounds its grid is sized within and where it runs (the CPU, or which device: their
    /// kernels round differently). Two towers with the same fingerprint give the same rows.
    pub fn fingerprint(&self) -> u64 {
        let mut h = nextn_gguf::Fnv1a::new();
        h.write(&self.file_fingerprint.to_le_bytes());
        h.write(&self.cfg.min_tokens.to_le_bytes());
        h.write(&self.cfg.max_tokens.to_le_bytes());
        if let Some(d) = &self.device {
            let info = &d.gpu().info;
            for part in [&info.name, &info.description, &info.driver] {
                h.write(part.as_bytes());
                h.write(&[0]);
            }
        }
        h.finish()
    }

    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// llama.cpp's `--image-min-tokens` / `--image-max-tokens`. On the device, the activation
    /// buffers are made again for the new largest image; when the device cannot hold them the
    /// bounds still apply, the tower is back on the CPU and the error says why.
    pub fn set_token_bounds(
        &mut self,
        min: Option<u32>,
        max: Option<u32>,
    ) -> Result<(), VisionError> {
        self.cfg.set_token_bounds(min, max)?;
        if let Some(d) = self.device.take() {
            let gpu = d.gpu().clone();
            drop(d);
            self.offload(gpu)?;
        }
        Ok(())
    }

    /// Moves the encoder forward onto `gpu`: every weight uploaded and the activations sized for
    /// the largest image the token bounds allow, reserved in the device's memory budget. On an
    /// error (the budget or the binding limit cannot hold it, a weight type the kernels do not
    /// read) the tower runs on the CPU.
    pub fn offload(&mut self, gpu: std::sync::Arc<nextn_gpu::Gpu>) -> Result<(), VisionError> {
        self.device = None;
        self.device = Some(DeviceTower::new(gpu, self)?);
        Ok(())
    }

    /// Device memory the tower holds (weights and activations) when it runs on a device.
    pub fn device_bytes(&self) -> Option<u64> {
        self.device.as_ref().map(|d| d.bytes())
    }

    /// Back to the CPU: the device's weights and buffers are freed.
    pub fn release_device(&mut self) {
        self.device = None;
    }

    /// Whether encodes run on a device.
    pub fn on_device(&self) -> bool {
        self.device.is_some()
    }

    /// Deepstack layers: each adds `projection_dim` floats to every output embedding.
    pub fn n_deepstack(&self) -> usize {
        self.blocks.iter().filter(|b| b.deepstack.is_some()).count()
    }

    /// Floats per output embedding: the main path and every deepstack path side by side.
    pub fn embedding_width(&self) -> usize {
        self.cfg.projection_dim * (1 + self.n_deepstack())
    }

    /// Refuses a tower whose embeddings a text model of width `n_embd` without deepstack inputs
    /// cannot take.
    pub fn check_text_model(&self, n_embd: usize) -> Result<(), VisionError> {
        if self.cfg.projection_dim != n_embd {
            return Err(VisionError::ProjectionWidth {
                mmproj: self.cfg.projection_dim,
                model: n_embd,
            });
        }
        if self.n_deepstack() > 0 {
            return Err(VisionError::Deepstack {
                layers: self.n_deepstack(),
            });
        }
        Ok(())
    }

    /// Resizes `img` for this tower (8-bit: the tower normalises as it reads the patches).
    pub fn prepare(&self, img: &RgbImage) -> PreparedImage {
        prepare(img, &self.cfg)
    }

    /// Output tokens of a prepared image: `(columns, rows)` of merged patches.
    pub fn token_grid(&self, img: &PreparedImage) -> (usize, usize) {
        let side = self.cfg.patch_size * self.cfg.n_merge;
        (img.width() / side, img.height() / side)
    }

    /// Output tokens of an image of `width x height` pixels (its header's size, [`crate::image_size`]):
    /// the grid [`prepare`](Self::prepare) resizes it to, known before the image is decoded, so
    /// a prompt's length can be checked against a context without decoding its pictures.
    pub fn token_grid_for_size(&self, width: u32, height: u32) -> (usize, usize) {
        let side = self.cfg.patch_size * self.cfg.n_merge;
        let (w, h) = prepared_size(width, height, &self.cfg);
        (w as usize / side, h as usize / side)
    }

    /// The encoder forward of one prepared image.
    pub fn encode(
        &self,
        img: &PreparedImage,
        pool: &ThreadPool,
    ) -> Result<ImageEmbedding, VisionError> {
        self.encode_cancellable(img, pool, &|| false)
    }

    /// As [`encode`](Self::encode), asking `cancelled` before the patch embedding, after each
    /// block and before the merger, and giving up with [`VisionError::EncodeCancelled`] once it
    /// answers true: a request that went away stops its encode within one block's time.
    pub fn encode_cancellable(
        &self,
        img: &PreparedImage,
        pool: &ThreadPool,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<ImageEmbedding, VisionError> {
        let stop_if_cancelled = || {
            if cancelled() {
                Err(VisionError::EncodeCancelled)
            } else {
                Ok(())
            }
        };
        if let Some(d) = &self.device {
            return d.encode(self, img, &stop_if_cancelled);
        }
        stop_if_cancelled()?;
        let (nx, ny) = self.token_grid(img);
        let grid = Grid {
            nx: 2 * nx,
            ny: 2 * ny,
        };
        let n = grid.n();
        let e = self.cfg.n_embd;
        let mut x = self.patch.forward(img, grid, &self.cfg, pool)?;
        self.pos.add_to(&mut x, grid);
        if let Some(norm) = &self.pre_ln {
            x = crate::ops::layer_norm(pool, &x, norm, self.cfg.eps);
        }
        let heads = Heads {
            n_head: self.cfg.n_head,
            d_head: self.cfg.d_head,
            eps: self.cfg.eps,
        };
        let mut deepstack = Vec::new();
        for block in &self.blocks {
            block.forward(&mut x, grid, heads, pool)?;
            if let Some(ds) = &block.deepstack {
                deepstack.push(ds.forward(&x, n / 4, self.cfg.eps, pool)?);
            }
            stop_if_cancelled()?;
        }
        if let Some(norm) = &self.post_ln {
            x = crate::ops::layer_norm(pool, &x, norm, self.cfg.eps);
        }
        debug_assert_eq!(x.len(), n * e);
        let main = self.merger.forward(&x, n / 4, self.cfg.eps, pool)?;
        let proj = self.cfg.projection_dim;
        let width = self.embedding_width();
        let mut data = vec![0f32; nx * ny * width];
        for (t, row) in data.chunks_exact_mut(width).enumerate() {
            row[..proj].copy_from_slice(&main[t * proj..(t + 1) * proj]);
            for (j, ds) in deepstack.iter().enumerate() {
                row[(j + 1) * proj..(j + 2) * proj].copy_from_slice(&ds[t * proj..(t + 1) * proj]);
            }
        }
        Ok(ImageEmbedding {
            nx,
            ny,
            width,
            data,
        })
    }
}

fn optional_norm(b: &Binder, prefix: &str, n: usize) -> Result<Option<Norm>, VisionError> {
    if b.has(&format!("{prefix}.weight")) {
        Ok(Some(b.norm(prefix, n)?))
    } else {
        Ok(None)
    }
}

fn position_embed(b: &Binder, e: usize) -> Result<PositionEmbed, VisionError> {
    let name = "v.position_embd.weight";
    let n_pos = b
        .file
        .tensor(name)
        .and_then(|t| t.dims.get(1).copied())
        .ok_or_else(|| VisionError::MissingTensor {
            tensor: name.to_string(),
        })?;
    let side = (n_pos as f64).sqrt().round() as u64;
    if side == 0 || side * side != n_pos || side > 1024 {
        return Err(VisionError::TensorShape {
            tensor: name.to_string(),
            found: vec![e as u64, n_pos],
            expected: vec![e as u64, side.max(1) * side.max(1)],
        });
    }
    Ok(PositionEmbed {
        table: b.f32s(name, &[e as u64, n_pos])?,
        side: side as usize,
        n_embd: e,
    })
}
