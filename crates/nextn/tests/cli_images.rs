//! `nextn run --mmproj F --image IMG` on the bundled model with a random-weight mmproj written
//! for its width: MTP drafting gives the plain tokens with an image, the encode is reported, the
//! image's placement follows llama-mtmd-cli, and missing projectors and broken images fail
//! clearly.

use std::path::PathBuf;
use std::process::{Command, Output};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nextn"))
        .args(args)
        .output()
        .expect("run nextn")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A temporary folder of the test `name` (tests run in parallel, each in its own).
fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("nextn-cli-images-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn picture() -> String {
    let p = nextn_testdata::repo_root().join("crates/nextn-vision/tests/data/ramp-100x75.png");
    p.to_str().expect("utf-8 path").to_string()
}

#[test]
fn run_with_an_image_drafts_the_plain_tokens() {
    let d = dir("run");
    let mmproj = d.join("mmproj.gguf");
    nextn_vision::synth::write_mmproj(&nextn_vision::synth::TowerSpec::fixture(256), &mmproj)
        .expect("write mmproj");
    let model = nextn_testdata::bundled_model();
    let (m, mp, img) = (model.to_str().unwrap(), mmproj.to_str().unwrap(), picture());
    let base = [
        "run",
        "-m",
        m,
        "--mmproj",
        mp,
        "--image",
        &img,
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
    ];
    let plain = run(&base);
    assert!(plain.status.success(), "{}", text(&plain.stderr));
    let plain: serde_json::Value = serde_json::from_str(&text(&plain.stdout)).expect("json");
    assert_eq!(plain["timings"]["images_encoded"], 1, "{plain}");
    let mut with_head = base.to_vec();
    with_head.extend(["--spec-type", "nextn"]);
    let mtp = run(&with_head);
    assert!(mtp.status.success(), "{}", text(&mtp.stderr));
    assert!(
        text(&mtp.stderr).contains("images: 1 encoded"),
        "{}",
        text(&mtp.stderr)
    );
    let mtp: serde_json::Value = serde_json::from_str(&text(&mtp.stdout)).expect("json");
    assert_eq!(mtp["tokens"], plain["tokens"]);
    assert!(mtp["spec"]["draft_n"].as_u64().unwrap() > 0, "{mtp}");

    // Without images in it the prompt is shorter by the image's rows.
    let text_only = run(&[
        "run",
        "-m",
        m,
        "-p",
        "Describe it.",
        "--chat",
        "-n",
        "1",
        "--json",
        "-t",
        "2",
    ]);
    let text_only: serde_json::Value =
        serde_json::from_str(&text(&text_only.stdout)).expect("json");
    let n = |v: &serde_json::Value| v["prompt_tokens"].as_array().map_or(0, Vec::len);
    assert!(
        n(&plain) > n(&text_only) + 4,
        "{} vs {}",
        n(&plain),
        n(&text_only)
    );

    // A <__media__> marker places the image; the count must match.
    let placed = run(&[
        "run",
        "-m",
        m,
        "--mmproj",
        mp,
        "--image",
        &img,
        "-p",
        "A <__media__> B <__media__>",
        "-n",
        "1",
    ]);
    assert!(!placed.status.success());
    assert!(
        text(&placed.stderr).contains("2 <__media__> markers but 1 --image"),
        "{}",
        text(&placed.stderr)
    );

    let no_projector = run(&["run", "-m", m, "--image", &img, "-p", "x", "-n", "1"]);
    assert!(!no_projector.status.success());
    assert!(
        text(&no_projector.stderr).contains("--mmproj"),
        "{}",
        text(&no_projector.stderr)
    );

    let broken = d.join("broken.png");
    std::fs::write(&broken, b"\x89PNG\r\n\x1a\nnot really").expect("write");
    let o = run(&[
        "run",
        "-m",
        m,
        "--mmproj",
        mp,
        "--image",
        broken.to_str().unwrap(),
        "-p",
        "x",
        "-n",
        "1",
    ]);
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("cannot decode image"),
        "{}",
        text(&o.stderr)
    );

    // A prompt too long with its picture is refused from the picture's header: this file is a
    // header declaring 4000x3000 pixels and nothing else, so decoding it would fail otherwise.
    let header_only = d.join("header-only.png");
    std::fs::write(
        &header_only,
        nextn_vision::synth::png_declaring(4000, 3000, 2, 8),
    )
    .expect("write");
    let o = run(&[
        "run",
        "-m",
        m,
        "--mmproj",
        mp,
        "--image",
        header_only.to_str().unwrap(),
        "-p",
        "x",
        "-n",
        "1",
        "-c",
        "256",
    ]);
    assert!(!o.status.success());
    let err = text(&o.stderr);
    assert!(
        err.contains("image(s)")
            && err.contains("the context holds 256")
            && !err.contains("decode"),
        "{err}"
    );

    let wrong_width = d.join("mmproj-512.gguf");
    nextn_vision::synth::write_mmproj(&nextn_vision::synth::TowerSpec::fixture(512), &wrong_width)
        .expect("write mmproj");
    let o = run(&[
        "run",
        "-m",
        m,
        "--mmproj",
        wrong_width.to_str().unwrap(),
        "--image",
        &img,
        "-p",
        "x",
        "-n",
        "1",
    ]);
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("projection width 512"),
        "{}",
        text(&o.stderr)
    );
    std::fs::remove_dir_all(&d).ok();
}

