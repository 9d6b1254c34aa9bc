//! From file bytes to the tower's input: decoding (PNG, JPEG, WebP, GIF), the resize into the
//! patch-and-merge grid within the token bounds, and normalisation, as llama.cpp's mtmd does for
//! Qwen-VL projectors (`mtmd_image_preprocessor_dyn_size`: smart resize, Pillow-style bicubic
//! with black padding to the target, `(x / 255 - mean) / std`).

use std::io::Cursor;

use crate::config::VisionConfig;
use crate::error::VisionError;

/// Images with a longer side are refused before decoding allocates for them.
pub const MAX_IMAGE_SIDE: u32 = 16384;
/// Bytes the decoder may allocate for one image.
const MAX_DECODE_ALLOC: u64 = 1 << 30;

/// 8-bit RGB pixels, row-major, interleaved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RgbImage {
    width: u32,
    height: u32,
    pixels: Vec<u8>,
}

impl RgbImage {
    /// `pixels` holds `width * height * 3` bytes (RGBRGB...).
    pub fn new(width: u32, height: u32, pixels: Vec<u8>) -> Option<RgbImage> {
        (width > 0 && height > 0 && pixels.len() == width as usize * height as usize * 3).then_some(
            RgbImage {
                width,
                height,
                pixels,
            },
        )
    }

    pub fn width(&self) -> u32 {
        self.width
    }

    pub fn height(&self) -> u32 {
        self.height
    }

    pub fn pixels(&self) -> &[u8] {
        &self.pixels
    }

    fn pixel(&self, x: usize, y: usize) -> [u8; 3] {
        let i = (y * self.width as usize + x) * 3;
        [self.pixels[i], self.pixels[i + 1], self.pixels[i + 2]]
    }
}

/// Decodes a PNG, JPEG, WebP or GIF (its first frame) into RGB; alpha is dropped, as
/// llama.cpp's loader does. `what` names the image in errors (a path, "image 2 of the request").
pub fn decode_image(bytes: &[u8], what: &str) -> Result<RgbImage, VisionError> {
    let fail = |reason: String| VisionError::Decode {
        what: what.to_string(),
        reason,
    };
    let mut reader = image::ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| fail(e.to_string()))?;
    if reader.format().is_none() {
        return Err(fail("not a PNG, JPEG, WebP or GIF file".to_string()));
    }
    // The header alone, without the decoder's limits: an image over the bound is refused with
    // its size named rather than the decoder's generic limit error.
    reader.no_limits();
    let (w, h) = reader.into_dimensions().map_err(|e| fail(e.to_string()))?;
    if w > MAX_IMAGE_SIDE || h > MAX_IMAGE_SIDE {
        return Err(VisionError::ImageTooLarge {
            what: what.to_string(),
            width: w,
            height: h,
            max_side: MAX_IMAGE_SIDE,
        });
    }
    let mut reader = image::ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| fail(e.to_string()))?;
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(MAX_IMAGE_SIDE);
    limits.max_image_height = Some(MAX_IMAGE_SIDE);
    limits.max_alloc = Some(MAX_DECODE_ALLOC);
    reader.limits(limits);
    let img = reader.decode().map_err(|e| fail(e.to_string()))?;
    let rgb = img.to_rgb8();
    let (width, height) = rgb.dimensions();
    RgbImage::new(width, height, rgb.into_raw()).ok_or(VisionError::ImageEmpty {
        what: what.to_string(),
        width,
        height,
    })
}

/// An image resized and normalised for the tower: planar channels (R plane, G plane, B plane)
/// of `width x height` floats, both multiples of `patch * merge`.
#[derive(Clone, Debug)]
pub struct PreparedImage {
    width: usize,
    height: usize,
    planes: Vec<f32>,
}

impl PreparedImage {
    pub fn width(&self) -> usize {
        self.width
    }

    pub fn height(&self) -> usize {
        self.height
    }

    pub(crate) fn planes(&self) -> &[f32] {
        &self.planes
    }
}

