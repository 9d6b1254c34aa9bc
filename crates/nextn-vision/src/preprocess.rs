//! From file bytes to the tower's input: the header probe ([`image_size`]), decoding (PNG, JPEG,
//! WebP, GIF) within a memory bound that counts the RGB copy, and the resize into the
//! patch-and-merge grid within the token bounds, as llama.cpp's mtmd does for Qwen-VL projectors
//! (`mtmd_image_preprocessor_dyn_size`: smart resize, Pillow-style bicubic with black padding to
//! the target). The resized picture stays 8-bit RGB until it is encoded: normalisation
//! (`(x / 255 - mean) / std`) happens as the tower reads its patches, so a picture waiting for
//! the encoder takes 3 bytes a pixel rather than 12.

use std::io::Cursor;

use image::ImageDecoder;

use crate::config::VisionConfig;
use crate::error::VisionError;

/// Images with a longer side are refused before decoding allocates for them.
pub const MAX_IMAGE_SIDE: u32 = 16384;
/// Bytes decoding one image may hold at once: the decoder's own buffers and its output and, when
/// that output is not 8-bit RGB already, the RGB copy made from it (both are alive until the copy
/// is done).
pub const MAX_DECODE_BYTES: u64 = 1 << 30;

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

/// What an image file's header says about the decode, read without decoding any pixel.
struct Header {
    width: u32,
    height: u32,
    /// Bytes of the RGB copy made from the decoder's output (0 when that is 8-bit RGB already).
    rgb_copy: u64,
}

fn reader<'b>(
    bytes: &'b [u8],
    what: &str,
) -> Result<image::ImageReader<Cursor<&'b [u8]>>, VisionError> {
    let reader = image::ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| decode_error(what, e.to_string()))?;
    if reader.format().is_none() {
        return Err(decode_error(what, "not a PNG, JPEG, WebP or GIF file"));
    }
    Ok(reader)
}

fn decode_error(what: &str, reason: impl Into<String>) -> VisionError {
    VisionError::Decode {
        what: what.to_string(),
        reason: reason.into(),
    }
}

/// Reads the header and refuses what decoding would refuse by size: an empty image, a side over
/// [`MAX_IMAGE_SIDE`], or more than [`MAX_DECODE_BYTES`] for the decoded pixels and their RGB copy.
fn probe(bytes: &[u8], what: &str) -> Result<Header, VisionError> {
    let mut reader = reader(bytes, what)?;
    // The header alone, without the decoder's limits: an image over a bound is refused with its
    // size named rather than the decoder's generic limit error.
    reader.no_limits();
    let decoder = reader
        .into_decoder()
        .map_err(|e| decode_error(what, e.to_string()))?;
    let (width, height) = decoder.dimensions();
    let color = decoder.color_type();
    if width == 0 || height == 0 {
        return Err(VisionError::ImageEmpty {
            what: what.to_string(),
            width,
            height,
        });
    }
    if width > MAX_IMAGE_SIDE || height > MAX_IMAGE_SIDE {
        return Err(VisionError::ImageTooLarge {
            what: what.to_string(),
            width,
            height,
            max_side: MAX_IMAGE_SIDE,
        });
    }
    let pixels = u64::from(width) * u64::from(height);
    let decoded = decoder.total_bytes();
    let rgb_copy = if color == image::ColorType::Rgb8 {
        0
    } else {
        pixels * 3
    };
    let needed = decoded.saturating_add(rgb_copy);
    if needed > MAX_DECODE_BYTES {
        return Err(VisionError::DecodeMemory {
            what: what.to_string(),
            width,
            height,
            color: format!("{color:?}"),
            needed,
            limit: MAX_DECODE_BYTES,
        });
    }
    Ok(Header {
        width,
        height,
        rgb_copy,
    })
}

/// The size of a PNG, JPEG, WebP or GIF image from its header, without decoding its pixels; an
/// image that [`decode_image`] would refuse by its size (a side over [`MAX_IMAGE_SIDE`], more
/// than [`MAX_DECODE_BYTES`] to decode) is refused here already. `what` names the image in errors.
pub fn image_size(bytes: &[u8], what: &str) -> Result<(u32, u32), VisionError> {
    probe(bytes, what).map(|h| (h.width, h.height))
}

