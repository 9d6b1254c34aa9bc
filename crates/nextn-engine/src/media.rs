//! Images in prompts, laid out as llama.cpp's mtmd lays them out: a prompt is text tokens with
//! image chunks between them, each image taking `nx * ny` rows of the context (one per merged
//! patch) and advancing the rotary position by `max(nx, ny)`.
//!
//! In the token list a scheduler [`crate::scheduler::Request`] carries, an image's rows hold
//! placeholder ids derived from a hash of its pixels (as llama-server keys its cache by image
//! hash): they lie outside every vocabulary, so they never match text, and the same picture gives
//! the same ids, so the prefix cache and slot reuse resume a conversation after it.

use std::sync::Arc;

use nextn_vision::{PreparedImage, RgbImage, VisionTower};

use crate::tokenizer::Tokenizer;

/// What the Qwen3.5 / Qwen3.6 chat templates render for an image content part.
pub const IMAGE_PLACEHOLDER: &str = "<|vision_start|><|image_pad|><|vision_end|>";
/// Where in rendered text an image's rows go (mtmd keeps the start and end markers as text).
pub const IMAGE_PAD: &str = "<|image_pad|>";
/// llama-server's media marker in `/completion` prompts (`multimodal_data`).
pub const MEDIA_MARKER: &str = "<__media__>";

/// Placeholder ids have this bit set; vocabularies are far smaller than 2^31.
const IMAGE_TOKEN_BIT: u32 = 1 << 31;

/// True for an image row's placeholder id.
pub fn is_image_token(id: u32) -> bool {
    id & IMAGE_TOKEN_BIT != 0
}

/// FNV-1a over the decoded pixels and the size: the identity of a picture.
pub fn image_hash(img: &RgbImage) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let size = [img.width().to_le_bytes(), img.height().to_le_bytes()].concat();
    for &b in size.iter().chain(img.pixels()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The placeholder ids of the `n` rows of the image with hash `hash`.
pub(crate) fn placeholder_ids(hash: u64, n: usize) -> impl Iterator<Item = u32> {
    (0..n as u64).map(move |k| {
        // splitmix64 of (hash, row): ids differ row by row and picture by picture.
        let mut z = hash ^ k.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        IMAGE_TOKEN_BIT | (z as u32 & !IMAGE_TOKEN_BIT)
    })
}

/// A decoded picture resized for the tower (8-bit RGB until it is encoded), with its token grid.
#[derive(Clone, Debug)]
pub struct ImageInput {
    image: Arc<PreparedImage>,
    nx: usize,
    ny: usize,
    hash: u64,
}

impl ImageInput {
    pub fn new(tower: &VisionTower, img: &RgbImage) -> ImageInput {
        let prepared = tower.prepare(img);
        let (nx, ny) = tower.token_grid(&prepared);
        ImageInput {
            image: Arc::new(prepared),
            nx,
            ny,
            hash: image_hash(img),
        }
    }

    /// Context rows the image takes.
    pub fn n_tokens(&self) -> usize {
        self.nx * self.ny
    }
}

/// One image of a prompt: its rows are `pos..pos + nx * ny`.
#[derive(Clone, Debug)]
pub struct PromptImage {
    pub pos: usize,
    pub nx: usize,
    pub ny: usize,
    pub hash: u64,
    pub image: Arc<PreparedImage>,
}

impl PromptImage {
    pub fn n_tokens(&self) -> usize {
        self.nx * self.ny
    }

    /// One past its last row.
    pub fn end(&self) -> usize {
        self.pos + self.n_tokens()
    }

    /// Rotary positions it advances (mtmd's `n_pos` of an M-RoPE image chunk).
    pub fn n_pos(&self) -> usize {
        self.nx.max(self.ny)
    }

    /// Whether the prompt's rows at its span hold its placeholder ids.
    pub fn matches(&self, prompt: &[u32]) -> bool {
        prompt.get(self.pos..self.end()).is_some_and(|rows| {
            rows.iter()
                .copied()
                .eq(placeholder_ids(self.hash, self.n_tokens()))
        })
    }
}

/// A prompt's tokens (image rows as placeholder ids) and its images in order.
#[derive(Clone, Debug, Default)]
pub struct MultimodalPrompt {
    pub tokens: Vec<u32>,
    pub images: Vec<PromptImage>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MediaError {
    #[error(
        "the prompt has {found} image placeholders ({IMAGE_PAD}) but {expected} images were given"
    )]
    PlaceholderCount { found: usize, expected: usize },
}

