//! The fixture tower of the reference tests, written on demand (deterministic: same bytes each time).
#![allow(dead_code)]

use std::path::PathBuf;

/// Projection width of the fixture: the bundled model's embedding width.
pub const FIXTURE_DIM: usize = 256;

/// Writes the fixture mmproj (`synth_mmproj fixture 256`) under the target directory once per
/// process and returns its path.
pub fn fixture_mmproj(tag: &str) -> PathBuf {
    write_fixture(tag, &nextn_vision::synth::TowerSpec::fixture(FIXTURE_DIM))
}

/// Writes the mmproj of `spec` into a directory of this process and returns its path.
pub fn write_fixture(tag: &str, spec: &nextn_vision::synth::TowerSpec) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nextn-vision-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("fixture-mmproj.gguf");
    nextn_vision::synth::write_mmproj(spec, &path).unwrap();
    path
}

pub fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

/// What `tools/mtmd_image_ref.c embd` wrote.
pub struct MtmdEmbd {
    pub nx: usize,
    pub ny: usize,
    pub n_tokens: usize,
    pub n_pos: usize,
    pub width: usize,
    /// (t, y, x) per token.
    pub positions: Vec<[i32; 3]>,
    pub embd: Vec<f32>,
}

pub fn read_mtmd_embd(name: &str) -> MtmdEmbd {
    let bytes = std::fs::read(data(name)).unwrap();
    let i32s: Vec<i32> = bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let (nx, ny, n_tokens, n_pos, width) = (
        i32s[0] as usize,
        i32s[1] as usize,
        i32s[2] as usize,
        i32s[3] as usize,
        i32s[4] as usize,
    );
    let positions = (0..n_tokens)
        .map(|i| [i32s[5 + 3 * i], i32s[6 + 3 * i], i32s[7 + 3 * i]])
        .collect();
    let start = 5 + 3 * n_tokens;
    let embd = bytes[start * 4..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect::<Vec<_>>();
    assert_eq!(embd.len(), n_tokens * width);
    MtmdEmbd {
        nx,
        ny,
        n_tokens,
        n_pos,
        width,
        positions,
        embd,
    }
}
