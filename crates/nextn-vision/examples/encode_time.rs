//! Times the encode of one image: `encode_time MMPROJ IMAGE THREADS REPEAT [OUT.f32]`; prints the token
//! grid and each encode's milliseconds (preprocessing excluded, as llama.cpp's
//! "image slice encoded in" and `tools/mtmd_image_ref.c` measure). With OUT.f32, the last
//! encode's embeddings are written there as raw little-endian f32.

use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 && args.len() != 6 {
        eprintln!("usage: encode_time MMPROJ IMAGE THREADS REPEAT [OUT.f32]");
        std::process::exit(2);
    }
    let run = || -> Result<(), Box<dyn std::error::Error>> {
        let tower = nextn_vision::VisionTower::load(&args[1])?;
        let img = nextn_vision::decode_image(&std::fs::read(&args[2])?, &args[2])?;
        let pool = nextn_quant::kernels::ThreadPool::new(args[3].parse()?);
        let prepared = tower.prepare(&img);
        for r in 0..args[4].parse::<usize>()? {
            let t = Instant::now();
            let emb = tower.encode(&prepared, &pool)?;
            if let Some(out) = args.get(5) {
                let bytes: Vec<u8> = emb.data.iter().flat_map(|v| v.to_le_bytes()).collect();
                std::fs::write(out, bytes)?;
            }
            println!(
                "encode {r}: {}x{} tokens of {}: {:.1} ms",
                emb.nx,
                emb.ny,
                emb.width,
                t.elapsed().as_secs_f64() * 1e3
            );
        }
        Ok(())
    };
    if let Err(e) = run() {
        eprintln!("{e}");
        std::process::exit(1);
    }
}