/// A prompt's text tokenized around its image placeholders, before any image is decoded: with
/// the images' token counts from their headers (`nextn_vision::image_size`,
/// `VisionTower::token_grid_for_size`) the prompt's length is known, so a prompt too long for
/// the context is refused without decoding a picture; [`PromptText::with_images`] then lays the
/// decoded images in.
#[derive(Clone, Debug)]
pub struct PromptText {
    /// The tokens of the text before the first image, then of the text after each image.
    pieces: Vec<Vec<u32>>,
}

impl PromptText {
    /// Tokenizes `text` around its [`IMAGE_PAD`]s, which must be `n_images`; the text around
    /// each (with the start and end markers) is tokenized piece by piece, as mtmd does.
    /// `parse_special` as in [`Tokenizer::encode`].
    pub fn tokenize(
        tokenizer: &Tokenizer,
        text: &str,
        parse_special: bool,
        n_images: usize,
    ) -> Result<PromptText, MediaError> {
        let pieces: Vec<&str> = text.split(IMAGE_PAD).collect();
        if pieces.len() != n_images + 1 {
            return Err(MediaError::PlaceholderCount {
                found: pieces.len() - 1,
                expected: n_images,
            });
        }
        let mut tokens = Vec::with_capacity(pieces.len());
        tokens.push(tokenizer.encode(pieces[0], parse_special));
        for piece in &pieces[1..] {
            tokens.push(tokenizer.encode_continuation(piece, parse_special));
        }
        Ok(PromptText { pieces: tokens })
    }

    /// Images the text has placeholders for.
    pub fn n_images(&self) -> usize {
        self.pieces.len() - 1
    }

    /// Tokens of the text alone.
    pub fn n_text_tokens(&self) -> usize {
        self.pieces.iter().map(Vec::len).sum()
    }

    /// The prompt with `images[k]` at the `k`-th placeholder.
    pub fn with_images(self, images: Vec<ImageInput>) -> Result<MultimodalPrompt, MediaError> {
        if images.len() != self.n_images() {
            return Err(MediaError::PlaceholderCount {
                found: self.n_images(),
                expected: images.len(),
            });
        }
        let mut pieces = self.pieces.into_iter();
        let mut out = MultimodalPrompt {
            tokens: pieces.next().unwrap_or_default(),
            images: Vec::with_capacity(images.len()),
        };
        for (img, piece) in images.into_iter().zip(pieces) {
            out.push_image(img);
            out.tokens.extend(piece);
        }
        Ok(out)
    }
}

impl MultimodalPrompt {
    /// Tokenizes `text` with `images[k]` at the `k`-th [`IMAGE_PAD`] ([`PromptText`] in one go).
    pub fn tokenize(
        tokenizer: &Tokenizer,
        text: &str,
        parse_special: bool,
        images: Vec<ImageInput>,
    ) -> Result<MultimodalPrompt, MediaError> {
        PromptText::tokenize(tokenizer, text, parse_special, images.len())?.with_images(images)
    }

    /// Appends an image's rows.
    pub fn push_image(&mut self, img: ImageInput) {
        let pos = self.tokens.len();
        self.tokens
            .extend(placeholder_ids(img.hash, img.n_tokens()));
        self.images.push(PromptImage {
            pos,
            nx: img.nx,
            ny: img.ny,
            hash: img.hash,
            image: img.image,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholder_ids_are_outside_vocabularies_and_follow_the_picture() {
        let a: Vec<u32> = placeholder_ids(1, 5).collect();
        let b: Vec<u32> = placeholder_ids(2, 5).collect();
        assert!(a.iter().chain(&b).all(|&t| is_image_token(t)));
        assert_ne!(a, b);
        assert_eq!(a, placeholder_ids(1, 5).collect::<Vec<_>>());
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert_eq!(distinct.len(), 5);
    }

    #[test]
    fn the_hash_sees_every_pixel_and_the_shape() {
        let img = |w, h, px: Vec<u8>| RgbImage::new(w, h, px).unwrap();
        let base = image_hash(&img(2, 1, vec![1, 2, 3, 4, 5, 6]));
        assert_ne!(base, image_hash(&img(2, 1, vec![1, 2, 3, 4, 5, 7])));
        assert_ne!(base, image_hash(&img(1, 2, vec![1, 2, 3, 4, 5, 6])));
        assert_eq!(base, image_hash(&img(2, 1, vec![1, 2, 3, 4, 5, 6])));
    }
}