/// `run -cnv` with stdin piped: the lines and the process's output.
fn talk(args: &[&str], input: &str, env: &[(&str, &std::path::Path)]) -> Output {
    use std::io::Write as _;
    use std::process::Stdio;
    let mut c = Command::new(env!("CARGO_BIN_EXE_nextn"));
    c.args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    let mut child = c.spawn().expect("run nextn");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.as_bytes())
        .expect("write stdin");
    child.wait_with_output().expect("wait for nextn")
}

/// The `[prompt ...]` line of each answered turn.
fn turns(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.starts_with("[prompt "))
        .collect()
}

/// A chat (`-cnv`) with pictures as llama-mtmd-cli's chat mode takes them: `/image PATH` (or
/// `--image`) goes with the next message, whose answer is the one-shot `-p` answer to the same
/// prompt; the next turn resumes after the image without encoding it again; a missing or broken
/// file and a chat without a projector say so and the chat goes on.
#[test]
fn conversation_takes_images() {
    let d = dir("cnv");
    let mmproj = d.join("mmproj.gguf");
    nextn_vision::synth::write_mmproj(&nextn_vision::synth::TowerSpec::fixture(256), &mmproj)
        .expect("write mmproj");
    let model = nextn_testdata::bundled_model();
    let (m, mp, img) = (model.to_str().unwrap(), mmproj.to_str().unwrap(), picture());
    let common = ["-m", m, "--mmproj", mp, "-n", "8", "--temp", "0", "-t", "2"];
    let one_shot = run(&[
        &["run"][..],
        &common,
        &["--image", &img, "-p", "Describe it.", "--chat"],
    ]
    .concat());
    assert!(one_shot.status.success(), "{}", text(&one_shot.stderr));
    let first = text(&one_shot.stdout);
    assert!(!first.trim().is_empty(), "no answer");

    let chat = talk(
        &[&["run"][..], &common, &["-cnv"]].concat(),
        &format!("/image {img}\nDescribe it.\nAnd the colours?\n"),
        &[],
    );
    let err = text(&chat.stderr);
    assert!(chat.status.success(), "{err}");
    assert!(err.contains("image loaded"), "{err}");
    let out = text(&chat.stdout);
    assert!(
        out.starts_with(&first) && out.len() > first.len(),
        "chat: {out:?}\none-shot: {first:?}"
    );
    let t = turns(&err);
    assert_eq!(t.len(), 2, "{err}");
    assert!(t[0].contains("1 image(s) encoded"), "{err}");
    assert!(
        !t[1].contains("encoded"),
        "the image was encoded again: {err}"
    );
    // The second turn resumes past the image's rows (more than the text before them).
    let resumed: usize = t[1]
        .split(", ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(resumed > 20, "{err}");

    // --image goes with the first message.
    let chat = talk(
        &[&["run"][..], &common, &["-cnv", "--image", &img]].concat(),
        "Describe it.\n",
        &[],
    );
    assert!(chat.status.success(), "{}", text(&chat.stderr));
    assert_eq!(text(&chat.stdout), first);

    let broken = d.join("broken.png");
    std::fs::write(&broken, b"\x89PNG\r\n\x1a\nnot really").expect("write");
    let missing = d.join("missing.png");
    let chat = talk(
        &[&["run"][..], &common, &["-cnv"]].concat(),
        &format!(
            "/image {}\n/image {}\n/image\nHello.\n",
            missing.display(),
            broken.display()
        ),
        &[],
    );
    let err = text(&chat.stderr);
    assert!(chat.status.success(), "{err}");
    assert!(
        err.contains(&format!("error: /image {}: cannot read", missing.display())),
        "{err}"
    );
    assert!(err.contains("cannot decode image"), "{err}");
    assert!(err.contains("/image needs a file"), "{err}");
    let t = turns(&err);
    assert_eq!(t.len(), 1, "{err}");
    assert!(!t[0].contains("encoded"), "{err}");
    assert!(!text(&chat.stdout).trim().is_empty(), "no answer: {err}");

    // No projector: /image says what is missing, and the chat goes on.
    let chat = talk(
        &["run", "-m", m, "-n", "4", "-t", "2", "-cnv"],
        &format!("/image {img}\nHello.\n"),
        &[],
    );
    let err = text(&chat.stderr);
    assert!(chat.status.success(), "{err}");
    assert!(err.contains("/image needs a vision projector"), "{err}");
    assert_eq!(turns(&err).len(), 1, "{err}");

    // /clear forgets the picture: the next message is text alone.
    let chat = talk(
        &[&["run"][..], &common, &["-cnv"]].concat(),
        &format!("/image {img}\n/clear\nDescribe it.\n"),
        &[],
    );
    let err = text(&chat.stderr);
    assert!(chat.status.success(), "{err}");
    assert!(err.contains("conversation cleared"), "{err}");
    // The picture is what makes the first answer: without it the answer differs.
    assert_ne!(text(&chat.stdout), first, "{err}");
    let t = turns(&err);
    assert_eq!(t.len(), 1, "{err}");
    assert!(!t[0].contains("encoded"), "{err}");
    std::fs::remove_dir_all(&d).ok();
}

/// `-hf ORG/NAME` finds the repository's mmproj beside the model in the hub cache (no network:
/// HF_HUB_OFFLINE, or a hub that cannot be reached), its answer is the one with the same files
/// given by path, and `--no-mmproj` leaves it out.
#[test]
fn hf_model_brings_its_mmproj_from_the_cache() {
    let d = dir("hf");
    let repo = d.join("hub").join("models--org--tiny-vl");
    let snapshot = repo.join("snapshots").join("89abcdef");
    std::fs::create_dir_all(&snapshot).expect("snapshot dir");
    std::fs::create_dir_all(repo.join("refs")).expect("refs dir");
    std::fs::write(repo.join("refs").join("main"), "89abcdef").expect("refs/main");
    let model = nextn_testdata::bundled_model();
    std::fs::copy(&model, snapshot.join("tiny-qwen35-mtp-Q8_0.gguf")).expect("copy model");
    let mmproj = snapshot.join("mmproj-F16.gguf");
    nextn_vision::synth::write_mmproj(&nextn_vision::synth::TowerSpec::fixture(256), &mmproj)
        .expect("write mmproj");
    // A projector of another width: chosen after the F16 one, it would fail the load.
    nextn_vision::synth::write_mmproj(
        &nextn_vision::synth::TowerSpec::fixture(512),
        snapshot.join("mmproj-Q8_0.gguf"),
    )
    .expect("write mmproj");
    let img = picture();
    let gen = [
        "--image",
        &img,
        "-p",
        "Describe it.",
        "--chat",
        "-n",
        "6",
        "--temp",
        "0",
        "--json",
        "-t",
        "2",
    ];
    let hf = |args: &[&str], offline: bool| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_nextn"));
        c.args(args).env("HF_HOME", &d).env_remove("HF_TOKEN");
        if offline {
            c.env("HF_HUB_OFFLINE", "1");
        } else {
            // A closed port on loopback: the hub cannot be reached.
            c.env_remove("HF_HUB_OFFLINE")
                .env("HF_ENDPOINT", "http://127.0.0.1:9");
        }
        c.output().expect("run nextn")
    };
    let local = run(&[
        &["run", "-m", model.to_str().unwrap(), "--mmproj"][..],
        &[mmproj.to_str().unwrap()],
        &gen,
    ]
    .concat());
    assert!(local.status.success(), "{}", text(&local.stderr));
    let local: serde_json::Value = serde_json::from_str(&text(&local.stdout)).expect("json");
    for offline in [true, false] {
        let o = hf(
            &[&["run", "-hf", "org/tiny-vl:Q8_0"][..], &gen].concat(),
            offline,
        );
        assert!(o.status.success(), "{}", text(&o.stderr));
        if !offline {
            assert!(
                text(&o.stderr).contains("using its snapshot in the cache"),
                "{}",
                text(&o.stderr)
            );
        }
        let v: serde_json::Value = serde_json::from_str(&text(&o.stdout)).expect("json");
        assert_eq!(v["timings"]["images_encoded"], 1, "{v}");
        assert_eq!(v["tokens"], local["tokens"]);
        assert_eq!(v["prompt_tokens"], local["prompt_tokens"]);
    }
    let o = hf(
        &[&["run", "-hf", "org/tiny-vl:Q8_0", "--no-mmproj"][..], &gen].concat(),
        true,
    );
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("--image needs a vision projector"),
        "{}",
        text(&o.stderr)
    );
    // A chat finds it too: /image works without --mmproj.
    let chat = talk(
        &[
            "run",
            "-hf",
            "org/tiny-vl:Q8_0",
            "-n",
            "4",
            "-t",
            "2",
            "-cnv",
        ],
        &format!("/image {img}\nDescribe it.\n"),
        &[
            ("HF_HOME", &d),
            ("HF_HUB_OFFLINE", std::path::Path::new("1")),
        ],
    );
    let err = text(&chat.stderr);
    assert!(chat.status.success(), "{err}");
    assert!(
        turns(&err)
            .first()
            .is_some_and(|t| t.contains("1 image(s) encoded")),
        "{err}"
    );
    std::fs::remove_dir_all(&d).ok();
}