/// Decodes a PNG, JPEG, WebP or GIF (its first frame) into RGB; alpha is dropped, as
/// llama.cpp's loader does. `what` names the image in errors (a path, the request field). The
/// header is checked first ([`image_size`]); the decoder then runs within what is left of
/// [`MAX_DECODE_BYTES`] once the RGB copy is set aside.
pub fn decode_image(bytes: &[u8], what: &str) -> Result<RgbImage, VisionError> {
    let header = probe(bytes, what)?;
    let mut reader = reader(bytes, what)?;
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(MAX_IMAGE_SIDE);
    limits.max_image_height = Some(MAX_IMAGE_SIDE);
    // The decoder counts its output and its own buffers; the RGB copy comes after it, outside
    // its accounting, so its bytes are taken off the decoder's allowance.
    limits.max_alloc = Some(MAX_DECODE_BYTES.saturating_sub(header.rgb_copy));
    reader.limits(limits);
    let img = reader
        .decode()
        .map_err(|e| decode_error(what, e.to_string()))?;
    // No copy when the decoder's output is 8-bit RGB already.
    let rgb = img.into_rgb8();
    let (width, height) = rgb.dimensions();
    RgbImage::new(width, height, rgb.into_raw()).ok_or(VisionError::ImageEmpty {
        what: what.to_string(),
        width,
        height,
    })
}

/// An image resized for the tower: `width x height` 8-bit RGB pixels (interleaved, row-major),
/// both sides multiples of `patch * merge`. Normalisation to floats happens when the tower reads
/// the patches ([`crate::VisionTower::encode`]), so the same floats come out as if it had been
/// done here, while a waiting picture takes a quarter of the memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedImage {
    width: usize,
    height: usize,
    pixels: Vec<u8>,
}

impl PreparedImage {
    pub fn width(&self) -> usize {
        self.width
    }

    pub fn height(&self) -> usize {
        self.height
    }

