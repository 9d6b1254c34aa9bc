//! The real `nextn` binary on the device backend (Mesa's lavapipe in CI): the device list, and
//! `run -dev Vulkan0` printing what the CPU prints, with drafting, at the CPU's acceptance.

mod serve_common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::json;
use serve_common::Server;

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_nextn"));
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        c.env("XDG_RUNTIME_DIR", std::env::temp_dir());
    }
    c
}

fn bundled() -> PathBuf {
    nextn_testdata::bundled_model()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The first software Vulkan adapter `--list-devices` names, or `None` (skipped outside CI).
fn lavapipe() -> Option<String> {
    let o = bin().arg("--list-devices").output().expect("run nextn");
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert!(out.starts_with("Available devices:"), "{out}");
    let found = out
        .lines()
        .filter(|l| l.contains("llvmpipe"))
        .find_map(|l| l.trim().split(':').next().map(str::to_string));
    if found.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "no lavapipe adapter under CI=true (mesa-vulkan-drivers):\n{out}"
        );
        eprintln!("skipped: no lavapipe adapter");
    }
    found
}

/// `bench` (its other arguments given) over `prompts`: its `--json` report and its stderr.
fn bench_report(mut bench: Command, prompts: &Path, out: &Path) -> (serde_json::Value, String) {
    let o = bench
        .arg("--prompts")
        .arg(prompts)
        .arg("--json")
        .arg(out)
        .output()
        .expect("run nextn bench");
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    let v = serde_json::from_str(&std::fs::read_to_string(out).expect("json")).expect("parse");
    (v, err)
}

fn run_json(args: &[&str]) -> (serde_json::Value, String) {
    let o: Output = bin().args(args).output().expect("run nextn");
    assert!(o.status.success(), "{}", text(&o.stderr));
    (
        serde_json::from_str(&text(&o.stdout)).expect("json"),
        text(&o.stderr),
    )
}

#[test]
fn list_devices_names_the_software_vulkan_device() {
    let Some(name) = lavapipe() else { return };
    assert!(name.starts_with("Vulkan"), "{name}");
}

#[test]
fn run_on_the_device_prints_the_cpu_text_with_drafting() {
    let Some(dev) = lavapipe() else { return };
    let m = bundled();
    let m = m.to_str().unwrap();
    let prompt = "import os\nimport sys\n\n\ndef main():\n";
    let run = |extra: &[&str]| {
        let mut a: Vec<&str> = vec![
            "run", "-m", m, "-p", prompt, "-n", "40", "--temp", "0", "--json", "-c", "256",
        ];
        a.extend_from_slice(extra);
        run_json(&a)
    };
    // The tiny model decodes this prompt into a loop: a text on which the device and the CPU
    // agree token for token, so their drafting can be compared step for step.
    let (cpu_spec, _) = run(&["-dev", "none", "--spec-type", "nextn"]);
    let (gpu_plain, err) = run(&["-dev", &dev]);
    assert!(
        err.contains(&format!("on {dev}:")),
        "the load line names the device: {err}"
    );
    assert!(err.contains("MiB of weights"), "{err}");
    let (gpu_spec, _) = run(&["-dev", &dev, "--spec-type", "nextn"]);
    assert_eq!(gpu_spec["tokens"], gpu_plain["tokens"]);
    assert_eq!(gpu_spec["text"], cpu_spec["text"]);
    let rate = |v: &serde_json::Value| v["spec"]["acceptance_rate"].as_f64().expect("rate");
    let (a_cpu, a_gpu) = (rate(&cpu_spec), rate(&gpu_spec));
    assert!(
        (a_cpu - a_gpu).abs() <= 0.01,
        "draft acceptance: CPU {a_cpu}, device {a_gpu}"
    );
    assert!(gpu_spec["spec"]["draft_n"].as_u64().unwrap() > 0);

    // Varied text (a repetition penalty): greedy drafting on the device gives plain decoding's
    // tokens at every draft depth.
    let varied = |extra: &[&str]| {
        let mut a: Vec<&str> = vec![
            "run",
            "-m",
            m,
            "-p",
            prompt,
            "-n",
            "40",
            "--temp",
            "0",
            "--json",
            "-c",
            "256",
            "--repeat-penalty",
            "1.3",
            "-dev",
            &dev,
        ];
        a.extend_from_slice(extra);
        run_json(&a).0
    };
    let plain = varied(&[]);
    for n_max in ["1", "2", "4"] {
        let spec = varied(&["--spec-type", "nextn", "--spec-draft-n-max", n_max]);
        assert_eq!(spec["tokens"], plain["tokens"], "n_max {n_max}");
    }
}

