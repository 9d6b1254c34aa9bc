//! The real `nextn` binary on the bundled model and on broken or foreign files.

use std::path::PathBuf;
use std::process::{Command, Output};

use nextn_gguf::{GgufFile, GgufWriter};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_nextn"))
}

fn bundled() -> PathBuf {
    nextn_testdata::bundled_model()
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("run nextn")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nextn-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// The bundled model without its NextN tensors and with nextn_predict_layers = 0.
fn headless_copy() -> PathBuf {
    let path = tmp("headless.gguf");
    let f = GgufFile::open(bundled()).unwrap();
    let mut w = GgufWriter::from_file(&f);
    for t in f.tensors() {
        if t.name.starts_with("blk.8.") {
            assert!(w.remove_tensor(&t.name));
        }
    }
    w.set_kv("qwen35.block_count", 8u32);
    w.set_kv("qwen35.nextn_predict_layers", 0u32);
    w.discard_preserved_layout();
    w.write_file(&path).unwrap();
    path
}

#[test]
fn inspect_json_describes_the_bundled_model() {
    let o = run(&["inspect", "--json", bundled().to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value =
        serde_json::from_str(&stdout(&o)).expect("inspect --json prints JSON");
    assert_eq!(v["architecture"], "qwen35");
    assert_eq!(v["hyper_parameters"]["n_layer"], 8);
    assert_eq!(
        v["hyper_parameters"]["full_attention_layers"],
        serde_json::json!([3, 7])
    );
    assert_eq!(v["hyper_parameters"]["rms_eps"], serde_json::json!(1e-6));
    assert_eq!(v["types"]["Q8_0"]["tensors"], 71);
    assert_eq!(v["nextn"]["block"], 8);
    assert_eq!(v["nextn"]["complete"], true);
    assert_eq!(v["tokenizer"]["n_tokens"], 8192);
    assert_eq!(v["tokenizer"]["chat_template"], true);
}

#[test]
fn inspect_lists_tensors_and_dumps_them_dequantized() {
    let model = bundled();
    let o = run(&["inspect", "--tensors", model.to_str().unwrap()]);
    assert!(o.status.success());
    assert!(stdout(&o).contains("blk.8.nextn.eh_proj.weight"));
    let out = tmp("eh_proj.f32");
    let o = run(&[
        "inspect",
        model.to_str().unwrap(),
        "--dump",
        "blk.8.nextn.eh_proj.weight",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let bytes = std::fs::read(&out).unwrap();
    let f = GgufFile::open(&model).unwrap();
    let t = f.tensor("blk.8.nextn.eh_proj.weight").unwrap();
    let mut want = vec![0.0f32; t.n_elements as usize];
    nextn_quant::formats::dequantize(t.ty, f.tensor_data(t), &mut want).unwrap();
    let got: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(got, want);
    let o = run(&[
        "inspect",
        model.to_str().unwrap(),
        "--dump",
        "no.such.tensor",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("no tensor named 'no.such.tensor'"));
}

#[test]
fn verify_exit_codes() {
    assert_eq!(
        run(&["verify", bundled().to_str().unwrap()]).status.code(),
        Some(0)
    );
    let headless = headless_copy();
    let o = run(&["verify", headless.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("no NextN head"), "{}", stderr(&o));

    let bytes = std::fs::read(bundled()).unwrap();
    let truncated = tmp("truncated.gguf");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let o = run(&["verify", truncated.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));

    let foreign = tmp("foreign.gguf");
    std::fs::write(&foreign, b"not a gguf file at all").unwrap();
    assert_eq!(
        run(&["verify", foreign.to_str().unwrap()]).status.code(),
        Some(2)
    );

    // A mis-shaped head tensor: the file is valid GGUF but unusable for MTP.
    let f = GgufFile::open(bundled()).unwrap();
    let mut w = GgufWriter::from_file(&f);
    assert!(w.remove_tensor("blk.8.nextn.hnorm.weight"));
    w.discard_preserved_layout();
    let missing = tmp("missing-hnorm.gguf");
    w.write_file(&missing).unwrap();
    let o = run(&["verify", missing.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("blk.8.nextn.hnorm.weight"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn run_greedy_is_identical_with_and_without_mtp() {
    let model = bundled();
    let m = model.to_str().unwrap();
    let prompt = "class Stack:\n    def __init__(self):\n";
    let plain = run(&[
        "run", "-m", m, "-p", prompt, "-n", "24", "--temp", "0", "--json", "-t", "2",
    ]);
    assert!(plain.status.success(), "{}", stderr(&plain));
    let plain: serde_json::Value = serde_json::from_str(&stdout(&plain)).unwrap();
    for n_max in ["1", "3"] {
        let o = run(&[
            "run",
            "-m",
            m,
            "-p",
            prompt,
            "-n",
            "24",
            "--temp",
            "0",
            "--json",
            "--spec-type",
            "nextn",
            "--spec-draft-n-max",
            n_max,
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert_eq!(v["tokens"], plain["tokens"]);
        assert_eq!(v["text"], plain["text"]);
        assert!(v["spec"]["draft_n"].as_u64().unwrap() > 0);
        assert_eq!(v["timings"]["draft_n"], v["spec"]["draft_n"]);
        assert!(
            v["spec"]["accepted_per_pos"].as_array().unwrap().len()
                == n_max.parse::<usize>().unwrap()
        );
        assert!(stderr(&o).contains("draft acceptance"));
    }
}

#[test]
fn bad_input_gives_clear_errors() {
    let m = bundled();
    let m = m.to_str().unwrap();
    let headless = headless_copy();
    let o = run(&[
        "run",
        "-m",
        headless.to_str().unwrap(),
        "-p",
        "x",
        "-n",
        "2",
        "--spec-type",
        "nextn",
    ]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("needs a NextN (MTP) head"),
        "{}",
        stderr(&o)
    );
    // Plain decoding still works on it.
    let o = run(&[
        "run",
        "-m",
        headless.to_str().unwrap(),
        "-p",
        "x",
        "-n",
        "2",
        "--temp",
        "0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));

    let o = run(&[
        "run",
        "-m",
        m,
        "-c",
        "8",
        "-p",
        "import os\nimport sys\nimport re\nimport json\n",
        "-n",
        "4",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("context"), "{}", stderr(&o));

    let o = run(&["run", "-m", "/nonexistent/model.gguf", "-p", "x"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("/nonexistent/model.gguf"));

    let o = run(&["run", "-m", m, "-p", "x", "--top-p", "7"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("top_p"), "{}", stderr(&o));

    assert!(!stderr(&o).contains("panicked"));
}

/// The keys of a JSON object, sorted.
fn keys(v: &serde_json::Value) -> Vec<String> {
    let mut k: Vec<String> = v
        .as_object()
        .expect("a JSON object")
        .keys()
        .cloned()
        .collect();
    k.sort();
    k
}

/// `run`'s output is an interface: the `--json` fields, the streamed text on stdout and the two
/// statistics lines on stderr keep their shape.
#[test]
fn run_output_shape_is_pinned() {
    let model = bundled();
    let m = model.to_str().unwrap();
    let prompt = "import os\nimport sys\n";
    let o = run(&[
        "run",
        "-m",
        m,
        "-p",
        prompt,
        "-n",
        "16",
        "--temp",
        "0",
        "--json",
        "--spec-type",
        "nextn",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(
        keys(&v),
        [
            "finish_reason",
            "model",
            "prompt_tokens",
            "spec",
            "text",
            "timings",
            "tokens"
        ]
    );
    assert_eq!(
        keys(&v["timings"]),
        [
            "cache_n",
            "draft_n",
            "draft_n_accepted",
            "predicted_ms",
            "predicted_n",
            "predicted_per_second",
            "predicted_per_token_ms",
            "prompt_ms",
            "prompt_n",
            "prompt_per_second",
            "prompt_per_token_ms"
        ]
    );
    assert_eq!(
        keys(&v["spec"]),
        [
            "acceptance_per_pos",
            "acceptance_rate",
            "accepted_per_pos",
            "accepted_per_token",
            "draft_ms",
            "draft_n",
            "draft_n_accepted",
            "draft_vocab",
            "drafted_per_pos",
            "drafts_per_token",
            "mean_accepted_len",
            "n_vocab",
            "steps",
            "verify_ms"
        ]
    );
    assert_eq!(v["finish_reason"], "length");
    assert_eq!(v["tokens"].as_array().unwrap().len(), 16);
    assert_eq!(v["timings"]["predicted_n"], 16);
    assert_eq!(
        v["timings"]["prompt_n"],
        v["prompt_tokens"].as_array().unwrap().len()
    );
    assert_eq!(v["spec"]["accepted_per_pos"].as_array().unwrap().len(), 3);
    let s = v["spec"]["steps"].as_u64().unwrap();
    let (d, a) = (
        v["spec"]["draft_n"].as_u64().unwrap(),
        v["spec"]["draft_n_accepted"].as_u64().unwrap(),
    );
    assert!(s > 0 && a <= d && d <= 3 * s, "{}", v["spec"]);
    // Every generated token is one of: the first token, an accepted draft, a bonus token.
    assert!(a + s < 16, "{}", v["spec"]);
    let err = stderr(&o);
    let lines: Vec<&str> = err.lines().collect();
    let stats = lines
        .iter()
        .find(|l| l.starts_with("prompt "))
        .expect("timings line");
    assert!(
        stats.contains(" tokens in ")
            && stats.contains(" tok/s); generated 16 tokens in ")
            && stats.ends_with("tok/s); finish: length"),
        "{stats}"
    );
    let spec = lines
        .iter()
        .find(|l| l.starts_with("draft acceptance = "))
        .expect("draft statistics line");
    assert!(
        spec.contains(" accepted / ")
            && spec.contains(" drafted), ")
            && spec.contains(" steps, mean len = ")
            && spec.contains(", per position [")
            && spec.contains("], draft ")
            && spec.ends_with(" ms"),
        "{spec}"
    );

    // Streaming: the text on stdout, then a newline; plain decoding prints no draft line.
    let o = run(&["run", "-m", m, "-p", prompt, "-n", "16", "--temp", "0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), format!("{}\n", v["text"].as_str().unwrap()));
    assert!(!stderr(&o).contains("draft acceptance"));
    assert!(stderr(&o).contains("generated 16 tokens in "));
}

/// `run` with a seed gives the same tokens with and without drafting, at every draft depth: the
/// token at each position is drawn as plain decoding draws it. On the bundled model and on a
/// quantized fixture.
#[test]
fn run_seeded_sampling_is_the_same_with_and_without_mtp() {
    let tokens_of = |o: &Output| -> serde_json::Value {
        assert!(o.status.success(), "{}", stderr(o));
        let v: serde_json::Value = serde_json::from_str(&stdout(o)).unwrap();
        v["tokens"].clone()
    };
    let mut models = vec![(bundled(), None)];
    if let Some(golden) = nextn_testdata::shared("golden") {
        let fixture = golden.join("q35-dense-a");
        let g: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture.join("golden.json")).unwrap())
                .unwrap();
        let prompt: Vec<String> = g["sequences"][0]["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.to_string())
            .collect();
        models.push((
            fixture.join("q35-dense-a-Q4_K_M.gguf"),
            Some(prompt.join(",")),
        ));
    }
    for (model, tokens) in models {
        let m = model.to_str().unwrap().to_string();
        let base = |extra: &[&str]| {
            let mut a: Vec<String> = ["run", "-m", &m, "-n", "64", "--temp", "0.8", "--seed", "7"]
                .iter()
                .map(|s| s.to_string())
                .collect();
            match &tokens {
                Some(t) => a.extend(["--tokens".to_string(), t.clone(), "--ignore-eos".into()]),
                None => a.extend(["-p".to_string(), "def parse(self, text):\n".into()]),
            }
            a.extend(["--json".to_string()]);
            a.extend(extra.iter().map(|s| s.to_string()));
            let args: Vec<&str> = a.iter().map(String::as_str).collect();
            run(&args)
        };
        let plain = tokens_of(&base(&["--spec-type", "none"]));
        assert!(plain.as_array().unwrap().len() > 8, "{plain}");
        for n_max in ["1", "2", "3", "4"] {
            let o = base(&["--spec-type", "nextn", "--spec-draft-n-max", n_max]);
            assert_eq!(tokens_of(&o), plain, "{m} n_max {n_max}");
        }
    }
}

/// `bench` runs every policy it is given through the generation loop: plain, a fixed depth and
/// `auto`; with greedy decoding and with coupled sampling the drafted runs emit plain decoding's
/// tokens (SPEC_AGREE 1), and at temperature > 0 both draft-sampling rules are measured.
#[test]
fn bench_runs_each_policy_through_the_loop() {
    let dir = tmp("bench");
    std::fs::create_dir_all(&dir).unwrap();
    let m = bundled();
    for temp in ["0", "0.8"] {
        let json_path = dir.join(format!("bench-{temp}.json"));
        let o = run(&[
            "bench",
            "-m",
            m.to_str().unwrap(),
            "-n",
            "12",
            "--spec-draft-n-max",
            "0,2,auto",
            "--temp",
            temp,
            "--reps",
            "1",
            "-t",
            "2",
            "--check",
            "--json",
            json_path.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
        let runs: Vec<(String, String, u64)> = v["runs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["policy"].as_str().unwrap().to_string(),
                    r["draft_sampling"].as_str().unwrap().to_string(),
                    r["n_max"].as_u64().unwrap(),
                )
            })
            .collect();
        let modes: &[&str] = if temp == "0" {
            &["coupled"]
        } else {
            &["coupled", "sample"]
        };
        let mut want = vec![("plain".to_string(), "-".to_string(), 0)];
        for policy in ["fixed", "auto"] {
            for mode in modes {
                want.push((policy.to_string(), mode.to_string(), 2));
            }
        }
        assert_eq!(runs, want, "temp {temp}");
        assert_eq!(v["check"]["spec_agree"], 1.0, "temp {temp}: {}", v["check"]);
        assert!(v["runs"][1]["spec"]["draft_n"].as_u64().unwrap() > 0);
        let out = stdout(&o);
        assert!(
            out.lines()
                .any(|l| l.trim_start().starts_with("auto ") && l.contains(" coupled |")),
            "{out}"
        );
    }
}

/// `run` takes llama.cpp's constrained-decoding and bias flags, and refuses bad ones clearly.
#[test]
fn run_with_a_grammar_a_schema_and_a_logit_bias() {
    let model = bundled();
    let m = model.to_str().unwrap();
    let json_of = |o: &Output| -> serde_json::Value {
        assert!(o.status.success(), "{}", stderr(o));
        serde_json::from_str(&stdout(o)).unwrap()
    };
    for spec in ["none", "nextn"] {
        let schema = r#"{"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"], "additionalProperties": false}"#;
        let v = json_of(&run(&[
            "run",
            "-m",
            m,
            "-p",
            "config = ",
            "-n",
            "200",
            "--temp",
            "0.9",
            "-s",
            "5",
            "--json",
            "-j",
            schema,
            "--spec-type",
            spec,
        ]));
        assert_eq!(v["finish_reason"], "stop", "{v}");
        let value: serde_json::Value = serde_json::from_str(v["text"].as_str().unwrap()).unwrap();
        let n = value["n"].as_u64().expect("an integer n");
        assert!(n <= 99 && value.as_object().unwrap().len() == 1, "{value}");
        let v = json_of(&run(&[
            "run",
            "-m",
            m,
            "-p",
            "ok? ",
            "-n",
            "20",
            "--temp",
            "0",
            "--json",
            "--grammar",
            "root ::= (\"yes\" | \"no\") \".\"",
            "--spec-type",
            spec,
        ]));
        assert!(v["text"] == "yes." || v["text"] == "no.", "{v}");
    }
    // A bias of -inf on the greedy first token moves the output off it.
    let first_token = |extra: &[&str]| {
        let mut a = vec![
            "run",
            "-m",
            m,
            "-p",
            "import os\n",
            "-n",
            "1",
            "--temp",
            "0",
            "--json",
        ];
        a.extend(extra);
        json_of(&run(&a))["tokens"][0].as_u64()
    };
    let first = first_token(&[]).expect("a token");
    let ban = format!("{first}-inf");
    assert_ne!(first_token(&["--logit-bias", &ban]), Some(first));
    for (args, needle) in [
        (vec!["--grammar", "root ::= (\"x\""], "GBNF grammar, line 1"),
        (vec!["-j", "{not json"], "--json-schema is not valid JSON"),
        (vec!["--logit-bias", "12x5"], "--logit-bias 12x5"),
        (vec!["--logit-bias", "99999+1"], "out of range"),
    ] {
        let mut a = vec!["run", "-m", m, "-p", "x", "-n", "2"];
        a.extend(args.iter());
        let o = run(&a);
        assert!(!o.status.success(), "{args:?}");
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"));
    }
}

/// `--reasoning-budget N`: a prompt that ends in an open `<think>` block gets N of the model's own tokens
/// of reasoning, then `--reasoning-budget-message` and `</think>`, with and without MTP.
#[test]
fn run_with_a_reasoning_budget_closes_the_block() {
    let model = bundled();
    let m = model.to_str().unwrap();
    let tokens = |extra: &[&str]| -> (Vec<u64>, String) {
        let mut a = vec![
            "run",
            "-m",
            m,
            "-p",
            "def add(a, b):\n<think>\n",
            "-n",
            "30",
            "--temp",
            "0",
            "--json",
        ];
        a.extend(extra);
        let o = run(&a);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        let t = v["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect();
        (t, v["text"].as_str().unwrap().to_string())
    };
    let (free, free_text) = tokens(&[]);
    assert!(!free_text.contains("</think>"), "{free_text}");
    let budget = [
        "--reasoning-budget",
        "7",
        "--reasoning-budget-message",
        " Done.",
    ];
    for spec in ["none", "nextn"] {
        let mut a = budget.to_vec();
        a.extend(["--spec-type", spec]);
        let (t, text) = tokens(&a);
        assert_eq!(t[..7], free[..7], "{spec}");
        assert!(text.contains(" Done.</think>"), "{spec}: {text}");
        assert_eq!(t.len(), 30);
    }
    let o = run(&[
        "run",
        "-m",
        m,
        "-p",
        "x",
        "-n",
        "2",
        "--reasoning-budget",
        "-3",
    ]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("--reasoning-budget -3"),
        "{}",
        stderr(&o)
    );
}

/// `--prompt-cache FILE`: the first run saves the prompt's state, a later run with the same
/// prompt or a longer one resumes from it with the output of a run without the cache; a damaged
/// file is an error that names it; `--prompt-cache-ro` leaves the file as it is.
#[test]
fn prompt_cache_resumes_later_runs_exactly() {
    let file = tmp("prompt-cache.bin");
    let _ = std::fs::remove_file(&file);
    let f = file.to_str().unwrap();
    let model = bundled();
    let m = model.to_str().unwrap();
    let prompt = "import os\nimport sys\n\n\ndef main():\n";
    let longer = format!("{prompt}    args = sys.argv[1:]\n");
    let gen = |p: &str, cache: &[&str]| {
        let mut args = vec![
            "run",
            "-m",
            m,
            "-p",
            p,
            "-n",
            "20",
            "--temp",
            "0.8",
            "--seed",
            "7",
            "--spec-type",
            "nextn",
            "--json",
        ];
        args.extend_from_slice(cache);
        let o = run(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (
            v["tokens"].clone(),
            v["timings"]["cache_n"].as_u64().unwrap(),
            stderr(&o),
        )
    };
    let (cold, _, _) = gen(prompt, &[]);
    let (first, cache_n, log) = gen(prompt, &["--prompt-cache", f]);
    assert_eq!((first, cache_n), (cold.clone(), 0));
    assert!(log.contains("prompt cache: saved the state after"), "{log}");
    let n_prompt = {
        let v: serde_json::Value = serde_json::from_slice(
            &run(&["run", "-m", m, "-p", prompt, "-n", "0", "--json"]).stdout,
        )
        .unwrap();
        v["prompt_tokens"].as_array().unwrap().len() as u64
    };
    let (again, cache_n, log) = gen(prompt, &["--prompt-cache", f]);
    assert_eq!((again, cache_n), (cold, n_prompt - 1), "{log}");

    let (cold_longer, _, _) = gen(&longer, &[]);
    let saved = std::fs::read(&file).unwrap();
    let (ro, cache_n, _) = gen(&longer, &["--prompt-cache", f, "--prompt-cache-ro"]);
    assert_eq!((ro, cache_n), (cold_longer.clone(), n_prompt - 1));
    assert_eq!(
        std::fs::read(&file).unwrap(),
        saved,
        "--prompt-cache-ro wrote the file"
    );
    let (warm_longer, cache_n, _) = gen(&longer, &["--prompt-cache", f]);
    assert_eq!((warm_longer, cache_n), (cold_longer, n_prompt - 1));
    assert!(std::fs::read(&file).unwrap().len() > saved.len());

    let mut damaged = saved;
    let mid = damaged.len() / 2;
    damaged[mid] ^= 1;
    std::fs::write(&file, &damaged).unwrap();
    let o = run(&["run", "-m", m, "-p", prompt, "-n", "4", "--prompt-cache", f]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains(f) && err.contains("damaged"), "{err}");
}

/// llama.cpp's `LLAMA_ARG_*` variables set the flags we share; flags that mean nothing on the CPU
/// are named on stderr, once each, and change nothing.
#[test]
fn llama_env_variables_and_cpu_only_flags() {
    let model = bundled();
    let o = bin()
        .args([
            "run",
            "-m",
            model.to_str().unwrap(),
            "-p",
            "def f():",
            "-n",
            "6",
            "--temp",
            "0",
        ])
        .env("LLAMA_ARG_CTX_SIZE", "64")
        .env("LLAMA_ARG_N_GPU_LAYERS", "99")
        .env("LLAMA_ARG_FLASH_ATTN", "on")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("context 64"), "{err}");
    // No hardware GPU here, and lavapipe is used only when named with -dev.
    assert_eq!(err.matches("-ngl 99: no GPU found").count(), 1, "{err}");
    assert!(err.contains("-fa on: no effect"), "{err}");
    let plain = run(&[
        "run",
        "-m",
        model.to_str().unwrap(),
        "-p",
        "def f():",
        "-n",
        "6",
        "--temp",
        "0",
        "-c",
        "64",
    ]);
    assert_eq!(stdout(&o), stdout(&plain));
    // --no-mmap reads the model into memory: same output.
    let in_memory = run(&[
        "run",
        "-m",
        model.to_str().unwrap(),
        "-p",
        "def f():",
        "-n",
        "6",
        "--temp",
        "0",
        "-c",
        "64",
        "--no-mmap",
    ]);
    assert!(in_memory.status.success(), "{}", stderr(&in_memory));
    assert_eq!(stdout(&in_memory), stdout(&plain));
}

/// The README's first command: a varied continuation (no line repeated over and over), the same
/// with and without drafting.
#[test]
fn readme_first_command_reads_like_code() {
    let model = bundled();
    let args = |spec: &str| {
        run(&[
            "run",
            "-m",
            model.to_str().unwrap(),
            "-p",
            "import os\nimport sys\n\n\ndef main():\n",
            "-n",
            "64",
            "--temp",
            "0",
            "--repeat-penalty",
            "1.3",
            "--spec-type",
            spec,
        ])
    };
    let (mtp, plain) = (args("nextn"), args("none"));
    assert!(mtp.status.success(), "{}", stderr(&mtp));
    assert_eq!(stdout(&mtp), stdout(&plain));
    let text = stdout(&mtp);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() >= 5, "{text}");
    let most = lines
        .iter()
        .map(|l| lines.iter().filter(|m| *m == l).count())
        .max()
        .unwrap_or(0);
    assert!(most <= 2, "a line repeats {most} times:\n{text}");
}

/// `run -cnv` without a prompt is a chat on stdin: one answer per line, the second turn resumes
/// from the first's state, and the answers are those of the same conversation without drafting.
#[test]
fn conversation_mode_keeps_the_state_between_turns() {
    use std::io::Write as _;
    use std::process::Stdio;
    let model = bundled();
    let talk = |spec: &str| {
        let mut child = bin()
            .args([
                "run",
                "-m",
                model.to_str().unwrap(),
                "-cnv",
                "--temp",
                "0",
                "-n",
                "12",
                "--spec-type",
                spec,
                "-sys",
                "You write Python.",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(b"Write a function that adds two numbers.\n\nNow make it multiply.\n")
            .unwrap();
        child.wait_with_output().unwrap()
    };
    let (mtp, plain) = (talk("nextn"), talk("none"));
    assert!(mtp.status.success(), "{}", stderr(&mtp));
    assert_eq!(stdout(&mtp), stdout(&plain));
    let err = stderr(&mtp);
    let turns: Vec<&str> = err.lines().filter(|l| l.starts_with("[prompt ")).collect();
    assert_eq!(turns.len(), 2, "{err}");
    assert!(
        turns[0].contains(", 0 of them from the previous turns"),
        "{err}"
    );
    assert!(
        !turns[1].contains(", 0 of them"),
        "the second turn resumed nothing: {err}"
    );
    let o = run(&[
        "run",
        "-m",
        model.to_str().unwrap(),
        "-cnv",
        "--grammar",
        "root ::= \"a\"",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("conversation mode"), "{}", stderr(&o));
}

/// `bench -r N -o md|csv|jsonl`: stdout is only the table of runs, with mean ± standard deviation
/// over the repetitions; progress and the report go to stderr.
#[test]
fn bench_tables_with_repetitions() {
    let model = bundled();
    let bench = |format: &str| {
        let o = run(&[
            "bench",
            "-m",
            model.to_str().unwrap(),
            "-n",
            "8",
            "--spec-draft-n-max",
            "0,2",
            "--reps",
            "1",
            "-r",
            "2",
            "-o",
            format,
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(stderr(&o).contains("[4/4] n_max 2"), "{}", stderr(&o));
        stdout(&o)
    };
    let md = bench("md");
    let lines: Vec<&str> = md.lines().collect();
    assert_eq!(lines.len(), 4, "{md}");
    assert!(
        lines[0].starts_with("| n_max | drafts | prefill t/s | decode t/s |"),
        "{md}"
    );
    assert!(
        lines[2].starts_with("| 0 | - |") && lines[3].starts_with("| 2 | coupled |"),
        "{md}"
    );
    assert!(lines[3].contains(" ± "), "{md}");
    let csv = bench("csv");
    assert_eq!(csv.lines().count(), 3, "{csv}");
    assert!(csv.starts_with("n_max,drafts,prefill_tok_s,prefill_tok_s_sd,decode_tok_s,"));
    let jsonl = bench("jsonl");
    let rows: Vec<serde_json::Value> = jsonl
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2);
    assert!(rows[1]["decode_tok_s"].as_f64() > Some(0.0));
    assert!(rows[1]["decode_tok_s_sd"].is_number());
    assert!(rows[1]["acceptance"].is_number() && rows[0]["acceptance"].is_null());
}

/// `-hf ORG/NAME[:QUANT]` through a hub cache in the standard layout with HF_HUB_OFFLINE=1 (no
/// network in tests), a repository missing from the cache, and an unreachable hub.
#[test]
fn hf_models_come_from_the_hub_cache() {
    let home = tmp("hf-home");
    let _ = std::fs::remove_dir_all(&home);
    let repo = home.join("hub").join("models--org--tiny-mtp");
    let snapshot = repo.join("snapshots").join("0123abcd");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), "0123abcd").unwrap();
    std::fs::copy(bundled(), snapshot.join("tiny-qwen35-mtp-Q8_0.gguf")).unwrap();
    std::fs::write(snapshot.join("README.md"), "a model card").unwrap();
    let hf = |args: &[&str], offline: bool| {
        let mut c = bin();
        c.args(args).env("HF_HOME", &home).env_remove("HF_TOKEN");
        if offline {
            c.env("HF_HUB_OFFLINE", "1");
        } else {
            // A closed port on loopback: the hub cannot be reached.
            c.env_remove("HF_HUB_OFFLINE")
                .env("HF_ENDPOINT", "http://127.0.0.1:9");
        }
        c.output().unwrap()
    };
    let gen = [
        "-p",
        "def f():",
        "-n",
        "6",
        "--temp",
        "0",
        "--spec-type",
        "nextn",
    ];
    let from_hub = hf(
        &[&["run", "-hf", "org/tiny-mtp:Q8_0"][..], &gen].concat(),
        true,
    );
    assert!(from_hub.status.success(), "{}", stderr(&from_hub));
    let local = run(&[&["run", "-m", bundled().to_str().unwrap()][..], &gen].concat());
    assert_eq!(stdout(&from_hub), stdout(&local));
    // -hff names the file; a quant the repository lacks is an error that lists what it has.
    let by_file = hf(
        &[
            &[
                "run",
                "-hf",
                "org/tiny-mtp",
                "-hff",
                "tiny-qwen35-mtp-Q8_0.gguf",
            ][..],
            &gen,
        ]
        .concat(),
        true,
    );
    assert!(by_file.status.success(), "{}", stderr(&by_file));
    let o = hf(&["run", "-hf", "org/tiny-mtp:Q2_K", "-p", "x"], true);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("no GGUF file for Q2_K")
            && stderr(&o).contains("tiny-qwen35-mtp-Q8_0.gguf"),
        "{}",
        stderr(&o)
    );
    let o = hf(&["run", "-hf", "org/absent", "-p", "x"], true);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("HF_HUB_OFFLINE is set and org/absent is not in the cache"),
        "{}",
        stderr(&o)
    );
    let o = hf(&["serve", "-hf", "org/absent", "--port", "0"], false);
    assert!(
        !o.status.success(),
        "serve -hf must not exit 0 when it cannot get the model"
    );
    assert!(
        stderr(&o).contains("cannot list org/absent on the Hugging Face hub (http://127.0.0.1:9)"),
        "{}",
        stderr(&o)
    );
    let o = run(&["run", "-hf", "not-a-repo", "-p", "x"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("expected a repository as ORG/NAME"),
        "{}",
        stderr(&o)
    );
}

/// `bench --force-acceptance`: the real loop at a chosen acceptance keeps each draft position
/// in its requested share of steps, its output is plain decoding's token for token (at
/// temperature 0 and with a seed), the measured speedup sits next to the projection at the same
/// rates, and rates that cannot be marginal are refused.
#[test]
fn bench_forced_acceptance_keeps_the_requested_rates_and_the_plain_output() {
    let dir = tmp("bench-forced");
    std::fs::create_dir_all(&dir).unwrap();
    let m = bundled();
    let rates = [0.95, 0.86, 0.75];
    for temp in ["0", "0.7"] {
        let json_path = dir.join(format!("forced-{temp}.json"));
        let o = run(&[
            "bench",
            "-m",
            m.to_str().unwrap(),
            "-n",
            "160",
            "--spec-draft-n-max",
            "3",
            "--temp",
            temp,
            "--force-acceptance",
            "0.95,0.86,0.75",
            "--reps",
            "1",
            "--check",
            "--json",
            json_path.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(stdout(&o).contains("projected; measured"), "{}", stdout(&o));
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
        assert_eq!(v["check"]["spec_agree"], 1.0, "temp {temp}");
        let runs = v["runs"].as_array().unwrap();
        assert_eq!(runs[0]["n_max"], 0, "the plain run goes first");
        let spec = &runs[1]["spec"];
        let (kept, drafted) = (&spec["accepted_per_pos"], &spec["drafted_per_pos"]);
        for (i, &r) in rates.iter().enumerate() {
            let (k, d) = (kept[i].as_f64().unwrap(), drafted[i].as_f64().unwrap());
            assert!(d >= 300.0, "position {i}: only {d} steps");
            // Binomial spread at ~330 steps is under 0.025; the draws are seeded.
            assert!(
                (k / d - r).abs() < 0.06,
                "temp {temp}, position {i}: kept {k} of {d}, asked {r}"
            );
        }
        let p = &v["projections"][2];
        assert!(p["measured_speedup"].as_f64().unwrap() > 0.0);
        assert!(p["speedup"].as_f64().unwrap() > 0.0);
    }
    let o = run(&[
        "bench",
        "-m",
        m.to_str().unwrap(),
        "--force-acceptance",
        "0.8,0.9",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("cannot grow"), "{}", stderr(&o));
}

/// The load line states what the full context costs in KV memory, the NextN head's own cache
/// (one attention layer more) included: the bundled model has two full-attention layers, so the
/// total is three times the head's share, and q4_0 holds the same context in under a third of f16.
#[test]
fn run_reports_the_kv_memory_of_the_full_context_with_the_head() {
    let m = bundled();
    // The load line of `run -c 262144` with these extra flags.
    let load_line = |extra: &[&str]| -> String {
        let mut args = vec!["run", "-m", m.to_str().unwrap(), "-p", "def f", "-n", "1"];
        args.extend(["-c", "262144"]);
        args.extend(extra);
        let o = run(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        stderr(&o).lines().next().unwrap_or_default().to_string()
    };
    let mib = |ty: &str| -> (f64, f64) {
        let line = load_line(&["-ctk", ty, "-ctv", ty, "--spec-type", "nextn"]);
        let number_before = |marker: &str| -> f64 {
            let head = &line[..line.find(marker).unwrap_or_else(|| panic!("{line}"))];
            head.rsplit(' ').next().unwrap().parse().unwrap()
        };
        let total = number_before(" MiB at full context");
        let head_part = line
            .split("the NextN head's ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .unwrap_or_else(|| panic!("{line}"))
            .parse()
            .unwrap();
        (total, head_part)
    };
    let (f16_total, f16_head) = mib("f16");
    assert!(
        (f16_total - 3.0 * f16_head).abs() < 0.2,
        "{f16_total} {f16_head}"
    );
    let (q4_total, q4_head) = mib("q4_0");
    assert!(
        (q4_total - 3.0 * q4_head).abs() < 0.2,
        "{q4_total} {q4_head}"
    );
    assert!(q4_total < f16_total / 3.0, "{q4_total} vs {f16_total}");
    // Without drafting the head keeps no cache, and the line counts the trunk's alone.
    let line = load_line(&[]);
    let trunk_only = format!("{:.1} MiB at full context,", f16_total - f16_head);
    assert!(line.contains(&trunk_only), "{line}");
    assert!(!line.contains("NextN head's"), "{line}");
}