/// The resized size of a `width x height` image: each side a multiple of `align`, the area within
/// `[min_pixels, max_pixels]`, the aspect ratio kept as far as the grid allows
/// (`img_tool::calc_size_preserved_ratio`, transformers' `smart_resize`, in f32 as there).
pub fn target_size(
    width: u32,
    height: u32,
    align: u32,
    min_pixels: u64,
    max_pixels: u64,
) -> (u32, u32) {
    let f = align as f32;
    let round_by = |x: f32| (x / f).round() as i64 * align as i64;
    let ceil_by = |x: f32| (x / f).ceil() as i64 * align as i64;
    let floor_by = |x: f32| (x / f).floor() as i64 * align as i64;
    let (wf, hf) = (width as f32, height as f32);
    let mut w_bar = (align as i64).max(round_by(wf));
    let mut h_bar = (align as i64).max(round_by(hf));
    if (h_bar * w_bar) as u64 > max_pixels {
        let beta = (hf * wf / max_pixels as f32).sqrt();
        h_bar = (align as i64).max(floor_by(hf / beta));
        w_bar = (align as i64).max(floor_by(wf / beta));
    } else if ((h_bar * w_bar) as u64) < min_pixels {
        let beta = (min_pixels as f32 / (hf * wf)).sqrt();
        h_bar = ceil_by(hf * beta);
        w_bar = ceil_by(wf * beta);
    }
    (w_bar as u32, h_bar as u32)
}

/// Resizes, pads and normalises `img` for a tower of configuration `cfg`.
pub fn prepare(img: &RgbImage, cfg: &VisionConfig) -> PreparedImage {
    let align = (cfg.patch_size * cfg.n_merge) as u32;
    let area = cfg.token_area() as u64;
    let (tw, th) = target_size(
        img.width,
        img.height,
        align,
        cfg.min_tokens as u64 * area,
        cfg.max_tokens as u64 * area,
    );
    let resized = if (tw, th) == (img.width, img.height) {
        img.clone()
    } else {
        resize_padded(img, tw, th)
    };
    normalise(&resized, cfg)
}

/// `img_tool::resize` with `PAD_CEIL`: scale to fit inside the target, bicubic, centred on black.
fn resize_padded(img: &RgbImage, tw: u32, th: u32) -> RgbImage {
    let scale = (tw as f32 / img.width as f32).min(th as f32 / img.height as f32);
    let nw = ((img.width as f32 * scale).ceil() as u32).min(tw);
    let nh = ((img.height as f32 * scale).ceil() as u32).min(th);
    let inner = resize_bicubic(img, nw, nh);
    let mut out = RgbImage {
        width: tw,
        height: th,
        pixels: vec![0; tw as usize * th as usize * 3],
    };
    let ox = ((tw - nw) / 2) as usize;
    let oy = ((th - nh) / 2) as usize;
    for y in 0..nh as usize {
        for x in 0..nw as usize {
            let p = inner.pixel(x, y);
            let i = ((y + oy) * tw as usize + x + ox) * 3;
            out.pixels[i..i + 3].copy_from_slice(&p);
        }
    }
    out
}

const PRECISION_BITS: u32 = 32 - 8 - 2;

fn bicubic_filter(x: f64) -> f64 {
    let x = x.abs();
    let a = -0.5;
    if x < 1.0 {
        ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * a
    } else {
        0.0
    }
}

/// Pillow's fixed-point filter coefficients for one axis: per output pixel the first input pixel,
/// the count, and `ksize` weights.
struct AxisFilter {
    ksize: usize,
    bounds: Vec<(usize, usize)>,
    weights: Vec<i32>,
}

fn axis_filter(in_size: usize, out_size: usize) -> AxisFilter {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = 2.0 * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut pre = vec![0f64; out_size * ksize];
    let mut bounds = Vec::with_capacity(out_size);
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let count = xmax.saturating_sub(xmin);
        let mut ww = 0.0;
        for x in 0..count {
            let w = bicubic_filter((x as f64 + xmin as f64 - center + 0.5) * ss);
            pre[xx * ksize + x] = w;
            ww += w;
        }
        if ww != 0.0 {
            for x in 0..count {
                pre[xx * ksize + x] /= ww;
            }
        }
        bounds.push((xmin, count));
    }
    let fxp = (1u64 << PRECISION_BITS) as f64;
    let weights = pre
        .iter()
        .map(|&w| (w * fxp + if w < 0.0 { -0.5 } else { 0.5 }) as i32)
        .collect();
    AxisFilter {
        ksize,
        bounds,
        weights,
    }
}

