//! `nextn bench --floor` on the bundled model with tiny settings: the bandwidth line, one floor
//! line per pass, prefill and time to first token, and the same numbers in the JSON report.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn bundled() -> PathBuf {
    nextn_testdata::bundled_model()
}

#[test]
fn bench_floor_reports_every_pass_against_the_bandwidth_floor() {
    let dir = std::env::temp_dir().join(format!("nextn-bench-floor-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let json_path = dir.join("floor.json");
    let out = Command::new(env!("CARGO_BIN_EXE_nextn"))
        .arg("bench")
        .arg("-m")
        .arg(bundled())
        .args([
            "-t",
            "2",
            "-n",
            "4",
            "--reps",
            "1",
            "--spec-draft-n-max",
            "0,1",
        ])
        .args(["--floor", "--floor-buffer-mib", "64", "--floor-passes", "2"])
        .args(["--floor-pp", "32", "--floor-ttft", "64"])
        .arg("--json")
        .arg(&json_path)
        .output()
        .expect("run nextn bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in [
        "bandwidth floor: streaming read",
        "plain decode",
        "verify 1 row",
        "verify 2 rows",
        "verify 3 rows",
        "verify 4 rows",
        "draft step (full vocab)",
        "prefill pp32:",
        "time to first token, 64-token prompt:",
    ] {
        assert!(stdout.contains(line), "no '{line}' in:\n{stdout}");
    }
    // Every pass line ends in a finite percentage.
    let pct_lines: Vec<&str> = stdout
        .lines()
        .filter(|l| l.trim_end().ends_with('%') && !l.contains("% of floor ="))
        .collect();
    assert_eq!(pct_lines.len(), 6, "{stdout}");
    for l in &pct_lines {
        let pct: f64 = l
            .split_whitespace()
            .last()
            .and_then(|w| w.trim_end_matches('%').parse().ok())
            .unwrap_or_else(|| panic!("no percentage in '{l}'"));
        assert!(pct.is_finite() && pct > 0.0, "{l}");
    }

    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).expect("json")).expect("parse");
    // The instruction set the kernels ran with, as a CPU of this architecture names it.
    let isa = report["kernels"].as_str().expect("kernels");
    assert!(
        ["scalar", "avx2", "avx512", "neon"]
            .iter()
            .any(|l| isa == *l || isa == format!("{l}+vnni")),
        "kernels: {isa}"
    );
    let floor = &report["floor"];
    let bw = floor["bandwidth_bytes_s"].as_f64().expect("bandwidth");
    let bw1 = floor["bandwidth_1_thread_bytes_s"]
        .as_f64()
        .expect("bandwidth");
    assert!(bw > 0.0 && bw.is_finite() && bw1 > 0.0 && bw1.is_finite());
    let passes = floor["passes"].as_array().expect("passes");
    assert_eq!(passes.len(), 6);
    let decode_bytes = passes[0]["bytes"].as_u64().expect("bytes");
    // The bundled file holds ~12 MB of tensors; a decode step reads most of them.
    assert!(
        decode_bytes > 4 << 20 && decode_bytes < 16 << 20,
        "{decode_bytes}"
    );
    for p in passes {
        let ms = p["ms"].as_f64().expect("ms");
        let pct = p["pct_of_floor"].as_f64().expect("pct");
        let floor_ms = p["floor_ms"].as_f64().expect("floor");
        assert!(ms > 0.0 && pct.is_finite() && pct > 0.0, "{p}");
        let expect = p["bytes"].as_u64().expect("bytes") as f64 / bw * 1e3;
        assert!((floor_ms - expect).abs() <= 1e-9 * expect.max(1.0), "{p}");
    }
    // Verify passes read the weights once: more rows add only activations and cache rows.
    let verify4 = passes[4]["bytes"].as_u64().expect("bytes");
    assert!(verify4 >= decode_bytes && verify4 < decode_bytes + decode_bytes / 50);
    assert!(floor["prefill"]["tok_s"].as_f64().expect("pp") > 0.0);
    assert!(floor["ttft"]["ms"].as_f64().expect("ttft") > 0.0);
    let _ = std::fs::remove_dir_all(&dir);
}