/// `synth --mmproj` writes a tower of the released shape for the synthesized model's width, and
/// `bench --mmproj --image` times its encodes on the CPU (the model runs there): the picture's
/// grid, one time per repetition, the rate; an --image without a projector, or a projector
/// without pictures, is refused.
#[test]
fn bench_times_encodes_of_a_synthesized_tower() {
    let d = dir("bench");
    let (model, mmproj) = (d.join("tiny.gguf"), d.join("mmproj.gguf"));
    let o = run(&[
        "synth",
        "--preset",
        "tiny",
        "--type",
        "Q8_0",
        "-o",
        model.to_str().unwrap(),
        "--mmproj",
        mmproj.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("a vision tower of 27 blocks of width 1152 projecting to 128"),
        "{}",
        text(&o.stderr)
    );
    let tower = nextn_vision::VisionTower::load(&mmproj).expect("the synthesized tower loads");
    tower
        .check_text_model(128)
        .expect("it projects to the model's width");
    let (m, mp) = (model.to_str().unwrap(), mmproj.to_str().unwrap());
    let img = picture();
    let o = run(&[
        "bench",
        "-m",
        m,
        "-dev",
        "none",
        "-t",
        "2",
        "--mmproj",
        mp,
        "--image",
        &img,
        "--image-max-tokens",
        "12",
        "-r",
        "2",
        "-o",
        "json",
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let rows: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let row = &rows[0];
    assert_eq!(row["placement"], "cpu", "{row}");
    assert_eq!(row["ms"].as_array().map(Vec::len), Some(2), "{row}");
    let tokens = row["tokens"].as_u64().unwrap();
    assert!((8..=12).contains(&tokens), "{row}");
    assert_eq!(row["patches"].as_u64(), Some(4 * tokens));
    assert!(row["median_ms"].as_f64().unwrap() > 0.0, "{row}");
    assert!(row["per_encode"].is_null(), "{row}");
    assert!(
        text(&o.stderr).contains("on the CPU, 2 threads"),
        "{}",
        text(&o.stderr)
    );

    let o = run(&["bench", "-m", m, "--image", &img]);
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("--image times the vision tower's encodes: give --mmproj FILE"),
        "{}",
        text(&o.stderr)
    );
    let o = run(&["bench", "-m", m, "--mmproj", mp]);
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("pictures given with --image FILE"),
        "{}",
        text(&o.stderr)
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// Vision flags that change nothing say so: without a projector, and --no-mmproj-offload with
/// the model (and so the tower) on the CPU.
#[test]
fn unused_vision_flags_say_they_do_nothing() {
    let model = nextn_testdata::bundled_model();
    let m = model.to_str().unwrap();
    let o = run(&[
        "run",
        "-m",
        m,
        "-p",
        "Hi",
        "-n",
        "1",
        "-dev",
        "none",
        "--no-mmproj-offload",
        "--image-max-tokens",
        "64",
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(
        err.contains("--no-mmproj-offload: no effect (no vision projector is loaded)"),
        "{err}"
    );
    assert!(
        err.contains("--image-max-tokens: no effect (no vision projector is loaded)"),
        "{err}"
    );
    assert!(!err.contains("--image-min-tokens"), "{err}");

    let d = dir("unused");
    let mmproj = d.join("mmproj.gguf");
    nextn_vision::synth::write_mmproj(&nextn_vision::synth::TowerSpec::fixture(256), &mmproj)
        .expect("write mmproj");
    let img = picture();
    let o = run(&[
        "run",
        "-m",
        m,
        "--mmproj",
        mmproj.to_str().unwrap(),
        "--image",
        &img,
        "-p",
        "Hi",
        "-n",
        "1",
        "-dev",
        "none",
        "--no-mmproj-offload",
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(
        err.contains(
            "--no-mmproj-offload: no effect (the model runs on the CPU, and the tower with it)"
        ),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}
