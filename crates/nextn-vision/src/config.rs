//! The vision tower's hyper-parameters, read from an mmproj file's `clip.*` metadata as llama.cpp's
//! converter writes it for `Qwen3_5ForConditionalGeneration` (projector `qwen3vl_merger`).

use nextn_gguf::GgufFile;

use crate::error::{metadata, VisionError};

/// The only projector this crate implements.
pub const PROJECTOR_QWEN3VL: &str = "qwen3vl_merger";

/// Bounds on metadata values: anything outside is a broken file, refused before it sizes a buffer.
const MAX_EMBD: u32 = 16384;
const MAX_FF: u32 = 65536;
const MAX_LAYERS: u32 = 256;
const MAX_PATCH: u32 = 64;
/// llama.cpp's defaults for Qwen-VL projectors: between 8 and 4096 output tokens per image.
pub const DEFAULT_MIN_TOKENS: u32 = 8;
pub const DEFAULT_MAX_TOKENS: u32 = 4096;
/// Output tokens per image are capped here whatever the caller asks (the attention over the
/// patches of one image is quadratic in their count).
pub const MAX_TOKENS_LIMIT: u32 = 16384;

/// Hyper-parameters of a `qwen3vl_merger` vision tower.
#[derive(Clone, Debug, PartialEq)]
pub struct VisionConfig {
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub d_head: usize,
    pub eps: f32,
    pub patch_size: usize,
    /// Patches merged per side into one output token (2: 2x2 patches per token).
    pub n_merge: usize,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    /// Width of one output embedding of the main path (the text model's `n_embd`).
    pub projection_dim: usize,
    /// Output tokens per image: an image is resized to hold between these many.
    pub min_tokens: u32,
    pub max_tokens: u32,
}

impl VisionConfig {
    /// Reads and checks the metadata of an mmproj file.
    pub fn from_gguf(f: &GgufFile, path: &str) -> Result<VisionConfig, VisionError> {
        let arch = f
            .get_str("general.architecture")
            .ok()
            .flatten()
            .unwrap_or("");
        if arch != "clip" {
            return Err(VisionError::NotMmproj {
                path: path.to_string(),
                found: arch.to_string(),
            });
        }
        let proj = match get_str(f, "clip.projector_type")? {
            Some(p) => p,
            None => get_str(f, "clip.vision.projector_type")?.unwrap_or_default(),
        };
        if proj != PROJECTOR_QWEN3VL {
            return Err(VisionError::UnsupportedProjector { found: proj });
        }
        if get_bool(f, "clip.has_vision_encoder")? != Some(true) {
            return Err(metadata(
                "clip.has_vision_encoder",
                "must be true: the file has no vision encoder",
            ));
        }
        if get_bool(f, "clip.use_silu")? == Some(true)
            || get_bool(f, "clip.use_gelu")? != Some(true)
        {
            return Err(metadata(
                "clip.use_gelu",
                "qwen3vl_merger towers use GELU (clip.use_gelu true, clip.use_silu not set)",
            ));
        }
        let n_embd = bounded(f, "clip.vision.embedding_length", 1, MAX_EMBD)?;
        let n_ff = bounded(f, "clip.vision.feed_forward_length", 1, MAX_FF)?;
        let n_layer = bounded(f, "clip.vision.block_count", 1, MAX_LAYERS)?;
        let n_head = bounded(f, "clip.vision.attention.head_count", 1, MAX_EMBD)?;
        let projection_dim = bounded(f, "clip.vision.projection_dim", 1, MAX_EMBD * 4)?;
        let patch_size = bounded(f, "clip.vision.patch_size", 1, MAX_PATCH)?;
        let n_merge = match get_u32(f, "clip.vision.spatial_merge_size")? {
            None => 2,
            Some(2) => 2,
            Some(v) => {
                return Err(metadata(
                    "clip.vision.spatial_merge_size",
                    format!("{v}: the qwen3vl_merger graph merges 2x2 patches"),
                ))
            }
        };
        if !n_embd.is_multiple_of(n_head) {
            return Err(metadata(
                "clip.vision.attention.head_count",
                format!("{n_head} does not divide the embedding width {n_embd}"),
            ));
        }
        let d_head = n_embd / n_head;
        if let Some(hd) = get_u32(f, "clip.vision.attention.head_dim")? {
            if hd != d_head {
                return Err(metadata(
                    "clip.vision.attention.head_dim",
                    format!("{hd}, but embedding_length / head_count is {d_head}"),
                ));
            }
        }
        if !d_head.is_multiple_of(4) {
            return Err(metadata(
                "clip.vision.attention.head_count",
                format!("head width {d_head} is not a multiple of 4 (the 2D rotary sections)"),
            ));
        }
        let eps = get_f32(f, "clip.vision.attention.layer_norm_epsilon")?
            .ok_or_else(|| metadata("clip.vision.attention.layer_norm_epsilon", "missing"))?;
        if !(eps.is_finite() && eps > 0.0 && eps < 1.0) {
            return Err(metadata(
                "clip.vision.attention.layer_norm_epsilon",
                format!("{eps} is not in (0, 1)"),
            ));
        }
        let image_mean = triple(f, "clip.vision.image_mean", false)?;
        let image_std = triple(f, "clip.vision.image_std", true)?;
        Ok(VisionConfig {
            n_embd: n_embd as usize,
            n_ff: n_ff as usize,
            n_layer: n_layer as usize,
            n_head: n_head as usize,
            d_head: d_head as usize,
            eps,
            patch_size: patch_size as usize,
            n_merge,
            image_mean,
            image_std,
            projection_dim: projection_dim as usize,
            min_tokens: DEFAULT_MIN_TOKENS,
            max_tokens: DEFAULT_MAX_TOKENS,
        })
    }