/// The head's teacher-forced agreement with the target (what greedy drafting accepts at the first
/// position) on the same tokens is the CPU's within 0.01 on the device.
#[test]
fn head_agreement_on_the_device_is_the_cpus() {
    let Some(dev) = lavapipe() else { return };
    let m = bundled();
    let m = m.to_str().unwrap();
    let source =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cmd/run.rs"))
            .unwrap();
    let prompt: String = source.lines().take(80).collect::<Vec<_>>().join("\n");
    let argmax = |d: &str, mtp: bool| -> Vec<u64> {
        let mut a = vec!["logits", "-m", m, "-p", &prompt, "--json", "-dev", d];
        if mtp {
            a.push("--mtp");
        }
        let (v, _) = run_json(&a);
        v["positions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["argmax"].as_u64().unwrap())
            .collect()
    };
    let agreement = |d: &str| {
        let (t, h) = (argmax(d, false), argmax(d, true));
        assert!(t.len() > 1000, "{} positions", t.len());
        t.iter().zip(&h).filter(|(a, b)| a == b).count() as f64 / t.len() as f64
    };
    let (cpu, gpu) = (agreement("none"), agreement(&dev));
    assert!(
        (cpu - gpu).abs() <= 0.01,
        "head agreement: CPU {cpu}, device {gpu}"
    );
}

#[test]
fn device_flags_are_checked() {
    let m = bundled();
    let m = m.to_str().unwrap();
    let o = bin()
        .args(["run", "-m", m, "-p", "x", "-n", "1", "-dev", "Vulkan9"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("Vulkan9"), "{}", text(&o.stderr));
    for (flag, value) in [("-ngl", "-1"), ("-ngl", "half"), ("--fit", "maybe")] {
        let o = bin()
            .args(["run", "-m", m, "-p", "x", "-n", "1", flag, value])
            .output()
            .unwrap();
        assert!(!o.status.success(), "{flag} {value}");
        let err = text(&o.stderr);
        assert!(err.contains(&format!("{flag} {value}")), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// The model split between the CPU and the device as llama.cpp's `-ngl N` splits it (1: the
/// output alone, 2: and the NextN block, more: trunk layers from the last): the CPU's text, greedy
/// drafting giving plain decoding's tokens in each placement, and a load line naming each side.
#[test]
fn a_model_split_by_ngl_prints_the_cpu_text() {
    let Some(dev) = lavapipe() else { return };
    let m = bundled();
    let m = m.to_str().unwrap();
    let prompt = "import os\nimport sys\n\n\ndef main():\n";
    let run = |extra: &[&str]| {
        let mut a: Vec<&str> = vec![
            "run", "-m", m, "-p", prompt, "-n", "32", "--temp", "0", "--json", "-c", "256",
        ];
        a.extend_from_slice(extra);
        run_json(&a)
    };
    let (cpu, _) = run(&["-dev", "none"]);
    for (ngl, line) in [
        ("1", "layers 0-7, the NextN head on the CPU; the output on"),
        ("2", "layers 0-7 on the CPU; the output, the NextN head on"),
        (
            "5",
            "layers 0-4 on the CPU; layers 5-7, the output, the NextN head on",
        ),
    ] {
        let (plain, err) = run(&["-dev", &dev, "-ngl", ngl]);
        assert!(err.contains(line), "-ngl {ngl}: {err}");
        assert!(err.contains(&format!("(-ngl {ngl})")), "-ngl {ngl}: {err}");
        assert_eq!(plain["text"], cpu["text"], "-ngl {ngl}");
        for n_max in ["1", "3"] {
            let (spec, _) = run(&[
                "-dev",
                &dev,
                "-ngl",
                ngl,
                "--spec-type",
                "nextn",
                "--spec-draft-n-max",
                n_max,
                "--repeat-penalty",
                "1.3",
            ]);
            let (plain, _) = run(&["-dev", &dev, "-ngl", ngl, "--repeat-penalty", "1.3"]);
            assert_eq!(spec["tokens"], plain["tokens"], "-ngl {ngl}, n_max {n_max}");
            assert!(spec["spec"]["draft_n"].as_u64().unwrap() > 0);
        }
    }
}

/// Without -ngl, a model over the device's memory budget is fitted to it: the load says what went
/// to the CPU and why, and the run gives the CPU's text; `--fit off` refuses it as before.
#[test]
fn a_model_over_the_device_budget_is_fitted_to_it() {
    let Some(dev) = lavapipe() else { return };
    let m = bundled();
    let m = m.to_str().unwrap();
    let prompt = "import os\nimport sys\n\n\ndef main():\n";
    let args = [
        "run", "-m", m, "-p", prompt, "-n", "24", "--temp", "0", "--json", "-c", "256",
    ];
    let (cpu, _) = run_json(&[&args[..], &["-dev", "none"]].concat());
    let o = bin()
        .env("NEXTN_GPU_MEMORY_MIB", "9")
        .args([&args[..], &["-dev", &dev, "--spec-type", "nextn"]].concat())
        .output()
        .unwrap();
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("fit: the model and one sequence's caches"),
        "{err}"
    );
    assert!(err.contains("on the CPU;"), "{err}");
    assert!(err.contains("fitted to the device"), "{err}");
    let fitted: serde_json::Value = serde_json::from_str(&text(&o.stdout)).expect("json");
    assert_eq!(fitted["text"], cpu["text"]);
    let o = bin()
        .env("NEXTN_GPU_MEMORY_MIB", "9")
        .args([&args[..], &["-dev", &dev, "--fit", "off"]].concat())
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = text(&o.stderr);
    assert!(err.contains("device memory"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// With fitting off, a context whose caches the device cannot hold is refused at load with what
/// did not fit and how many bytes it asked for: past the largest buffer, and past a device memory
/// budget. (With fitting on, the layers that do not fit run on the CPU: the test above.)
#[test]
fn a_context_the_device_cannot_hold_is_refused_at_load() {
    let Some(dev) = lavapipe() else { return };
    let m = bundled();
    let m = m.to_str().unwrap();
    let run = |ctx: &str, budget: Option<&str>| {
        let mut c = bin();
        if let Some(b) = budget {
            c.env("NEXTN_GPU_MEMORY_MIB", b);
        }
        let o = c
            .args([
                "run", "-m", m, "-p", "x", "-n", "1", "-dev", &dev, "-c", ctx, "--fit", "off",
            ])
            .output()
            .unwrap();
        assert!(!o.status.success(), "context {ctx} was accepted");
        text(&o.stderr)
    };
    // 2M positions of one f16 kv head of 256: 1024000000 bytes of keys, over lavapipe's 128 MiB.
    let err = run("2000000", None);
    assert!(
        err.contains("the attention keys at a context of 2000000 positions")
            && err.contains("needs a buffer of 1024000000 bytes"),
        "{err}"
    );
    // 12 MiB hold the weights (about 12.5 MB) but not a 4096-position sequence beside them.
    let err = run("4096", Some("13"));
    assert!(err.contains("context 4096 on"), "{err}");
    assert!(err.contains("bytes of device memory"), "{err}");
    assert!(
        err.contains("of the 13631488 bytes the device may use"),
        "{err}"
    );
    let err = run("256", Some("lots"));
    assert!(err.contains("NEXTN_GPU_MEMORY_MIB"), "{err}");
}

/// A request whose caches do not fit beside another's gets a 500 naming what did not fit; the
/// server keeps serving, and once the first request is done the next one gets its caches.
#[test]
fn a_request_without_room_on_the_device_is_refused_and_the_server_goes_on() {
    let Some(dev) = lavapipe() else { return };
    // Weights and head about 12.5 MB; a slot of 1024 positions about 6 MiB (two attention
    // layers' KV, six delta-net states, the head's KV): 22 MiB hold one slot, not two.
    let mut s = Server::start_with_env(
        &[
            "-dev",
            &dev,
            "-np",
            "2",
            "-c",
            "2048",
            "--spec-type",
            "nextn",
        ],
        &[("NEXTN_GPU_MEMORY_MIB", "22")],
    );
    let long = json!({"prompt": "import os\n", "max_tokens": 300, "temperature": 0,
                      "stream": true, "ignore_eos": true});
    let (status, mut first) = s.open_stream("/v1/completions", &long);
    assert_eq!(status, 200);
    assert!(first.next_event().is_some(), "the first request streams");
    let short = json!({"prompt": "def main():\n", "max_tokens": 8, "temperature": 0});
    let refused = s.post("/v1/completions", &short);
    assert_eq!(refused.status, 500, "{}", refused.text());
    let why = refused.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(why.contains("no room for this request's caches"), "{why}");
    assert!(why.contains("bytes of device memory"), "{why}");
    while first.next_event().is_some() {}
    let served = s.post("/v1/completions", &short);
    assert_eq!(served.status, 200, "{}", served.text());
    assert!(!served.json()["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .is_empty());
    s.terminate(std::time::Duration::from_secs(20));
}

/// `bench --device-profile` times every dispatch: the JSON lists the kernels the passes ran, their
/// dispatch counts add up to the dispatches counted, each with the workgroups it launches, the bytes
/// it moves and its achieved bandwidth beside the device's copy bandwidth; on the CPU the flag is
/// refused.
#[test]
fn device_profile_accounts_for_every_dispatch() {
    let Some(dev) = lavapipe() else { return };
    let m = bundled();
    let m = m.to_str().unwrap();
    let json = std::env::temp_dir().join(format!("nextn-profile-{}.json", std::process::id()));
    let o = bin()
        .args([
            "bench",
            "-m",
            m,
            "-dev",
            &dev,
            "-n",
            "4",
            "--spec-draft-n-max",
            "0",
        ])
        .arg("--device-profile")
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run nextn");
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("device time by kernel"), "{err}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("parse");
    let _ = std::fs::remove_file(&json);
    let run = &v["runs"][0]["device"];
    let kernels = run["kernels"].as_array().expect("kernels");
    let names: Vec<&str> = kernels
        .iter()
        .filter_map(|k| k["kernel"].as_str())
        .collect();
    assert!(names.iter().any(|n| n.starts_with("matvec")), "{names:?}");
    assert!(names.contains(&"norm_quant"), "{names:?}");
    let counted: u64 = kernels
        .iter()
        .map(|k| k["dispatches"].as_u64().unwrap())
        .sum();
    assert_eq!(counted, run["dispatches"].as_u64().unwrap());
    // Each kernel's bytes moved and achieved bandwidth, against the device's copy bandwidth.
    for k in kernels {
        assert!(k["bytes"].as_u64().unwrap() > 0, "{k}");
        assert!(k["bytes_per_second"].as_f64().unwrap() > 0.0, "{k}");
        assert!(
            k["workgroups"].as_u64().unwrap() >= k["dispatches"].as_u64().unwrap(),
            "{k}"
        );
    }
    assert!(
        run["copy_bandwidth_bytes_per_second"].as_f64().unwrap() > 0.0,
        "{run}"
    );
    assert!(err.contains("% copy"), "{err}");
    // lavapipe reports no compute units (the NVIDIA and AMD extensions do): no kernel is marked
    // as launching fewer workgroups than the device has.
    assert!(run["compute_units"].is_null(), "{run}");
    assert!(!err.contains("compute units"), "{err}");

    let o = bin()
        .args([
            "bench",
            "-m",
            m,
            "-dev",
            "none",
            "-n",
            "4",
            "--device-profile",
        ])
        .output()
        .expect("run nextn");
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("--device-profile"),
        "{}",
        text(&o.stderr)
    );
}

/// At a GPU's setting (`NEXTN_GPU_ROW_THREADS=32`, lavapipe's own being a block a thread), the
/// products of the 0.8B's widths (n_embd 1024, its FFN, delta-net and attention shapes, 4 of its
/// layers, a 4,096-row LM head) launch hundreds of workgroups a dispatch in decode, verify,
/// prefill and the head's passes: none under 128 (the 512-row key and value projections, 4 rows
/// a workgroup), where a block a thread launched 27-64 on average in decode and verify.
#[test]
fn products_at_the_08b_widths_launch_hundreds_of_workgroups() {
    let Some(dev) = lavapipe() else { return };
    let dir = std::env::temp_dir().join(format!("nextn-fill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("widths-0.8b.gguf");
    let o = bin()
        .args([
            "synth", "--preset", "0.8b", "--layers", "4", "--vocab", "4096",
        ])
        .args(["--type", "Q4_K_M", "-o"])
        .arg(&model)
        .output()
        .expect("run nextn synth");
    assert!(o.status.success(), "{}", text(&o.stderr));
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(
        &prompts,
        // Over 32 tokens: the prompt goes in 32-row tiles first.
        json!({"name": "code", "prompt": "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\ndef main():\n    for i in range(10):\n        print(i, fib(i))\n"})
            .to_string()
            + "\n",
    )
    .unwrap();
    let out = dir.join("bench.json");
    let mut bench = bin();
    bench
        .env("NEXTN_GPU_ROW_THREADS", "32")
        .args(["bench", "-m"])
        .arg(&model)
        .args([
            "-dev",
            &dev,
            "-c",
            "512",
            "-n",
            "6",
            "--spec-draft-n-max",
            "0,3",
        ])
        .arg("--device-profile");
    let (v, err) = bench_report(bench, &prompts, &out);
    let _ = std::fs::remove_dir_all(&dir);
    let mut seen = std::collections::BTreeSet::new();
    for run in v["runs"].as_array().expect("runs") {
        let d = &run["device"];
        assert_eq!(d["row_threads"].as_u64(), Some(32), "{d}");
        // lavapipe's subgroups (4-16 lanes) end the reductions.
        assert!(d["subgroup_lanes"].as_u64().unwrap() >= 4, "{d}");
        for k in d["kernels"].as_array().expect("kernels") {
            let name = k["kernel"].as_str().unwrap();
            let product = ["matvec_", "swiglu_", "matmul_"]
                .iter()
                .any(|p| name.starts_with(p));
            if !product {
                continue;
            }
            let fewest = k["fewest_workgroups"].as_u64().unwrap();
            assert!(fewest >= 128, "{name}: {fewest} workgroups in {k}");
            seen.insert(name.to_string());
        }
    }
    // Decode, a 4-row verify, the prompt's tiles and the gate|up pairs were all among them.
    for want in [
        "matvec_q4_k_i8_n1",
        "matvec_q4_k_i8_n4",
        "matmul_q4_k_i8_tile",
        "swiglu_q4_k_i8_n1",
        "swiglu_q4_k_i8_n4",
        "matvec_q6_k_i8_n1",
    ] {
        assert!(seen.contains(want), "{want} not in {seen:?}");
    }
    // The report names the settings.
    assert!(err.contains("32 threads a weight row"), "{err}");
    assert!(err.contains("reductions ending in subgroups of"), "{err}");
}

/// Trunk layers of the 0.8B's plan, which the counters test's model has.
const PLAN_LAYERS: u64 = 24;
/// Dispatches of a decode step beside its layers: the embedding rows gathered, the final norm
/// (with the LM head's row quantized), the LM head, its top-1.
const TAIL_DISPATCHES: u64 = 4;

/// What a pass costs the host, in steady state (a request's shapes seen), on a model with the
/// 0.8B's layer plan (24 layers, full attention every 4th, delta-net and attention widths of
/// the real one's kinds, the Q4_K_M mix) at test size: no buffer, bind group or pipeline made
/// per pass; a decode step at most ten dispatches a layer plus the tail; and with drafting at
/// n_max 3 a whole speculative step (the head's three passes, the verify pass and the last
/// step's commit) is at most two submissions with one wait for the device (it is one of each).
#[test]
fn a_steady_state_allocates_nothing_and_a_speculative_step_is_one_submission() {
    let Some(dev) = lavapipe() else { return };
    let dir = std::env::temp_dir().join(format!("nextn-counters-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("plan-0.8b.gguf");
    let o = bin()
        .args([
            "synth",
            "--preset",
            "0.8b",
            "--hidden",
            "256",
            "--ff",
            "512",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "256",
            "--ssm-k-heads",
            "2",
            "--ssm-v-heads",
            "4",
            "--ssm-head-dim",
            "128",
            "--vocab",
            "4096",
            "--type",
            "Q4_K_M",
            "-o",
        ])
        .arg(&model)
        .output()
        .expect("run nextn synth");
    assert!(o.status.success(), "{}", text(&o.stderr));
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(
        &prompts,
        [
            json!({"name": "code", "prompt": "def fib(n):\n    if n < 2:\n        return n\n"}),
            json!({"name": "prose", "prompt": "The quick brown fox jumps over the lazy dog. "}),
        ]
        .iter()
        .map(|v| v.to_string() + "\n")
        .collect::<String>(),
    )
    .unwrap();
    let out = dir.join("bench.json");
    let mut bench = bin();
    bench.args(["bench", "-m"]).arg(&model).args([
        "-dev",
        &dev,
        "-c",
        "512",
        "-n",
        "40",
        "--spec-draft-n-max",
        "0,3",
        // Drafts accepted as a trained head's are: whole and partial acceptances both
        // come in the steady state, so commits swap copies and replay kept rows there.
        "--force-acceptance",
        "0.95,0.86,0.75",
    ]);
    let (v, _) = bench_report(bench, &prompts, &out);
    let _ = std::fs::remove_dir_all(&dir);
    let runs = v["runs"].as_array().expect("runs");
    let run = |n_max: u64| {
        runs.iter()
            .find(|r| r["n_max"].as_u64() == Some(n_max))
            .unwrap_or_else(|| panic!("no run at n_max {n_max}: {v}"))["device"]
            .clone()
    };
    let num =
        |d: &serde_json::Value, k: &str| d[k].as_f64().unwrap_or_else(|| panic!("no {k} in {d}"));
    for n_max in [0, 3] {
        let d = run(n_max);
        // The steady state starts at each request's 8th piece of text: 32 plain steps of the
        // two 40-token requests, and some 3.6 tokens a speculative step.
        let least = if n_max == 0 { 60.0 } else { 10.0 };
        assert!(num(&d, "steady_steps") >= least, "{d}");
        for k in [
            "buffers_created_per_pass",
            "bind_groups_created_per_pass",
            "pipelines_created_per_pass",
        ] {
            assert_eq!(num(&d, k), 0.0, "n_max {n_max}: {k} in {d}");
        }
        assert!(
            num(&d, "dispatches") > 0.0 && num(&d, "passes") > 0.0,
            "{d}"
        );
    }
    let plain = run(0);
    let per_step = num(&plain, "dispatches_per_step");
    assert!(
        per_step <= (10 * PLAN_LAYERS + TAIL_DISPATCHES) as f64,
        "{per_step} dispatches a decode step for {PLAN_LAYERS} layers: {plain}"
    );
    assert_eq!(num(&plain, "submissions_per_step"), 1.0, "{plain}");
    assert_eq!(num(&plain, "read_backs_per_step"), 1.0, "{plain}");
    let spec = run(3);
    assert_eq!(num(&spec, "submissions_per_step"), 1.0, "{spec}");
    assert_eq!(num(&spec, "read_backs_per_step"), 1.0, "{spec}");
}

/// An untied model whose token embedding table does not fit on the device beside the weights and
/// a sequence's caches keeps the table in host memory and drafts as before (each draft comes
/// back to the host), with the same text as when the table is on the device; with room, the
/// table goes up and the note is not printed.
#[test]
fn an_embedding_table_without_room_stays_on_the_host() {
    let Some(dev) = lavapipe() else { return };
    let dir = std::env::temp_dir().join(format!("nextn-untied-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("untied.gguf");
    // 4 layers at width 256 and a 32k vocabulary: the table is about 4.5 MiB of 15 MB.
    let o = bin()
        .args([
            "synth",
            "--preset",
            "0.8b",
            "--hidden",
            "256",
            "--ff",
            "512",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "256",
            "--ssm-k-heads",
            "2",
            "--ssm-v-heads",
            "4",
            "--ssm-head-dim",
            "128",
            "--vocab",
            "32768",
            "--layers",
            "4",
            "--untied",
            "--type",
            "Q4_K_M",
            "-o",
        ])
        .arg(&model)
        .output()
        .expect("run nextn synth");
    assert!(o.status.success(), "{}", text(&o.stderr));
    let run = |budget: Option<u32>| {
        let mut c = bin();
        if let Some(b) = budget {
            c.env("NEXTN_GPU_MEMORY_MIB", b.to_string());
        }
        c.arg("run")
            .arg("-m")
            .arg(&model)
            .args([
                "-dev",
                &dev,
                "-c",
                "256",
                "-p",
                "hello world",
                "-n",
                "12",
                "--temp",
                "0",
                "--spec-type",
                "nextn",
            ])
            .output()
            .expect("run nextn")
    };
    const NOTE: &str = "the token embedding table does not fit on the device";
    let roomy = run(None);
    assert!(roomy.status.success(), "{}", text(&roomy.stderr));
    assert!(
        !text(&roomy.stderr).contains(NOTE),
        "{}",
        text(&roomy.stderr)
    );
    // The largest budget below the roomy one's needs at which the table is left on the host
    // while the run goes through.
    let tight = (8..=20)
        .rev()
        .map(|mib| run(Some(mib)))
        .find(|o| o.status.success() && text(&o.stderr).contains(NOTE));
    let _ = std::fs::remove_dir_all(&dir);
    let tight = tight.expect("no budget left the table on the host and ran");
    assert_eq!(text(&tight.stdout), text(&roomy.stdout));
}

/// A server with the model split between the CPU and the device (`-ngl 5`: the first five layers
/// on the CPU) resumes a turn from its prefix cache, the sequence state a mix of host and device
/// caches, with the answer a server without the cache gives, drafting on.
#[test]
fn a_split_model_serves_turns_from_its_prefix_cache() {
    let Some(dev) = lavapipe() else { return };
    let split = [
        "--spec-type",
        "nextn",
        "-dev",
        &dev,
        "-ngl",
        "5",
        "-c",
        "1024",
    ];
    let warm = Server::start(&split);
    let cold = Server::start(&[&split[..], &["--cache-ram", "0"]].concat());
    let system = json!({"role": "system", "content": "You are a careful coding agent. ".repeat(8)});
    let user = json!({"role": "user", "content": "What is in config.toml?"});
    let first = json!({"messages": [system, user], "max_tokens": 12, "temperature": 0});
    let r = warm.post("/v1/chat/completions", &first);
    assert_eq!(r.status, 200, "{}", r.text());
    let answer = r.json()["choices"][0]["message"]["content"].clone();
    let (_, _, cached) = next_turn_warm_equals_cold(
        &warm,
        &cold,
        &[system, user],
        answer,
        "Show me the first line.",
        12,
    );
    assert!(cached > 40, "{cached}");
}

/// The next turn of a conversation (`messages`, the `answer` to them, then `question`) asked of
/// a server that has the conversation in its prefix cache and of a cold one: the same answer and
/// logprobs from both. Returns the request, the cold server's answer and how many prompt tokens
/// the warm server reused.
fn next_turn_warm_equals_cold(
    warm: &Server,
    cold: &Server,
    messages: &[serde_json::Value],
    answer: serde_json::Value,
    question: &str,
    max_tokens: u64,
) -> (serde_json::Value, serde_json::Value, u64) {
    let mut all = messages.to_vec();
    all.push(json!({"role": "assistant", "content": answer}));
    all.push(json!({"role": "user", "content": question}));
    let body = json!({"messages": all, "max_tokens": max_tokens, "temperature": 0,
        "logprobs": true, "top_logprobs": 2});
    let w = warm.post("/v1/chat/completions", &body);
    assert_eq!(w.status, 200, "{}", w.text());
    let w = w.json();
    let c = cold.post("/v1/chat/completions", &body).json();
    assert_eq!(w["choices"][0]["message"], c["choices"][0]["message"]);
    assert_eq!(w["choices"][0]["logprobs"], c["choices"][0]["logprobs"]);
    let cached = w["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    (body, c, cached)
}

/// The routed experts of a MoE model on the CPU while the rest of each layer runs on the device
/// (`--cpu-moe`, `--n-cpu-moe N`, `-ot REGEX=CPU`, with `-ngl` too): the load line names what went
/// to the CPU, and greedy drafting gives plain decoding's tokens in each placement.
#[test]
fn moe_experts_on_the_cpu_by_flag() {
    let Some(dev) = lavapipe() else { return };
    let Some(golden) = nextn_testdata::shared("golden") else {
        return;
    };
    let m = golden.join("q35moe-a/q35moe-a-Q4_K_M.gguf");
    let m = m.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut a: Vec<&str> = vec![
            "run",
            "-m",
            m,
            "-p",
            "hello world",
            "-n",
            "16",
            "--temp",
            "0",
            "--json",
            "-c",
            "256",
            "-dev",
            &dev,
        ];
        a.extend_from_slice(extra);
        run_json(&a)
    };
    for (flags, line) in [
        (
            &["--cpu-moe"][..],
            "the routed experts of layers 0-7 and the NextN head on the CPU; layers 0-7, the output, the NextN head on",
        ),
        (&["-ncmoe", "2"][..], "the routed experts of layers 0-1 on the CPU;"),
        (
            &["-ot", r"blk\.[36]\.ffn_.*_exps\.=CPU"][..],
            "the routed experts of layers 3, 6 on the CPU;",
        ),
        (
            &["-ngl", "6", "--n-cpu-moe", "5"][..],
            "layers 0-3, the routed experts of layer 4 on the CPU; layers 4-7, the output",
        ),
    ] {
        let (plain, err) = run(flags);
        assert!(err.contains(line), "{flags:?}: {err}");
        let (spec, _) = run(&[flags, &["--spec-type", "nextn", "--spec-draft-n-max", "3"]].concat());
        assert_eq!(spec["tokens"], plain["tokens"], "{flags:?}");
    }
    // A rule for the device's own name keeps those experts there: the first rule wins.
    let keep = format!(r"blk\.0\.ffn_.*_exps\.={dev}");
    let (_, err) = run(&["-ot", &keep, "--cpu-moe"]);
    assert!(
        err.contains("the routed experts of layers 1-7 and the NextN head on the CPU"),
        "{err}"
    );
    // Each trunk pass (prefill, decode, verify) crosses once per layer with its experts on the
    // CPU, drafting or not; the head's passes cross once when its block's experts are there too
    // (`--cpu-moe`, as llama.cpp's matches every block's), and not at all otherwise.
    let json = std::env::temp_dir().join(format!("nextn-cpumoe-{}.json", std::process::id()));
    for (flags, trunk_layers, head_crosses) in [
        (&["--n-cpu-moe", "3"][..], 3, false),
        (&["--cpu-moe"][..], 8, true),
    ] {
        let o = bin()
            .args([
                "bench",
                "-m",
                m,
                "-t",
                "2",
                "-c",
                "256",
                "-n",
                "8",
                "--spec-draft-n-max",
                "0,2",
                "--force-acceptance",
                "0.95,0.86,0.75",
                "-dev",
                &dev,
                "--json",
            ])
            .arg(&json)
            .args(flags)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o.stderr));
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let _ = std::fs::remove_file(&json);
        for run in v["runs"].as_array().unwrap() {
            let d = &run["device"];
            let trunk = d["target_passes"].as_u64().unwrap();
            let head = d["passes"].as_u64().unwrap() - trunk;
            assert!(trunk > 0, "{d}");
            let want = trunk_layers * trunk + if head_crosses { head } else { 0 };
            assert_eq!(d["crossings"].as_u64(), Some(want), "{flags:?}: {d}");
        }
    }
}

/// A MoE model over the device's budget gives up its routed experts first, from the first layer.
#[test]
fn a_moe_model_over_the_budget_moves_its_experts_first() {
    let Some(dev) = lavapipe() else { return };
    let Some(golden) = nextn_testdata::shared("golden") else {
        return;
    };
    let m = golden.join("q35moe-a/q35moe-a-Q4_K_M.gguf");
    let o = bin()
        .env("NEXTN_GPU_MEMORY_MIB", "3")
        .args([
            "run",
            "-m",
            m.to_str().unwrap(),
            "-p",
            "hello",
            "-n",
            "4",
            "-c",
            "256",
            "-dev",
            &dev,
        ])
        .output()
        .unwrap();
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("fit: the model"), "{err}");
    assert!(err.contains("the routed experts of layers 0-"), "{err}");
    assert!(err.contains("fitted to the device"), "{err}");
}

/// Placement flags that cannot be followed are refused with the flag named: a regex that does not
/// compile, a side that does not exist, a rule moving a tensor other than a routed expert, the
/// expert flags on a dense model.
#[test]
fn bad_placement_flags_are_refused() {
    let Some(dev) = lavapipe() else { return };
    let dense = bundled();
    let dense = dense.to_str().unwrap();
    let refused = |m: &str, flags: &[&str], says: &str| {
        let o = bin()
            .args(
                [
                    &["run", "-m", m, "-p", "x", "-n", "1", "-dev", &dev][..],
                    flags,
                ]
                .concat(),
            )
            .output()
            .unwrap();
        let err = text(&o.stderr);
        assert!(!o.status.success(), "{flags:?} was accepted: {err}");
        assert!(err.contains(says), "{flags:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    };
    refused(
        dense,
        &["--n-cpu-moe", "2"],
        "--n-cpu-moe: this model has no routed experts",
    );
    refused(
        dense,
        &["--cpu-moe"],
        "--cpu-moe: this model has no routed experts",
    );
    refused(dense, &["-ot", r"blk\.[=CPU"], "does not compile");
    refused(dense, &["-ot", "exps=CUDA7"], "no buffer type \"CUDA7\"");
    refused(dense, &["-ot", "ffn_down"], "expected REGEX=SIDE");
    refused(
        dense,
        &["-ot", r"blk\.1\.attn_norm=CPU"],
        "per tensor, routed experts",
    );
}

/// `run --mmproj F --image IMG` with the model on the device, whole and split (`-ngl 5`): the
/// CPU's tokens (the picture's rows at their M-RoPE positions there too), and greedy drafting
/// gives plain decoding's.
#[test]
fn run_with_an_image_on_the_device_prints_the_cpu_text() {
    let Some(dev) = lavapipe() else { return };
    let d = std::env::temp_dir().join(format!("nextn-device-image-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    let mmproj = d.join("mmproj.gguf");
    nextn_vision::synth::write_mmproj(&nextn_vision::synth::TowerSpec::fixture(256), &mmproj)
        .expect("write mmproj");
    let img = nextn_testdata::repo_root().join("crates/nextn-vision/tests/data/ramp-100x75.png");
    let (m, mp, img) = (bundled(), mmproj, img);
    let run = |extra: &[&str]| {
        let mut a: Vec<&str> = vec![
            "run",
            "-m",
            m.to_str().unwrap(),
            "--mmproj",
            mp.to_str().unwrap(),
            "--image",
            img.to_str().unwrap(),
            "-p",
            "Describe it.",
            "--chat",
            "-n",
            "16",
            "--temp",
            "0",
            "--json",
            "-t",
            "2",
            "-c",
            "512",
        ];
        a.extend_from_slice(extra);
        run_json(&a)
    };
    let (cpu, cpu_err) = run(&["-dev", "none"]);
    assert_eq!(cpu["timings"]["images_encoded"], 1, "{cpu}");
    // A model on the CPU keeps its tower there without a word.
    assert!(!cpu_err.contains("vision tower"), "{cpu_err}");
    for placement in [
        vec!["-dev", &dev],
        vec!["-dev", &dev, "-ngl", "5"],
        vec!["-dev", &dev, "--no-mmproj-offload"],
    ] {
        let (plain, err) = run(&placement);
        assert!(err.contains(&dev), "{err}");
        // The tower goes with the model unless told not to, and the load lines say where.
        let tower_line = if placement.contains(&"--no-mmproj-offload") {
            "vision tower: on the CPU (--no-mmproj-offload)".to_string()
        } else {
            format!("vision tower: on {dev}, ")
        };
        assert!(err.contains(&tower_line), "{placement:?}: {err}");
        assert_eq!(plain["tokens"], cpu["tokens"], "{placement:?}: {err}");
        let (mtp, err) = run(&[&placement[..], &["--spec-type", "nextn"]].concat());
        assert_eq!(mtp["tokens"], plain["tokens"], "{placement:?}: {err}");
        assert!(mtp["spec"]["draft_n"].as_u64().unwrap() > 0, "{mtp}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// `bench --image` with the model on the device times the tower there: each encode a
/// submission before the blocks, one a block and one for the merger, and nothing created on the
/// device an encode; with --no-mmproj-offload it runs on the CPU.
#[test]
fn bench_times_the_tower_on_the_device() {
    let Some(dev) = lavapipe() else { return };
    let d = std::env::temp_dir().join(format!("nextn-device-bench-image-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    let mmproj = d.join("mmproj.gguf");
    let spec = nextn_vision::synth::TowerSpec::fixture(256);
    nextn_vision::synth::write_mmproj(&spec, &mmproj).expect("write mmproj");
    let img = nextn_testdata::repo_root().join("crates/nextn-vision/tests/data/ramp-100x75.png");
    let m = bundled();
    let bench = |extra: &[&str]| {
        let mut a = vec![
            "bench",
            "-m",
            m.to_str().unwrap(),
            "-dev",
            &dev,
            "--mmproj",
            mmproj.to_str().unwrap(),
            "--image",
            img.to_str().unwrap(),
            "-r",
            "2",
            "-o",
            "json",
        ];
        a.extend_from_slice(extra);
        run_json(&a)
    };
    let (rows, err) = bench(&[]);
    let row = &rows[0];
    assert_eq!(row["placement"], "device", "{row}\n{err}");
    assert_eq!(row["device"], dev.as_str());
    assert_eq!(row["software_device"], true);
    assert_eq!(
        (row["grid"][0].as_u64(), row["grid"][1].as_u64()),
        (Some(6), Some(5))
    );
    let per = &row["per_encode"];
    assert_eq!(
        per["submissions"].as_f64(),
        Some(spec.n_layer as f64 + 2.0),
        "{per}"
    );
    assert_eq!(
        per["waits"].as_f64(),
        Some(spec.n_layer as f64 + 2.0),
        "{per}"
    );
    assert_eq!(per["buffers_created"].as_f64(), Some(0.0), "{per}");
    assert_eq!(per["bind_groups_created"].as_f64(), Some(0.0), "{per}");
    assert!(
        per["dispatches"].as_f64().unwrap() >= 12.0 * spec.n_layer as f64,
        "{per}"
    );
    assert!(
        err.contains("a software device: its timings are not a GPU's"),
        "{err}"
    );
    let (rows, _) = bench(&["--no-mmproj-offload"]);
    assert_eq!(rows[0]["placement"], "cpu", "{}", rows[0]);
    let _ = std::fs::remove_dir_all(&d);
}

/// With the tower on the device the encoder thread submits beside the loop's passes: a picture
/// encoded while another slot decodes gives the answer (and log probabilities) it gives alone,
/// and the other slot's text is its text alone too.
#[test]
fn a_device_tower_encodes_beside_a_decoding_slot() {
    use base64::Engine;
    let Some(dev) = lavapipe() else { return };
    let server = serve_common::start_with_mmproj(&[
        "--spec-type",
        "nextn",
        "-dev",
        &dev,
        "-np",
        "2",
        "-c",
        "2048",
        "--cache-ram",
        "0",
    ]);
    let png = base64::engine::general_purpose::STANDARD.encode(serve_common::ramp_png());
    let picture = json!({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{png}")}},
        {"type": "text", "text": "What is in this picture?"}]}],
        "max_tokens": 8, "temperature": 0, "logprobs": true});
    let text = json!({"messages": [{"role": "user", "content": "Count from one to twenty."}],
        "max_tokens": 48, "temperature": 0, "logprobs": true});
    let answer = |r: &serve_common::Response| {
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        (
            v["choices"][0]["message"]["content"].clone(),
            v["choices"][0]["logprobs"].clone(),
        )
    };
    let (during_text, during_picture) = std::thread::scope(|s| {
        let t = s.spawn(|| answer(&server.post("/v1/chat/completions", &text)));
        // The picture arrives while the text request decodes.
        std::thread::sleep(std::time::Duration::from_millis(300));
        let p = answer(&server.post("/v1/chat/completions", &picture));
        (t.join().expect("text request"), p)
    });
    let alone_picture = answer(&server.post("/v1/chat/completions", &picture));
    let alone_text = answer(&server.post("/v1/chat/completions", &text));
    assert_eq!(during_picture, alone_picture, "{}", server.log_text());
    assert_eq!(during_text, alone_text, "{}", server.log_text());
    assert!(server
        .log_text()
        .contains(&format!("vision tower: on {dev}, ")));
    assert_eq!(server.metric("nextn:images_encoded_total"), 2.0);
}

/// A server with the model on the device takes a picture, and the next turn with the same
/// picture resumes after it from the prefix cache (the device's caches restored with the image's
/// positions) with the answer and logprobs of a server without the cache, drafting on; a slot
/// file saved after the picture resumes it in that other server the same way.
#[test]
fn a_device_server_resumes_after_an_image() {
    use base64::Engine;
    let Some(dev) = lavapipe() else { return };
    let slots = std::env::temp_dir().join(format!("nextn-device-slots-{}", std::process::id()));
    std::fs::create_dir_all(&slots).expect("temp dir");
    let args = [
        "--spec-type",
        "nextn",
        "-dev",
        &dev,
        "-np",
        "1",
        "-c",
        "1024",
        "--slot-save-path",
        slots.to_str().unwrap(),
    ];
    let warm = serve_common::start_with_mmproj(&args);
    let cold = serve_common::start_with_mmproj(&[&args[..], &["--cache-ram", "0"]].concat());
    let png = base64::engine::general_purpose::STANDARD.encode(serve_common::ramp_png());
    let user = json!({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{png}")}},
        {"type": "text", "text": "What is in this picture?"}]});
    let first = json!({"messages": [user], "max_tokens": 8, "temperature": 0});
    let r = warm.post("/v1/chat/completions", &first);
    assert_eq!(r.status, 200, "{}\n{}", r.text(), warm.log_text());
    // The picture went through the tower on the device.
    assert!(
        warm.log_text()
            .contains(&format!("vision tower: on {dev}, ")),
        "{}",
        warm.log_text()
    );
    let first_prompt = r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    let answer = r.json()["choices"][0]["message"]["content"].clone();
    let saved = warm.post("/slots/0?action=save", &json!({"filename": "image.bin"}));
    assert_eq!(saved.status, 200, "{}", saved.text());
    let (body, c, cached) =
        next_turn_warm_equals_cold(&warm, &cold, &[user], answer, "And the colours?", 8);
    // The first turn's prompt, the picture's rows in it, is the second's prefix.
    assert!(cached >= first_prompt, "resumed {cached} of {first_prompt}");
    // The slot file, restored where nothing was cached, resumes after the picture as well.
    let r = cold.post("/slots/0?action=restore", &json!({"filename": "image.bin"}));
    assert_eq!(r.status, 200, "{}", r.text());
    let restored = cold.post("/v1/chat/completions", &body).json();
    let cached = restored["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= first_prompt,
        "restored {cached} of {first_prompt}: {restored}"
    );
    assert_eq!(
        restored["choices"][0]["message"],
        c["choices"][0]["message"]
    );
    assert_eq!(
        restored["choices"][0]["logprobs"],
        c["choices"][0]["logprobs"]
    );
    let _ = std::fs::remove_dir_all(&slots);
}

/// A model whose width is not a whole number of the K-quants' 256-value activation blocks (the
/// tiny preset's 128 at Q4_K_M): the NextN head's input, two normed halves of 128, is quantized
/// for its K-quant `eh_proj` as whole rows, and greedy drafting on the device gives plain
/// decoding's tokens.
#[test]
fn the_head_drafts_on_a_narrow_k_quant_model() {
    let Some(dev) = lavapipe() else { return };
    let f = std::env::temp_dir().join(format!("nextn-narrow-q4k-{}.gguf", std::process::id()));
    let o = bin()
        .args(["synth", "--preset", "tiny", "--type", "Q4_K_M", "-o"])
        .arg(&f)
        .output()
        .expect("run nextn");
    assert!(o.status.success(), "{}", text(&o.stderr));
    let m = f.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut a: Vec<&str> = vec![
            "run",
            "-m",
            m,
            "-p",
            "hello there",
            "-n",
            "24",
            "--temp",
            "0",
            "--json",
            "-c",
            "256",
            "-dev",
            &dev,
        ];
        a.extend_from_slice(extra);
        run_json(&a)
    };
    let (plain, _) = run(&[]);
    let (mtp, err) = run(&["--spec-type", "nextn", "--spec-draft-n-max", "3"]);
    assert_eq!(mtp["tokens"], plain["tokens"], "{err}");
    assert!(mtp["spec"]["draft_n"].as_u64().unwrap() > 0, "{mtp}");
    let _ = std::fs::remove_file(&f);
}
