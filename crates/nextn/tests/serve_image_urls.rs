//! `nextn serve --allow-image-urls`: image parts given as http:// URLs are fetched from a small
//! HTTP server in this test process (the ramp picture, a 404, a response slower than
//! `--image-url-timeout`, bodies over `--image-url-max-bytes` with and without a Content-Length,
//! redirect chains, a damaged picture), and a server without the flag refuses them naming it.

mod serve_common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde_json::{json, Value};

/// `--image-url-max-bytes` for the tests: above the ramp picture (about 20 KB).
const CAP: usize = 32768;

/// A loopback HTTP/1.1 server, one thread per connection, that records each request's path and
/// User-Agent.
struct Origin {
    port: u16,
    seen: Arc<Mutex<Vec<(String, String)>>>,
}

impl Origin {
    fn start() -> Origin {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let png = Arc::new(serve_common::ramp_png());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let (s, png) = (s.clone(), png.clone());
                std::thread::spawn(move || serve_one(conn, &s, &png));
            }
        });
        Origin { port, seen }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// How many requests asked for `path`.
    fn hits(&self, path: &str) -> usize {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, _)| p == path)
            .count()
    }
}

fn serve_one(conn: TcpStream, seen: &Mutex<Vec<(String, String)>>, png: &[u8]) {
    let mut r = BufReader::new(conn.try_clone().expect("clone"));
    let mut line = String::new();
    if r.read_line(&mut line).is_err() {
        return;
    }
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let agent = headers.get("user-agent").cloned().unwrap_or_default();
    seen.lock().unwrap().push((path.clone(), agent));
    let mut w = conn;
    let head = |status: &str, extra: &str| {
        format!("HTTP/1.1 {status}\r\nConnection: close\r\n{extra}\r\n").into_bytes()
    };
    let with_length = |status: &str, kind: &str, body: &[u8]| {
        let mut out = head(
            status,
            &format!("Content-Type: {kind}\r\nContent-Length: {}\r\n", body.len()),
        );
        out.extend_from_slice(body);
        out
    };
    // Writes may fail once the fetching side has given up: that is part of the test.
    let out = match path.as_str() {
        "/ramp.png" => with_length("200 OK", "image/png", png),
        "/missing.png" => with_length("404 Not Found", "text/plain", b"no such picture"),
        "/damaged.png" => with_length("200 OK", "image/png", b"not a picture at all"),
        "/slow.png" => {
            std::thread::sleep(Duration::from_secs(3));
            with_length("200 OK", "image/png", png)
        }
        "/declared-too-large.png" => {
            // The head alone, then nothing: a fetch that waited for the body would time out
            // instead of refusing the length.
            let _ = w.write_all(&head(
                "200 OK",
                &format!("Content-Type: image/png\r\nContent-Length: {}\r\n", 4 * CAP),
            ));
            std::thread::sleep(Duration::from_secs(5));
            return;
        }
        "/chunked-too-large.png" => {
            let _ = w.write_all(&head(
                "200 OK",
                "Content-Type: image/png\r\nTransfer-Encoding: chunked\r\n",
            ));
            // Twice the cap in chunks, then the body stays open: only a fetch that counts the
            // bytes as they come ends before its time limit.
            let chunk = vec![0x55u8; 4096];
            for _ in 0..(2 * CAP / chunk.len()) {
                let mut c = format!("{:x}\r\n", chunk.len()).into_bytes();
                c.extend_from_slice(&chunk);
                c.extend_from_slice(b"\r\n");
                if w.write_all(&c).is_err() {
                    return;
                }
            }
            std::thread::sleep(Duration::from_secs(5));
            return;
        }
        "/to-file.png" => head(
            "302 Found",
            "Location: file:///etc/passwd\r\nContent-Length: 0\r\n",
        ),
        p if p.starts_with("/hops/") => {
            let n: usize = p["/hops/".len()..].parse().unwrap_or(0);
            let next = if n <= 1 {
                "/ramp.png".to_string()
            } else {
                format!("/hops/{}", n - 1)
            };
            head(
                "302 Found",
                &format!("Location: {next}\r\nContent-Length: 0\r\n"),
            )
        }
        _ => with_length("404 Not Found", "text/plain", b"unknown"),
    };
    let _ = w.write_all(&out);
}