    /// Pixels of one output token's square (`(patch * merge)^2`).
    pub fn token_area(&self) -> usize {
        let side = self.patch_size * self.n_merge;
        side * side
    }

    /// llama.cpp's `--image-min-tokens` / `--image-max-tokens`: the range of output tokens an
    /// image is resized into.
    pub fn set_token_bounds(
        &mut self,
        min: Option<u32>,
        max: Option<u32>,
    ) -> Result<(), VisionError> {
        let min = min.unwrap_or(self.min_tokens);
        let max = max.unwrap_or(self.max_tokens);
        if min == 0 || max == 0 || min > max || max > MAX_TOKENS_LIMIT {
            return Err(metadata(
                "image tokens",
                format!("min {min} / max {max}: need 1 <= min <= max <= {MAX_TOKENS_LIMIT}"),
            ));
        }
        self.min_tokens = min;
        self.max_tokens = max;
        Ok(())
    }
}

fn get_str(f: &GgufFile, key: &'static str) -> Result<Option<String>, VisionError> {
    f.get_str(key)
        .map(|v| v.map(str::to_string))
        .map_err(|e| metadata(key, e.to_string()))
}

fn get_bool(f: &GgufFile, key: &'static str) -> Result<Option<bool>, VisionError> {
    f.get_bool(key).map_err(|e| metadata(key, e.to_string()))
}

fn get_u32(f: &GgufFile, key: &'static str) -> Result<Option<u32>, VisionError> {
    f.get_u32(key).map_err(|e| metadata(key, e.to_string()))
}

fn get_f32(f: &GgufFile, key: &'static str) -> Result<Option<f32>, VisionError> {
    f.get_f32(key).map_err(|e| metadata(key, e.to_string()))
}

fn bounded(f: &GgufFile, key: &'static str, lo: u32, hi: u32) -> Result<u32, VisionError> {
    let v = get_u32(f, key)?.ok_or_else(|| metadata(key, "missing"))?;
    if v < lo || v > hi {
        return Err(metadata(key, format!("{v} is outside [{lo}, {hi}]")));
    }
    Ok(v)
}

fn triple(f: &GgufFile, key: &'static str, positive: bool) -> Result<[f32; 3], VisionError> {
    let arr = f
        .get_array(key)
        .map_err(|e| metadata(key, e.to_string()))?
        .ok_or_else(|| metadata(key, "missing"))?;
    let v = arr
        .as_f32_vec()
        .ok_or_else(|| metadata(key, "not an array of floats"))?;
    if v.len() < 3 {
        return Err(metadata(key, format!("{} elements, need 3", v.len())));
    }
    let out = [v[0], v[1], v[2]];
    if out
        .iter()
        .any(|x| !x.is_finite() || (positive && *x <= 0.0))
    {
        return Err(metadata(
            key,
            format!(
                "{out:?} is not finite{}",
                if positive { " and positive" } else { "" }
            ),
        ));
    }
    Ok(out)
}
