//! The chat page at `/` in a real headless Chromium (Debian's `chromium`, driven by
//! `tools/browser/chat_page_check.mjs` through playwright-core): it loads, sends a prompt, shows
//! the streamed answer and its statistics (speed, draft acceptance), and the screenshot is saved
//! under target/ for the log; a long prompt shows how much of it has been read before the answer.

mod serve_common;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;

use std::path::Path;
use std::process::Command;

use serve_common::{missing_browser, Server};

/// What the page showed for `prompt` (tools/browser/chat_page_check.mjs), with its screenshot
/// saved at `shot`.
fn page_check(s: &Server, shot: &Path, prompt: &str) -> serde_json::Value {
    page_check_with(s, shot, prompt, None)
}

/// [`page_check`], with `image` attached through the page's attach button.
fn page_check_with(
    s: &Server,
    shot: &Path,
    prompt: &str,
    image: Option<&Path>,
) -> serde_json::Value {
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/browser/chat_page_check.mjs");
    let out = Command::new("node")
        .arg(&script)
        .arg(format!("http://127.0.0.1:{}/", s.port))
        .arg(shot)
        .arg(prompt)
        .args(image)
        .env("NO_PROXY", "127.0.0.1,localhost")
        .output()
        .expect("run node");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap()
}

#[test]
fn the_chat_page_streams_an_answer_with_its_statistics() {
    if let Some(why) = missing_browser() {
        assert!(!nextn_testdata::in_ci(), "required in CI (CI=true): {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let s = Server::start(&[
        "--spec-type",
        "nextn",
        "--temp",
        "0",
        "--repeat-penalty",
        "1.3",
        "-n",
        "48",
    ]);
    let page = s.get("/");
    assert_eq!(page.status, 200);
    assert!(page
        .header("content-type")
        .unwrap()
        .starts_with("text/html"));
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("chat-page.png");
    let _ = std::fs::remove_file(&shot);
    let shown = page_check(&s, &shot, "Write a Python function that reverses a string.");
    // The page shows the model's answer as the API gives it.
    let api = s.post(
        "/v1/chat/completions",
        &serde_json::json!({"messages": [{"role": "user", "content": "Write a Python function that reverses a string."}]}),
    );
    let api = api.json();
    let api_text = api["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(shown["answer"].as_str().unwrap().trim(), api_text.trim());
    let stats = shown["stats"].as_str().unwrap();
    let n = api["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(
        stats.starts_with(&format!("{n} tokens, ")) && stats.contains("tok/s"),
        "{stats}"
    );
    assert!(
        stats.contains("drafts accepted") || !stats.contains("drafts"),
        "{stats}"
    );
    assert!(
        shown["model"].as_str().unwrap().contains("MTP drafting"),
        "{shown}"
    );
    assert_eq!(shown["prompt_progress_shown"], false, "{shown}");
    // A prompt of a few thousand tokens takes several prompt chunks: the answer's place shows
    // how far it has been read until the answer begins.
    let long = "Here is a log line: GET /index.html 200 0.12 ms. ".repeat(100);
    let long_shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("chat-page-long.png");
    let shown = page_check(&s, &long_shot, &format!("{long}\nSummarise the log."));
    assert_eq!(shown["prompt_progress_shown"], true, "{shown}");
    let png = std::fs::read(&shot).expect("a screenshot");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "screenshot of {} bytes",
        png.len()
    );
    eprintln!("screenshot: {}", shot.display());
}

/// With a vision tower the page offers its attach button: a picture attached there goes with the
/// message (its rows counted in the prompt, as the API counts the same message), shows in the
/// user's bubble, and the answer streams as for text; without one the button is not offered.
#[test]
fn the_chat_page_attaches_an_image() {
    if let Some(why) = missing_browser() {
        assert!(!nextn_testdata::in_ci(), "required in CI (CI=true): {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let dir = std::env::temp_dir().join(format!("nextn-page-image-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mmproj = dir.join("mmproj.gguf");
    nextn_vision::synth::write_mmproj(&nextn_vision::synth::TowerSpec::fixture(256), &mmproj)
        .unwrap();
    let picture =
        nextn_testdata::repo_root().join("crates/nextn-vision/tests/data/ramp-100x75.png");
    let s = Server::start(&[
        "--temp",
        "0",
        "-n",
        "8",
        "--mmproj",
        mmproj.to_str().unwrap(),
    ]);
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("chat-page-image.png");
    let shown = page_check_with(&s, &shot, "What is in the picture?", Some(&picture));
    assert_eq!(shown["attach_offered"], true, "{shown}");
    assert_eq!(shown["user_images"], 1, "{shown}");
    let png = std::fs::read(&picture).unwrap();
    let url = format!("data:image/png;base64,{}", STANDARD.encode(&png));
    let api = s
        .post(
            "/v1/chat/completions",
            &serde_json::json!({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is in the picture?"}]}]}),
        )
        .json();
    let prompt_tokens = api["usage"]["prompt_tokens"].as_u64().unwrap();
    let stats = shown["stats"].as_str().unwrap();
    assert!(
        stats.contains(&format!("prompt {prompt_tokens} tokens")),
        "{stats} vs the API's {prompt_tokens} prompt tokens"
    );
    std::fs::remove_dir_all(&dir).ok();
    let plain = Server::start(&["-n", "4"]);
    let shown = page_check(&plain, &shot, "hi");
    assert_eq!(shown["attach_offered"], false, "{shown}");
}
