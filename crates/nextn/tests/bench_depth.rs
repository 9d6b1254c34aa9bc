//! `nextn bench -d` (passes timed at a context depth), `--depth-fill` (depths reached by copying
//! computed positions) and `--expert-union` (verify cost by the experts rows share), through the
//! binary on small models.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn bundled() -> PathBuf {
    nextn_testdata::bundled_model()
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nextn-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn bench(model: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nextn"))
        .arg("bench")
        .arg("-m")
        .arg(model)
        .args(["-t", "2", "--reps", "2"])
        .args(args)
        .output()
        .expect("run nextn bench")
}

fn json_of(out: &Output, path: &Path) -> Value {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&std::fs::read(path).expect("json written")).expect("json")
}

#[test]
fn depth_runs_time_every_pass_with_a_real_or_a_filled_prefill() {
    let dir = temp_dir("bench-depth");
    let real = dir.join("real.json");
    let out = bench(
        &bundled(),
        &[
            "-c",
            "256",
            "-d",
            "40,120",
            "--json",
            real.to_str().unwrap(),
        ],
    );
    let v = json_of(&out, &real);
    let depths = v["depths"].as_array().expect("depths");
    assert_eq!(depths.len(), 2);
    for (d, want) in depths.iter().zip([40, 120]) {
        assert_eq!(d["depth"], want);
        assert_eq!(
            d["computed_positions"], want,
            "a real prefill computes them all"
        );
        assert!(d["decode_ms"].as_f64().unwrap() > 0.0);
        assert_eq!(d["verify_ms"].as_array().unwrap().len(), 4);
        assert!(d["draft_ms"].as_f64().unwrap() > 0.0);
        // The prefill with the head's pass over the same rows is slower than without it, and
        // the head's share is a fraction of the whole.
        let (plain, with_head) = (
            d["prefill_tokens_per_s"].as_f64().unwrap(),
            d["prefill_with_head_tokens_per_s"].as_f64().unwrap(),
        );
        assert!(
            with_head > 0.0 && with_head < plain,
            "{plain} vs {with_head}"
        );
        let share = d["head_share_of_prefill"].as_f64().unwrap();
        assert!(share > 0.0 && share < 1.0, "head share {share}");
    }

    let filled = dir.join("filled.json");
    let out = bench(
        &bundled(),
        &[
            "-c",
            "256",
            "-d",
            "200",
            "--depth-fill",
            "48",
            "--json",
            filled.to_str().unwrap(),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let v = json_of(&out, &filled);
    let d = &v["depths"][0];
    assert_eq!(d["depth"], 200);
    assert_eq!(d["computed_positions"], 48);
    assert!(d["decode_ms"].as_f64().unwrap() > 0.0);
    assert!(
        stderr.contains("filled with copies of the 48 computed positions"),
        "{stderr}"
    );

    // A depth the context cannot hold is refused, naming the flag to change.
    let out = bench(
        &bundled(),
        &["-c", "128", "-d", "200", "--depth-fill", "48"],
    );
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("give a larger -c"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // --depth-fill means nothing without -d.
    let out = bench(&bundled(), &["--depth-fill", "48"]);
    assert!(!out.status.success());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn expert_union_gives_the_verify_cost_for_every_union_size() {
    // A dense model has no experts: a clear refusal.
    let out = bench(&bundled(), &["--expert-union"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("needs a mixture-of-experts model"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let Some(golden) = nextn_testdata::shared("golden") else {
        return;
    };
    // 8 experts, 2 per row, with a NextN head.
    let moe = golden.join("q35moe-a/q35moe-a-Q8_0.gguf");
    let dir = temp_dir("bench-union");
    let path = dir.join("union.json");
    let out = bench(
        &moe,
        &[
            "--expert-union",
            "--floor-verify-rows",
            "3",
            "--json",
            path.to_str().unwrap(),
        ],
    );
    let v = json_of(&out, &path);
    let u = &v["expert_union"];
    assert_eq!(u["experts_per_row"], 2);
    assert_eq!(u["n_expert"], 8);
    let curve = u["curve"].as_array().expect("curve");
    // 2 rows: unions 2..=4; 3 rows: 2..=6.
    let points: Vec<(u64, u64)> = curve
        .iter()
        .map(|c| (c["rows"].as_u64().unwrap(), c["union"].as_u64().unwrap()))
        .collect();
    let want: Vec<(u64, u64)> = (2..=4)
        .map(|u| (2, u))
        .chain((2..=6).map(|u| (3, u)))
        .collect();
    assert_eq!(points, want);
    for c in curve {
        assert!(c["experts_ms"].as_f64().unwrap() > 0.0);
        assert!(c["verify_ms"].as_f64().unwrap() > 0.0);
        assert!(c["projected_speedup"].as_f64().unwrap() > 0.0);
        assert_eq!(
            c["n_max"].as_u64().unwrap(),
            c["rows"].as_u64().unwrap() - 1
        );
    }
    // The measured passes route by the model's own router: each row reads its 2 experts.
    let measured = u["measured_union_per_layer"].as_array().unwrap();
    assert_eq!(measured[0].as_f64().unwrap(), 2.0);
    for m in measured {
        let m = m.as_f64().unwrap();
        assert!((2.0..=6.0).contains(&m), "{m}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
