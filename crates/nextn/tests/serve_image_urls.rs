//! `nextn serve --allow-image-urls`: image parts given as http:// URLs are fetched from a small
//! HTTP server in this test process (the ramp picture, a 404, a response slower than
//! `--image-url-timeout`, bodies over `--image-url-max-bytes` with and without a Content-Length,
//! redirect chains, a damaged picture). Every address here is a loopback one, so the servers run
//! with `--image-url-allow-private` (only 127.0.0.1/32 where a redirect to 127.0.0.2 must be
//! refused); without it a loopback URL is refused and the test's server sees no connection.
//! Failures on the network are one message to the client and the cause in the server's log; a
//! request with more URLs than `--image-urls-max` fetches none. A server without the flag
//! refuses image URLs naming it. No test here sends a packet off the machine.

mod serve_common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use nextn_server::image_url::NOT_FETCHED;
use serde_json::{json, Value};

/// `--image-url-max-bytes` for the tests: above the ramp picture (about 20 KB).
const CAP: usize = 32768;

/// A loopback HTTP/1.1 server, one thread per connection, that counts the connections it accepts
/// and records each request's path and User-Agent.
struct Origin {
    ip: &'static str,
    port: u16,
    connections: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<(String, String)>>>,
}

impl Origin {
    fn start() -> Origin {
        Origin::start_at("127.0.0.1")
    }

    /// The server on `ip`, a loopback address.
    fn start_at(ip: &'static str) -> Origin {
        let listener = TcpListener::bind((ip, 0)).expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let connections = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (c, s) = (connections.clone(), seen.clone());
        let png = Arc::new(serve_common::ramp_png());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                c.fetch_add(1, Ordering::SeqCst);
                let (s, png) = (s.clone(), png.clone());
                std::thread::spawn(move || serve_one(conn, &s, &png));
            }
        });
        Origin {
            ip,
            port,
            connections,
            seen,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}:{}{path}", self.ip, self.port)
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

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
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
        p if p.starts_with("/redirect-to/") => {
            // `/redirect-to/HOST:PORT` sends the fetch on to the ramp picture there.
            let to = &p["/redirect-to/".len()..];
            head(
                "302 Found",
                &format!("Location: http://{to}/ramp.png\r\nContent-Length: 0\r\n"),
            )
        }
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

