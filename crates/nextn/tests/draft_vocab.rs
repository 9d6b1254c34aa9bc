//! The trimmed draft head (`--spec-draft-vocab N`) and `nextn vocab-stats` through the real binary
//! on the bundled model: output stays exact, rankings round-trip, bad input fails clearly.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn bundled() -> PathBuf {
    nextn_testdata::bundled_model()
}

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nextn"))
        .args(args)
        .output()
        .expect("run nextn")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn json_of(o: &Output) -> Value {
    assert!(o.status.success(), "{}", stderr(o));
    serde_json::from_slice(&o.stdout).expect("--json prints JSON")
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nextn-draft-vocab-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn generate(prompt: &str, n: &str, extra: &[&str]) -> Value {
    let m = bundled();
    let mut args = vec![
        "run",
        "-m",
        m.to_str().unwrap(),
        "-p",
        prompt,
        "-n",
        n,
        "--json",
        "-t",
        "2",
    ];
    args.extend_from_slice(extra);
    json_of(&run(&args))
}

const PROMPTS: [&str; 3] = [
    "def fibonacci(n):\n",
    "The quick brown fox",
    "fn main() {\n    let v = vec![1, 2, 3];\n",
];

#[test]
fn greedy_output_with_a_trimmed_head_equals_plain_decoding() {
    for prompt in PROMPTS {
        let plain = generate(prompt, "20", &["--temp", "0", "--spec-type", "none"]);
        assert!(plain.get("spec").is_none());
        for n_max in ["1", "2", "3"] {
            let v = generate(
                prompt,
                "20",
                &[
                    "--temp",
                    "0",
                    "--spec-type",
                    "nextn",
                    "--spec-draft-n-max",
                    n_max,
                    "--spec-draft-vocab",
                    "1024",
                ],
            );
            assert_eq!(
                v["tokens"], plain["tokens"],
                "prompt {prompt:?} n_max {n_max}"
            );
            assert_eq!(v["text"], plain["text"]);
            assert_eq!(v["spec"]["draft_vocab"], 1024);
            assert_eq!(v["spec"]["n_vocab"], 8192);
            assert!(v["spec"]["draft_n"].as_u64().unwrap() > 0);
        }
    }
}

#[test]
fn sampled_output_with_greedy_drafts_from_a_trimmed_head_equals_plain_sampling() {
    let prompt = PROMPTS[0];
    let sampling = ["--temp", "0.8", "-s", "11"];
    let plain = generate(prompt, "16", &sampling);
    let mut args = sampling.to_vec();
    args.extend_from_slice(&[
        "--spec-type",
        "nextn",
        "--spec-draft-sampling",
        "greedy",
        "--spec-draft-vocab",
        "300",
    ]);
    let v = generate(prompt, "16", &args);
    assert_eq!(v["tokens"], plain["tokens"]);
    assert_eq!(v["spec"]["draft_vocab"], 300);
}

#[test]
fn full_head_reports_the_whole_vocabulary() {
    let v = generate(PROMPTS[1], "4", &["--temp", "0", "--spec-type", "nextn"]);
    assert_eq!(v["spec"]["draft_vocab"], 8192);
}

#[test]
fn vocab_stats_writes_rankings_that_load() {
    let m = bundled();
    let m = m.to_str().unwrap();
    let dir = tmp("corpus");
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    std::fs::write(
        dir.join("a.py"),
        "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n".repeat(20),
    )
    .unwrap();
    std::fs::write(
        dir.join("sub/b.txt"),
        "The cat sat on the mat. The dog sat on the log.\n".repeat(30),
    )
    .unwrap();
    std::fs::write(dir.join("sub/binary.dat"), [0xffu8, 0xfe, 0x00, 0x80]).unwrap();
    let text = tmp("ranking.txt");
    let o = run(&[
        "vocab-stats",
        "-m",
        m,
        dir.to_str().unwrap(),
        "-o",
        text.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("1 skipped"), "{}", stderr(&o));
    let written = std::fs::read_to_string(&text).unwrap();
    let mut lines = written.lines();
    let header = lines.next().unwrap();
    assert!(header.starts_with("# nextn vocab-stats:"), "{header}");
    assert!(header.contains("from 2 files"), "{header}");
    let rows: Vec<(u32, u64)> = lines
        .filter(|l| !l.starts_with('#'))
        .map(|l| {
            let mut f = l.split_whitespace();
            (
                f.next().unwrap().parse().unwrap(),
                f.next().unwrap().parse().unwrap(),
            )
        })
        .collect();
    assert_eq!(rows.len(), 8192, "every id is listed");
    assert!(
        rows.windows(2).all(|w| w[0].1 >= w[1].1),
        "descending counts"
    );
    assert!(rows[0].1 > 0);

    let binary = tmp("ranking.bin");
    let o = run(&[
        "vocab-stats",
        "-m",
        m,
        dir.to_str().unwrap(),
        "-o",
        binary.to_str().unwrap(),
        "--binary",
        "--top",
        "50",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(std::fs::read(&binary).unwrap().starts_with(b"NXRANK01"));

    let plain = generate(PROMPTS[0], "12", &["--temp", "0"]);
    for ranking in [&text, &binary] {
        let o = run(&[
            "run",
            "-m",
            m,
            "-p",
            PROMPTS[0],
            "-n",
            "12",
            "--temp",
            "0",
            "--json",
            "--spec-type",
            "nextn",
            "--spec-draft-vocab",
            "64",
            "--spec-draft-vocab-file",
            ranking.to_str().unwrap(),
        ]);
        let v = json_of(&o);
        assert_eq!(v["tokens"], plain["tokens"]);
        assert_eq!(v["spec"]["draft_vocab"], 64);
        assert!(
            stderr(&o).contains(&format!("ranked by {}", ranking.display())),
            "{}",
            stderr(&o)
        );
    }
}

#[test]
fn default_ranking_for_a_small_vocabulary_is_merge_order() {
    let m = bundled();
    let o = run(&[
        "run",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "x",
        "-n",
        "2",
        "--temp",
        "0",
        "--spec-type",
        "nextn",
        "--spec-draft-vocab",
        "100",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("ranked by token id order (BPE merge order)"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn logits_mtp_with_a_trimmed_head_keeps_the_kept_rows() {
    let m = bundled();
    let m = m.to_str().unwrap();
    let logits = |extra: &[&str]| {
        let mut a = vec![
            "logits",
            "-m",
            m,
            "--tokens",
            "5,900,17,3000,42",
            "--mtp",
            "--json",
        ];
        a.extend_from_slice(extra);
        json_of(&run(&a))
    };
    let full = logits(&[]);
    let trimmed = logits(&["--spec-draft-vocab", "2000"]);
    let (fp, tp) = (
        full["positions"].as_array().unwrap(),
        trimmed["positions"].as_array().unwrap(),
    );
    assert_eq!(fp.len(), tp.len());
    for (f, t) in fp.iter().zip(tp) {
        // Fewer tokens in the softmax: the log-sum-exp can only shrink.
        assert!(t["lse"].as_f64().unwrap() <= f["lse"].as_f64().unwrap() + 1e-6);
        // Id order is the ranking here, so the kept tokens are 0..2000 (plus control tokens).
        let top = t["argmax"].as_u64().unwrap();
        assert!(!(2000..8000).contains(&top), "argmax {top}");
        if f["argmax"].as_u64().unwrap() < 2000 {
            assert_eq!(f["argmax"], t["argmax"]);
        }
    }
    let o = run(&[
        "logits",
        "-m",
        m,
        "--tokens",
        "5,6",
        "--spec-draft-vocab",
        "10",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("add --mtp"), "{}", stderr(&o));
}

#[test]
fn bench_reports_the_trimmed_head_next_to_the_full_one() {
    let m = bundled();
    let prompts = tmp("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"name\": \"p\", \"prompt\": \"def f(x):\\n\"}\n",
    )
    .unwrap();
    let json_out = tmp("bench.json");
    let o = run(&[
        "bench",
        "-m",
        m.to_str().unwrap(),
        "--prompts",
        prompts.to_str().unwrap(),
        "-n",
        "8",
        "--spec-draft-n-max",
        "0,1,2",
        "--reps",
        "1",
        "-t",
        "1",
        "--spec-draft-vocab",
        "512",
        "--json",
        json_out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("draft step (vocab    512)"), "{out}");
    assert!(
        out.contains("projected speedup with the trimmed head (vocab 512)"),
        "{out}"
    );
    assert!(out.contains("n_max 2 coupled full head:"), "{out}");
    assert!(out.contains("n_max 2 coupled trimmed head:"), "{out}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json_out).unwrap()).unwrap();
    assert_eq!(v["draft_vocab"]["costs"]["draft_vocab"], 512);
    assert_eq!(v["draft_vocab"]["acceptance"].as_array().unwrap().len(), 2);
}

#[test]
fn bad_draft_vocab_input_gives_clear_errors() {
    let m = bundled();
    let m = m.to_str().unwrap();
    let spec = |extra: &[&str]| {
        let mut a = vec!["run", "-m", m, "-p", "x", "-n", "2", "--spec-type", "nextn"];
        a.extend_from_slice(extra);
        run(&a)
    };
    let fails_with = |o: Output, what: &str| {
        assert!(!o.status.success(), "should fail: {what}");
        assert!(
            stderr(&o).contains(what),
            "expected {what:?} in: {}",
            stderr(&o)
        );
    };
    fails_with(
        spec(&["--spec-draft-vocab", "0"]),
        "--spec-draft-vocab 0 is out of range",
    );
    fails_with(
        spec(&["--spec-draft-vocab", "9000"]),
        "must be between 1 and the vocabulary size 8192",
    );
    let bad = tmp("bad-ranking.txt");
    std::fs::write(&bad, "# header\n5 10\nfive 3\n").unwrap();
    fails_with(
        spec(&[
            "--spec-draft-vocab",
            "10",
            "--spec-draft-vocab-file",
            bad.to_str().unwrap(),
        ]),
        &format!(
            "token ranking {}, line 3: 'five' is not a token id",
            bad.display()
        ),
    );
    let range = tmp("range-ranking.txt");
    std::fs::write(&range, "5 10\n8192 3\n").unwrap();
    fails_with(
        spec(&[
            "--spec-draft-vocab",
            "10",
            "--spec-draft-vocab-file",
            range.to_str().unwrap(),
        ]),
        "token id 8192 (line 2) is out of range",
    );
    let missing = tmp("no-such-ranking.txt");
    fails_with(
        spec(&[
            "--spec-draft-vocab",
            "10",
            "--spec-draft-vocab-file",
            missing.to_str().unwrap(),
        ]),
        "cannot read token ranking",
    );
    // The shipped Qwen3.5/3.6 ranking names ids far beyond this model's vocabulary.
    let shipped =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/qwen35-token-ranking.bin");
    fails_with(
        spec(&[
            "--spec-draft-vocab",
            "10",
            "--spec-draft-vocab-file",
            shipped.to_str().unwrap(),
        ]),
        "is out of range: the model's vocabulary has 8192 tokens",
    );
    fails_with(
        spec(&["--spec-draft-vocab-file", bad.to_str().unwrap()]),
        "--spec-draft-vocab",
    );
    let o = run(&[
        "vocab-stats",
        "-m",
        m,
        tmp("nothing-here").to_str().unwrap(),
        "-o",
        tmp("x").to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("cannot read"), "{}", stderr(&o));
}

#[test]
fn shipped_ranking_is_chosen_for_the_qwen_tokenizer_only() {
    let m = bundled();
    let path = tmp("qwen-vocab.gguf");
    let p = path.to_str().unwrap();
    let o = run(&[
        "synth", "--preset", "tiny", "--vocab", "248320", "--type", "Q8_0", "-o", p, "-t", "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let prompt = "def f(x):\n    return x";
    let runner = |model: &str, extra: &[&str]| {
        let mut a = vec![
            "run", "-m", model, "-p", prompt, "-n", "10", "--temp", "0", "--json", "-t", "2",
        ];
        a.extend_from_slice(extra);
        let o = run(&a);
        (json_of(&o), stderr(&o))
    };
    let (plain, _) = runner(p, &[]);
    let (v, err) = runner(p, &["--spec-type", "nextn", "--spec-draft-vocab", "4096"]);
    assert!(
        err.contains("ranked by models/qwen35-token-ranking.bin"),
        "{err}"
    );
    assert_eq!(v["tokens"], plain["tokens"]);
    assert_eq!(v["spec"]["draft_vocab"], 4096);
    // N = 1 still keeps every control token (<|im_end|>, <|endoftext|>, ...) the model may emit.
    let (v, _) = runner(p, &["--spec-type", "nextn", "--spec-draft-vocab", "1"]);
    assert!(
        v["spec"]["draft_vocab"].as_u64().unwrap() > 10,
        "{}",
        v["spec"]
    );
    assert_eq!(v["tokens"], plain["tokens"]);
    // A vocabulary of another size (the bundled model shares Qwen's first token strings) falls back.
    let (_, err) = runner(
        m.to_str().unwrap(),
        &["--spec-type", "nextn", "--spec-draft-vocab", "64"],
    );
    assert!(
        err.contains("ranked by token id order (BPE merge order)"),
        "{err}"
    );
}
