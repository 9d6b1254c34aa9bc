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

fn dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("nextn-cli-images-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn picture() -> String {
    let p = nextn_testdata::repo_root().join("crates/nextn-vision/tests/data/ramp-100x75.png");
    p.to_str().expect("utf-8 path").to_string()
}

#[test]
fn run_with_an_image_drafts_the_plain_tokens() {
    let d = dir();
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
