//! Writes the reference tests' picture: `test_image WIDTH HEIGHT OUT.png`, smooth colour ramps
//! with a fixed pattern of noise (so resizing has edges to keep).

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(w), Some(h), Some(out)) = (
        args.get(1).and_then(|v| v.parse::<u32>().ok()),
        args.get(2).and_then(|v| v.parse::<u32>().ok()),
        args.get(3),
    ) else {
        eprintln!("usage: test_image WIDTH HEIGHT OUT.png");
        std::process::exit(2);
    };
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let noise = (state % 48) as u32;
        let r = (x * 255 / w.max(1) + noise).min(255) as u8;
        let g = (y * 255 / h.max(1) + noise / 2).min(255) as u8;
        let b = (((x / 8 + y / 8) % 2) * 160 + noise) as u8;
        image::Rgb([r, g, b])
    });
    if let Err(e) = img.save(out) {
        eprintln!("{e}");
        std::process::exit(1);
    }
}