    /// RGBRGB..., `width * height * 3` bytes.
    pub fn pixels(&self) -> &[u8] {
        &self.pixels
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

/// The size an image of `width x height` is resized to for a tower of configuration `cfg`.
pub(crate) fn prepared_size(width: u32, height: u32, cfg: &VisionConfig) -> (u32, u32) {
    let align = (cfg.patch_size * cfg.n_merge) as u32;
    let area = cfg.token_area() as u64;
    target_size(
        width,
        height,
        align,
        cfg.min_tokens as u64 * area,
        cfg.max_tokens as u64 * area,
    )
}

/// Resizes and pads `img` for a tower of configuration `cfg`.
pub fn prepare(img: &RgbImage, cfg: &VisionConfig) -> PreparedImage {
    let (tw, th) = prepared_size(img.width, img.height, cfg);
    let resized = if (tw, th) == (img.width, img.height) {
        img.clone()
    } else {
        resize_padded(img, tw, th)
    };
    PreparedImage {
        width: resized.width as usize,
        height: resized.height as usize,
        pixels: resized.pixels,
    }
}

/// The tower's input value of one 8-bit channel value `v` of channel `c`: `(v / 255 - mean) /
/// std`, in f32, as mtmd normalises.
#[inline]
pub(crate) fn normalised(v: u8, c: usize, cfg: &VisionConfig) -> f32 {
    let v = v as f32 / 255.0;
    (v - cfg.image_mean[c]) / cfg.image_std[c]
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::png_declaring;

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

    /// A lossless WebP whose header declares `width x height` pixels, with no image data after it.
    fn webp_claiming(width: u32, height: u32) -> Vec<u8> {
        // VP8L: signature, then 14 bits each of width - 1 and height - 1, alpha, version 0.
        let bits = (width - 1) | ((height - 1) << 14) | (1 << 28);
        let mut vp8l = vec![0x2f];
        vp8l.extend(bits.to_le_bytes());
        let mut riff = b"WEBP".to_vec();
        riff.extend(b"VP8L");
        riff.extend((vp8l.len() as u32).to_le_bytes());
        riff.extend(&vp8l);
        riff.push(0);
        let mut webp = b"RIFF".to_vec();
        webp.extend((riff.len() as u32).to_le_bytes());
        webp.extend(riff);
        webp
    }

    #[test]
    fn the_size_comes_from_the_header_alone() {
        let png = png_declaring(2048, 1536, 2, 8);
        assert!(png.len() < 100);
        assert_eq!(image_size(&png, "claim.png").unwrap(), (2048, 1536));
        // Its pixels are not there: decoding fails, reading the size did not need them.
        let e = decode_image(&png, "claim.png").unwrap_err();
        assert!(
            matches!(&e, VisionError::Decode { what, .. } if what == "claim.png"),
            "{e}"
        );
        let webp = webp_claiming(2048, 2048);
        assert!(webp.len() < 40);
        assert_eq!(image_size(&webp, "claim.webp").unwrap(), (2048, 2048));
        assert!(decode_image(&webp, "claim.webp").is_err());
        // A real picture: the header's size is the decoded size.
        let mut real = Vec::new();
        image::RgbaImage::from_pixel(37, 21, image::Rgba([9, 8, 7, 6]))
            .write_to(&mut Cursor::new(&mut real), image::ImageFormat::Png)
            .unwrap();
        let decoded = decode_image(&real, "real.png").unwrap();
        assert_eq!(image_size(&real, "real.png").unwrap(), (37, 21));
        assert_eq!((decoded.width(), decoded.height()), (37, 21));
        assert_eq!(decoded.pixels()[..3], [9, 8, 7]);
    }

    #[test]
    fn declared_sizes_over_the_bounds_are_refused_before_decoding() {
        // Tiny files declaring huge pictures: refused from the header, naming size and file.
        for (bytes, name) in [
            (png_declaring(20000, 20000, 2, 8), "huge.png"),
            (png_declaring(16385, 2, 6, 8), "wide.png"),
        ] {
            for e in [
                image_size(&bytes, name).unwrap_err(),
                decode_image(&bytes, name).unwrap_err(),
            ] {
                assert!(
                    matches!(
                        e,
                        VisionError::ImageTooLarge {
                            max_side: MAX_IMAGE_SIDE,
                            ..
                        }
                    ),
                    "{e}"
                );
                assert!(e.to_string().contains(name), "{e}");
            }
        }
        // 8-bit RGB comes out of the decoder as it is: 16384 x 16384 of it fits in 768 MiB.
        let rgb = png_declaring(16384, 16384, 2, 8);
        assert_eq!(image_size(&rgb, "rgb.png").unwrap(), (16384, 16384));
        // RGBA of 14000 x 14000 decodes to 784 MB, under the limit by itself; its RGB copy (588
        // MB) alive beside it is not, so it is refused from the header.
        let rgba = png_declaring(14000, 14000, 6, 8);
        let e = image_size(&rgba, "rgba.png").unwrap_err();
        match &e {
            VisionError::DecodeMemory {
                needed,
                limit,
                what,
                ..
            } => {
                assert_eq!(*needed, 14000 * 14000 * (4 + 3));
                assert_eq!(*limit, MAX_DECODE_BYTES);
                assert_eq!(what, "rgba.png");
            }
            other => panic!("{other}"),
        }
        const { assert!(14000u64 * 14000 * 4 < MAX_DECODE_BYTES) };
        assert!(matches!(
            decode_image(&rgba, "rgba.png"),
            Err(VisionError::DecodeMemory { .. })
        ));
        // 16-bit RGB: six bytes a pixel decoded, three more for the copy.
        let deep = png_declaring(12000, 12000, 2, 16);
        assert!(matches!(
            image_size(&deep, "deep.png"),
            Err(VisionError::DecodeMemory { needed, .. }) if needed == 12000 * 12000 * 9
        ));
        // A header with no pixels.
        assert!(matches!(
            image_size(&png_declaring(0, 5, 2, 8), "empty.png"),
            Err(VisionError::ImageEmpty { .. }) | Err(VisionError::Decode { .. })
        ));
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