fn clip8(v: i32) -> u8 {
    (v >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Pillow's separable bicubic resample (a = -0.5), horizontal pass then vertical.
fn resize_bicubic(img: &RgbImage, tw: u32, th: u32) -> RgbImage {
    let (sw, sh) = (img.width as usize, img.height as usize);
    let (tw, th) = (tw as usize, th as usize);
    let mut cur = img.pixels.clone();
    let mut cur_w = sw;
    if tw != sw {
        let f = axis_filter(sw, tw);
        let mut out = vec![0u8; tw * sh * 3];
        for y in 0..sh {
            let src = &cur[y * sw * 3..(y + 1) * sw * 3];
            for (xx, &(xmin, count)) in f.bounds.iter().enumerate() {
                let k = &f.weights[xx * f.ksize..];
                let mut acc = [1i32 << (PRECISION_BITS - 1); 3];
                for x in 0..count {
                    for c in 0..3 {
                        acc[c] += src[(xmin + x) * 3 + c] as i32 * k[x];
                    }
                }
                for c in 0..3 {
                    out[(y * tw + xx) * 3 + c] = clip8(acc[c]);
                }
            }
        }
        cur = out;
        cur_w = tw;
    }
    if th != sh {
        let f = axis_filter(sh, th);
        let row = cur_w * 3;
        let mut out = vec![0u8; row * th];
        let mut acc = vec![0i32; row];
        for (yy, &(ymin, count)) in f.bounds.iter().enumerate() {
            acc.fill(1 << (PRECISION_BITS - 1));
            let k = &f.weights[yy * f.ksize..];
            for y in 0..count {
                let src = &cur[(ymin + y) * row..(ymin + y + 1) * row];
                for (a, &s) in acc.iter_mut().zip(src) {
                    *a += s as i32 * k[y];
                }
            }
            for (o, &a) in out[yy * row..(yy + 1) * row].iter_mut().zip(&acc) {
                *o = clip8(a);
            }
        }
        cur = out;
    }
    RgbImage {
        width: tw as u32,
        height: th as u32,
        pixels: cur,
    }
}

fn normalise(img: &RgbImage, cfg: &VisionConfig) -> PreparedImage {
    let n = img.width as usize * img.height as usize;
    let mut planes = vec![0f32; 3 * n];
    for i in 0..n {
        for c in 0..3 {
            let v = img.pixels[i * 3 + c] as f32 / 255.0;
            planes[c * n + i] = (v - cfg.image_mean[c]) / cfg.image_std[c];
        }
    }
    PreparedImage {
        width: img.width as usize,
        height: img.height as usize,
        planes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_size_keeps_the_grid_and_bounds() {
        // 1024x768 with 32-pixel tokens and at most 4096 tokens: already on the grid.
        assert_eq!(
            target_size(1024, 768, 32, 8 * 1024, 4096 * 1024),
            (1024, 768)
        );
        // Over the bound: scaled down to fit, sides floored to the grid.
        let (w, h) = target_size(4000, 3000, 32, 8 * 1024, 4096 * 1024);
        assert!(w % 32 == 0 && h % 32 == 0 && (w as u64 * h as u64) <= 4096 * 1024);
        // Under the bound: scaled up.
        let (w, h) = target_size(20, 10, 32, 8 * 1024, 4096 * 1024);
        assert!(w as u64 * h as u64 >= 8 * 1024, "{w}x{h}");
    }

    #[test]
    fn bicubic_of_a_flat_image_is_flat() {
        let img = RgbImage::new(7, 5, [10u8, 20, 30].repeat(35)).unwrap();
        let r = resize_bicubic(&img, 13, 3);
        assert_eq!((r.width, r.height), (13, 3));
        assert!(r.pixels.chunks(3).all(|p| p == [10, 20, 30]));
    }

    #[test]
    fn damaged_and_foreign_bytes_are_refused_with_the_name() {
        let e = decode_image(b"not an image at all", "x.bin").unwrap_err();
        assert!(e.to_string().contains("x.bin"), "{e}");
        let mut png = Vec::new();
        let img = image::RgbImage::from_pixel(4, 4, image::Rgb([1, 2, 3]));
        img.write_to(&mut Cursor::new(&mut png), image::ImageFormat::Png)
            .unwrap();
        assert_eq!(
            decode_image(&png, "ok.png").unwrap().pixels()[..3],
            [1, 2, 3]
        );
        let e = decode_image(&png[..png.len() / 2], "cut.png").unwrap_err();
        assert!(e.to_string().contains("cut.png"), "{e}");
    }
}
