//! Random-weight mmproj files with the metadata and tensor names llama.cpp's converter writes for
//! Qwen3.5 / Qwen3.6 (`qwen3vl_merger`): test fixtures for any trunk width, and the real tower's
//! shape for timing. The same spec and seed always give the same bytes. Also a PNG that is a
//! header only ([`png_declaring`]), for tests of what is decided before decoding.

use std::path::Path;

use nextn_gguf::{GgmlType, GgufError, GgufWriter, MetadataArray};
use nextn_quant::formats::{f32_to_bf16, f32_to_f16};

/// The shape of a synthesized tower.
#[derive(Clone, Debug)]
pub struct TowerSpec {
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub patch_size: usize,
    /// Side of the learned position-embedding grid (`sqrt(num_position_embeddings)`).
    pub pos_side: usize,
    /// The text model's embedding width.
    pub projection_dim: usize,
    /// Blocks whose output also feeds a deepstack merger.
    pub deepstack: Vec<usize>,
    /// Type of the matrices (F32, F16 or BF16); norms and biases are F32.
    pub weight_type: GgmlType,
    pub seed: u64,
}

impl TowerSpec {
    /// The small tower of the reference tests: 2 blocks of width 64, 4 heads, 8-pixel patches,
    /// a 6x6 position grid, F16 matrices.
    pub fn fixture(projection_dim: usize) -> TowerSpec {
        TowerSpec {
            n_embd: 64,
            n_ff: 128,
            n_layer: 2,
            n_head: 4,
            patch_size: 8,
            pos_side: 6,
            projection_dim,
            deepstack: Vec::new(),
            weight_type: GgmlType::F16,
            seed: 26,
        }
    }

    /// The Qwen3.5 / Qwen3.6 vision tower (`vision_config` of the released checkpoints: depth
    /// 27, hidden 1152, intermediate 4304, 16 heads, patch 16, merge 2, 2304 position
    /// embeddings), projecting to a text model of width `projection_dim`.
    pub fn qwen35(projection_dim: usize) -> TowerSpec {
        TowerSpec {
            n_embd: 1152,
            n_ff: 4304,
            n_layer: 27,
            n_head: 16,
            patch_size: 16,
            pos_side: 48,
            projection_dim,
            deepstack: Vec::new(),
            weight_type: GgmlType::F16,
            seed: 1,
        }
    }
}

/// splitmix64: a fixed, portable stream of numbers.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
}

struct Writer<'a> {
    w: GgufWriter<'a>,
    rng: Rng,
    ty: GgmlType,
}

impl Writer<'_> {
    fn values(&mut self, n: usize, centre: f32, spread: f32) -> Vec<f32> {
        (0..n).map(|_| centre + spread * self.rng.unit()).collect()
    }

    fn f32_tensor(&mut self, name: &str, dims: Vec<u64>, v: &[f32]) -> Result<(), GgufError> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.w.add_tensor(name, dims, GgmlType::F32, bytes)
    }

    fn matrix(&mut self, name: &str, dims: Vec<u64>) -> Result<(), GgufError> {
        let cols: u64 = dims[..dims.len() - 1].iter().product();
        let n = (cols * dims[dims.len() - 1]) as usize;
        // Uniform weights of variance 1/cols keep activations of order one through the blocks.
        let v = self.values(n, 0.0, (3.0 / cols as f32).sqrt());
        let bytes: Vec<u8> = match self.ty {
            GgmlType::F16 => v
                .iter()
                .flat_map(|&x| f32_to_f16(x).to_le_bytes())
                .collect(),
            GgmlType::BF16 => v
                .iter()
                .flat_map(|&x| f32_to_bf16(x).to_le_bytes())
                .collect(),
            _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        };
        self.w.add_tensor(name, dims, self.ty, bytes)
    }

    fn bias(&mut self, name: &str, n: usize) -> Result<(), GgufError> {
        let v = self.values(n, 0.0, 0.05);
        self.f32_tensor(name, vec![n as u64], &v)
    }

    fn linear(&mut self, prefix: &str, cols: usize, rows: usize) -> Result<(), GgufError> {
        self.matrix(&format!("{prefix}.weight"), vec![cols as u64, rows as u64])?;
        self.bias(&format!("{prefix}.bias"), rows)
    }

    fn norm(&mut self, prefix: &str, n: usize) -> Result<(), GgufError> {
        let w = self.values(n, 1.0, 0.2);
        self.f32_tensor(&format!("{prefix}.weight"), vec![n as u64], &w)?;
        self.bias(&format!("{prefix}.bias"), n)
    }
}

