//! Writes a random-weight mmproj file: `synth_mmproj fixture|fixture-f32|qwen35 PROJECTION_DIM OUT.gguf`.
//! `fixture` is the small tower of the reference tests (`tests/common/mod.rs`), `qwen35` the
//! real Qwen3.5 / Qwen3.6 tower shape (for timing).

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        eprintln!("usage: synth_mmproj fixture|fixture-f32|qwen35 PROJECTION_DIM OUT.gguf");
        std::process::exit(2);
    }
    let Ok(dim) = args[2].parse::<usize>() else {
        eprintln!("PROJECTION_DIM must be a number");
        std::process::exit(2);
    };
    let spec = match args[1].as_str() {
        "fixture" => nextn_vision::synth::TowerSpec::fixture(dim),
        "fixture-f32" => nextn_vision::synth::TowerSpec {
            weight_type: nextn_gguf::GgmlType::F32,
            ..nextn_vision::synth::TowerSpec::fixture(dim)
        },
        "qwen35" => nextn_vision::synth::TowerSpec::qwen35(dim),
        other => {
            eprintln!("unknown preset {other}");
            std::process::exit(2);
        }
    };
    if let Err(e) = nextn_vision::synth::write_mmproj(&spec, &args[3]) {
        eprintln!("{e}");
        std::process::exit(1);
    }
}