/// A chat request whose second part is an image at `url`.
fn chat_with(url: &str) -> Value {
    json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": url}}]}],
        "max_tokens": 6, "temperature": 0, "cache_prompt": false})
}

const FIELD: &str = "messages[0].content[1].image_url.url";

/// A 400 of the image kind whose message names `field` and every one of `words`.
fn assert_refused(r: &serve_common::Response, field: &str, words: &[&str]) {
    assert_eq!(r.status, 400, "{}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert_eq!(v["error"]["param"], field, "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(field), "{message}");
    for w in words {
        assert!(message.contains(w), "no {w:?} in {message}");
    }
}

#[test]
fn image_urls_are_fetched_within_their_limits() {
    let origin = Origin::start();
    let cap = CAP.to_string();
    let s = serve_common::start_with_mmproj(&[
        "-np",
        "1",
        "-c",
        "1024",
        "--allow-image-urls",
        "--image-url-timeout",
        "1",
        "--image-url-max-bytes",
        &cap,
    ]);
    assert!(
        s.log_text().contains("image URLs: fetched"),
        "{}",
        s.log_text()
    );

    // The fetched picture is the same prompt, and the same answer, as the picture inline.
    let inline = format!(
        "data:image/png;base64,{}",
        STANDARD.encode(serve_common::ramp_png())
    );
    let by_value = s.post("/v1/chat/completions", &chat_with(&inline));
    assert_eq!(by_value.status, 200, "{}", by_value.text());
    let by_url = s.post("/v1/chat/completions", &chat_with(&origin.url("/ramp.png")));
    assert_eq!(by_url.status, 200, "{}", by_url.text());
    let (a, b) = (by_value.json(), by_url.json());
    assert_eq!(a["usage"]["prompt_tokens"], b["usage"]["prompt_tokens"]);
    assert_eq!(
        a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"],
        "{a}\n{b}"
    );
    assert_eq!(b["timings"]["images_encoded"], 1, "{b}");
    let agents: Vec<String> = origin
        .seen
        .lock()
        .unwrap()
        .iter()
        .map(|(_, a)| a.clone())
        .collect();
    assert_eq!(
        agents,
        vec![format!("nextn/{}", env!("CARGO_PKG_VERSION"))],
        "User-Agent"
    );

    // Five redirects are followed; a sixth is not.
    let r = s.post("/v1/chat/completions", &chat_with(&origin.url("/hops/5")));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["usage"]["prompt_tokens"],
        a["usage"]["prompt_tokens"]
    );
    let (ramp_before, last_before) = (origin.hits("/ramp.png"), origin.hits("/hops/1"));
    let r = s.post("/v1/chat/completions", &chat_with(&origin.url("/hops/6")));
    assert_refused(&r, FIELD, &["more than 5 redirects"]);
    // Five of the six redirects were followed, the sixth (from /hops/1) was not.
    assert_eq!(origin.hits("/hops/1"), last_before + 1);
    assert_eq!(
        origin.hits("/ramp.png"),
        ramp_before,
        "the sixth redirect was followed"
    );

    let t0 = std::time::Instant::now();
    let r = s.post("/v1/chat/completions", &chat_with(&origin.url("/slow.png")));
    assert_refused(&r, FIELD, &["took longer than 1 s"]);
    assert!(
        t0.elapsed() < Duration::from_millis(2800),
        "{:?}",
        t0.elapsed()
    );

    let larger = format!("larger than {CAP} bytes");
    let r = s.post(
        "/v1/chat/completions",
        &chat_with(&origin.url("/declared-too-large.png")),
    );
    assert_refused(&r, FIELD, &[&larger, "Content-Length"]);
    let r = s.post(
        "/v1/chat/completions",
        &chat_with(&origin.url("/chunked-too-large.png")),
    );
    assert_refused(&r, FIELD, &[&larger]);

    let r = s.post(
        "/v1/chat/completions",
        &chat_with(&origin.url("/missing.png")),
    );
    assert_refused(&r, FIELD, &["404"]);
    let r = s.post(
        "/v1/chat/completions",
        &chat_with(&origin.url("/to-file.png")),
    );
    assert_refused(&r, FIELD, &["'file:'", "only http:// and https://"]);
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let r = s.post(
        "/v1/chat/completions",
        &chat_with(&format!("http://127.0.0.1:{closed}/a.png")),
    );
    assert_refused(&r, FIELD, &["cannot connect", "refused"]);
    // Fetched bytes are checked as inline ones are.
    let r = s.post(
        "/v1/chat/completions",
        &chat_with(&origin.url("/damaged.png")),
    );
    assert_refused(&r, FIELD, &["cannot decode"]);
    let r = s.post(
        "/v1/chat/completions",
        &chat_with("ftp://127.0.0.1/ramp.png"),
    );
    assert_refused(&r, FIELD, &["'ftp:'"]);

    // Of several images, the first that fails in the request's order is the answer.
    let mut two = chat_with(&origin.url("/ramp.png"));
    two["messages"][0]["content"]
        .as_array_mut()
        .unwrap()
        .push(json!({"type": "image_url", "image_url": {"url": origin.url("/missing.png")}}));
    let r = s.post("/v1/chat/completions", &two);
    assert_refused(&r, "messages[0].content[2].image_url.url", &["404"]);

    // Messages `url` sources and Responses `input_image` URLs take the same path.
    let message = |source: Value| {
        json!({"model": "m", "max_tokens": 4, "temperature": 0, "thinking": {"type": "disabled"},
               "messages": [{"role": "user", "content": [
                   {"type": "image", "source": source},
                   {"type": "text", "text": "What is in this picture?"}]}]})
    };
    let count = |body: &Value| {
        let r = s.post("/v1/messages/count_tokens", body);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["input_tokens"].as_u64().unwrap()
    };
    let b64 = STANDARD.encode(serve_common::ramp_png());
    assert_eq!(
        count(&message(
            json!({"type": "url", "url": origin.url("/ramp.png")})
        )),
        count(&message(
            json!({"type": "base64", "media_type": "image/png", "data": b64})
        ))
    );
    let r = s.post(
        "/v1/messages",
        &message(json!({"type": "url", "url": origin.url("/missing.png")})),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("404"), "{}", r.text());
    let input = |image_url: String| {
        json!({"model": "m", "max_output_tokens": 4, "temperature": 0,
               "input": [{"role": "user", "content": [
                   {"type": "input_text", "text": "What is in this picture?"},
                   {"type": "input_image", "image_url": image_url}]}]})
    };
    let tokens = |body: &Value| {
        let r = s.post("/v1/responses/input_tokens", body);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["input_tokens"].as_u64().unwrap()
    };
    assert_eq!(
        tokens(&input(origin.url("/ramp.png"))),
        tokens(&input(inline.clone()))
    );
    let r = s.post("/v1/responses", &input(origin.url("/slow.png")));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("took longer than 1 s"), "{}", r.text());
}

#[test]
fn without_the_flag_image_urls_are_refused_naming_it() {
    let origin = Origin::start();
    let s = serve_common::start_with_mmproj(&["-np", "1", "-c", "512"]);
    let r = s.post("/v1/chat/completions", &chat_with(&origin.url("/ramp.png")));
    assert_refused(&r, FIELD, &["--allow-image-urls", "data URI"]);
    let r = s.post("/apply-template", &chat_with(&origin.url("/ramp.png")));
    assert_refused(&r, FIELD, &["--allow-image-urls"]);
    let r = s.post(
        "/v1/messages",
        &json!({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": origin.url("/ramp.png")}}]}]}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("--allow-image-urls"), "{}", r.text());
    assert_eq!(
        origin.hits("/ramp.png"),
        0,
        "nothing is fetched without the flag"
    );
}