/// Writes the mmproj file of `spec` to `path`.
pub fn write_mmproj(spec: &TowerSpec, path: impl AsRef<Path>) -> Result<(), GgufError> {
    let mut w = GgufWriter::new();
    let file_type: u32 = match spec.weight_type {
        GgmlType::F16 => 1,
        GgmlType::BF16 => 32,
        _ => 0,
    };
    w.add_kv("general.architecture", "clip");
    w.add_kv("general.type", "mmproj");
    w.add_kv("general.name", "nextn synthetic vision tower");
    w.add_kv("general.file_type", file_type);
    w.add_kv("clip.has_vision_encoder", true);
    w.add_kv("clip.projector_type", "qwen3vl_merger");
    w.add_kv("clip.vision.projection_dim", spec.projection_dim as u32);
    w.add_kv(
        "clip.vision.image_size",
        (spec.pos_side * spec.patch_size) as u32,
    );
    w.add_kv("clip.vision.patch_size", spec.patch_size as u32);
    w.add_kv("clip.vision.embedding_length", spec.n_embd as u32);
    w.add_kv("clip.vision.feed_forward_length", spec.n_ff as u32);
    w.add_kv("clip.vision.block_count", spec.n_layer as u32);
    w.add_kv("clip.vision.attention.head_count", spec.n_head as u32);
    w.add_kv(
        "clip.vision.image_mean",
        MetadataArray::from(vec![0.5f32, 0.5, 0.5]),
    );
    w.add_kv(
        "clip.vision.image_std",
        MetadataArray::from(vec![0.5f32, 0.5, 0.5]),
    );
    w.add_kv("clip.use_gelu", true);
    w.add_kv("clip.vision.spatial_merge_size", 2u32);
    w.add_kv("clip.vision.attention.layer_norm_epsilon", 1e-6f32);
    let ds_flags: Vec<bool> = (0..spec.n_layer)
        .map(|i| spec.deepstack.contains(&i))
        .collect();
    w.add_kv(
        "clip.vision.is_deepstack_layers",
        MetadataArray::from(ds_flags),
    );
    let mut s = Writer {
        w,
        rng: Rng(spec.seed),
        ty: spec.weight_type,
    };
    let (e, p) = (spec.n_embd, spec.patch_size as u64);
    let merged = 4 * e;
    s.matrix("v.patch_embd.weight", vec![p, p, 3, e as u64])?;
    s.matrix("v.patch_embd.weight.1", vec![p, p, 3, e as u64])?;
    s.bias("v.patch_embd.bias", e)?;
    let n_pos = spec.pos_side * spec.pos_side;
    let pos = s.values(e * n_pos, 0.0, 0.5);
    s.f32_tensor("v.position_embd.weight", vec![e as u64, n_pos as u64], &pos)?;
    for il in 0..spec.n_layer {
        let pre = format!("v.blk.{il}");
        s.norm(&format!("{pre}.ln1"), e)?;
        s.linear(&format!("{pre}.attn_qkv"), e, 3 * e)?;
        s.linear(&format!("{pre}.attn_out"), e, e)?;
        s.norm(&format!("{pre}.ln2"), e)?;
        s.linear(&format!("{pre}.ffn_up"), e, spec.n_ff)?;
        s.linear(&format!("{pre}.ffn_down"), spec.n_ff, e)?;
        if spec.deepstack.contains(&il) {
            s.norm(&format!("v.deepstack.{il}.norm"), merged)?;
            s.linear(&format!("v.deepstack.{il}.fc1"), merged, merged)?;
            s.linear(
                &format!("v.deepstack.{il}.fc2"),
                merged,
                spec.projection_dim,
            )?;
        }
    }
    s.norm("v.post_ln", e)?;
    s.linear("mm.0", merged, merged)?;
    s.linear("mm.2", merged, spec.projection_dim)?;
    s.w.write_file(path)
}

/// A PNG of a few dozen bytes whose header declares `width x height` pixels of PNG colour type
/// `color` (2: RGB, 6: RGBA) at `depth` bits a sample, followed by an empty image data chunk:
/// whatever decoding it would take, nothing but the header is there. For tests that an image's
/// size is read, and refused, from its header alone.
pub fn png_declaring(width: u32, height: u32, color: u8, depth: u8) -> Vec<u8> {
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut chunk = |kind: &[u8], data: &[u8]| {
        png.extend((data.len() as u32).to_be_bytes());
        let body = [kind, data].concat();
        png.extend(&body);
        png.extend(crc32(&body).to_be_bytes());
    };
    let mut header = Vec::with_capacity(13);
    header.extend(width.to_be_bytes());
    header.extend(height.to_be_bytes());
    // Bit depth, colour type, deflate, adaptive filtering, no interlace.
    header.extend([depth, color, 0, 0, 0]);
    chunk(b"IHDR", &header);
    chunk(b"IDAT", &[]);
    chunk(b"IEND", &[]);
    png
}

/// CRC-32 (ISO-HDLC, as PNG chunks carry it), bit by bit.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}