/// A 400 for `field` with the one message every failed fetch gets, whatever its cause.
fn assert_not_fetched(r: &serve_common::Response, field: &str) {
    assert_eq!(r.status, 400, "{}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert_eq!(v["error"]["param"], field, "{v}");
    assert_eq!(
        v["error"]["message"],
        format!("{field}: {NOT_FETCHED}"),
        "{v}"
    );
}

/// Waits until the server's log has a line with every one of `words` (its stderr is read by
/// another thread), and fails naming them if none comes.
fn assert_logged(s: &serve_common::Server, words: &[&str]) {
    let t0 = Instant::now();
    loop {
        let log = s.log_text();
        if log
            .lines()
            .any(|line| words.iter().all(|w| line.contains(w)))
        {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "no log line with {words:?}:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

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
        "--image-url-allow-private=127.0.0.1/32",
        "--image-urls-max",
        "3",
        "--image-url-timeout",
        "1",
        "--image-url-max-bytes",
        &cap,
    ]);
    assert_logged(
        &s,
        &[
            "image URLs: fetched",
            "at most 3 per request",
            "127.0.0.1/32 (--image-url-allow-private)",
        ],
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
    assert_not_fetched(&r, FIELD);
    assert_logged(&s, &[FIELD, "/hops/6", "more than 5 redirects"]);
    // Five of the six redirects were followed, the sixth (from /hops/1) was not.
    assert_eq!(origin.hits("/hops/1"), last_before + 1);
    assert_eq!(
        origin.hits("/ramp.png"),
        ramp_before,
        "the sixth redirect was followed"
    );

    let t0 = std::time::Instant::now();
    let r = s.post("/v1/chat/completions", &chat_with(&origin.url("/slow.png")));
    assert_not_fetched(&r, FIELD);
    assert_logged(&s, &["/slow.png", "took longer than 1 s"]);
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
    // Not a timeout: the length was refused before the body (which never comes) was awaited.
    assert_refused(&r, FIELD, &[&larger]);
    assert_logged(&s, &["/declared-too-large.png", "its Content-Length is"]);
    let r = s.post(
        "/v1/chat/completions",
        &chat_with(&origin.url("/chunked-too-large.png")),
    );
    assert_refused(&r, FIELD, &[&larger]);

    // A 404, a redirect to another scheme and a closed port are one message to the client,
    // each cause in the server's log.
    let r = s.post(
        "/v1/chat/completions",
        &chat_with(&origin.url("/missing.png")),
    );
    assert_not_fetched(&r, FIELD);
    assert_logged(&s, &["/missing.png", "HTTP 404"]);
    let r = s.post(
        "/v1/chat/completions",
        &chat_with(&origin.url("/to-file.png")),
    );
    assert_not_fetched(&r, FIELD);
    assert_logged(
        &s,
        &["/to-file.png", "'file:'", "only http:// and https://"],
    );
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let r = s.post(
        "/v1/chat/completions",
        &chat_with(&format!("http://127.0.0.1:{closed}/a.png")),
    );
    assert_not_fetched(&r, FIELD);
    assert_logged(
        &s,
        &[&format!("127.0.0.1:{closed}/a.png"), "cannot connect"],
    );

    // The picture behind a redirect from the allowed 127.0.0.1 to 127.0.0.2, which the flag does
    // not list: not followed, and 127.0.0.2 sees no connection.
    let other = Origin::start_at("127.0.0.2");
    let to_other = format!("/redirect-to/127.0.0.2:{}", other.port);
    let r = s.post("/v1/chat/completions", &chat_with(&origin.url(&to_other)));
    assert_not_fetched(&r, FIELD);
    assert_eq!(origin.hits(&to_other), 1);
    assert_eq!(other.connections(), 0, "the redirect was followed");
    assert_logged(
        &s,
        &[
            &to_other,
            "a redirect to 127.0.0.2, in 127.0.0.0/8 (loopback)",
        ],
    );
    // Written in the URL, 127.0.0.2 is refused before any connection as well.
    let r = s.post("/v1/chat/completions", &chat_with(&other.url("/ramp.png")));
    assert_not_fetched(&r, FIELD);
    assert_eq!(other.connections(), 0, "127.0.0.2 was fetched");
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
    assert_not_fetched(&r, "messages[0].content[2].image_url.url");

    // More URLs than --image-urls-max (3): a 400 naming the first one over, and none fetched.
    let mut four = chat_with(&origin.url("/ramp.png"));
    for _ in 2..=4 {
        four["messages"][0]["content"]
            .as_array_mut()
            .unwrap()
            .push(json!({"type": "image_url", "image_url": {"url": origin.url("/ramp.png")}}));
    }
    let before = origin.connections();
    let r = s.post("/v1/chat/completions", &four);
    let over = "messages[0].content[4].image_url.url";
    assert_refused(&r, over, &["more than 3 image URLs", "--image-urls-max"]);
    assert_eq!(origin.connections(), before, "images were fetched");
    // Three are fetched.
    four["messages"][0]["content"].as_array_mut().unwrap().pop();
    let r = s.post("/v1/chat/completions", &four);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["timings"]["images_encoded"], 3, "{}", r.text());

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
    assert!(r.text().contains(NOT_FETCHED), "{}", r.text());
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
    assert!(r.text().contains(NOT_FETCHED), "{}", r.text());
}

/// Without `--image-url-allow-private` a loopback URL, however it is written, is refused before
/// anything is sent: one message, and the test's server never sees a connection. With the flag
/// the same URL is fetched.
#[test]
fn loopback_urls_need_image_url_allow_private() {
    let origin = Origin::start();
    let s = serve_common::start_with_mmproj(&["-np", "1", "-c", "1024", "--allow-image-urls"]);
    assert_logged(&s, &["image URLs: fetched", "public addresses only"]);
    for url in [
        origin.url("/ramp.png"),
        format!("http://2130706433:{}/ramp.png", origin.port),
        format!("http://[::ffff:127.0.0.1]:{}/ramp.png", origin.port),
        format!("http://[::1]:{}/ramp.png", origin.port),
    ] {
        let r = s.post("/v1/chat/completions", &chat_with(&url));
        assert_not_fetched(&r, FIELD);
    }
    // A redirect's target is never reached either: the first URL is already refused.
    let r = s.post("/v1/chat/completions", &chat_with(&origin.url("/hops/1")));
    assert_not_fetched(&r, FIELD);
    assert_eq!(origin.connections(), 0, "a loopback URL was fetched");
    assert_logged(
        &s,
        &[
            &origin.url("/ramp.png"),
            "127.0.0.1 is in 127.0.0.0/8 (loopback)",
        ],
    );
    drop(s);

    let allowed = serve_common::start_with_mmproj(&[
        "-np",
        "1",
        "-c",
        "1024",
        "--allow-image-urls",
        "--image-url-allow-private",
    ]);
    let r = allowed.post("/v1/chat/completions", &chat_with(&origin.url("/ramp.png")));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["timings"]["images_encoded"], 1, "{}", r.text());
    assert_eq!(origin.hits("/ramp.png"), 1);
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
