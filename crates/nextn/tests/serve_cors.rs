//! CORS of `nextn serve --cors-origins`: a listed request `Origin` is echoed alone (never `*`
//! with credentials), every answer says `Vary: Origin`, a preflight names the headers it allows
//! (the API key's two headers, the JSON body's type, the official clients' `x-stainless-*`,
//! `openai-*` and `anthropic-*` headers), and an unlisted origin gets no CORS headers. Over raw
//! HTTP on loopback, then in a real headless Chromium (Debian's `chromium`, driven by
//! `tools/browser/cors_check.mjs` through playwright-core): a page on a listed loopback origin
//! reads the server's JSON through `fetch` with an `Authorization` header, and a page on an
//! unlisted one cannot.

mod serve_common;

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};
use serve_common::{missing_browser, Response, Server};

const A: &str = "http://a.example";
const B: &str = "http://b.example:8080";

/// Every value of header `name` (a header may come several times).
fn all<'a>(r: &'a Response, name: &str) -> Vec<&'a str> {
    r.headers
        .iter()
        .filter(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
        .collect()
}

/// The CORS headers (`access-control-*`) of an answer.
fn cors_headers(r: &Response) -> Vec<(String, String)> {
    r.headers
        .iter()
        .filter(|(k, _)| k.to_ascii_lowercase().starts_with("access-control-"))
        .cloned()
        .collect()
}

fn varies_by_origin(r: &Response) -> bool {
    all(r, "vary")
        .iter()
        .flat_map(|v| v.split(','))
        .any(|v| v.trim().eq_ignore_ascii_case("origin"))
}

/// What the OpenAI and Anthropic JavaScript clients ask a preflight for.
const REQUESTED: &str = "authorization,content-type,x-stainless-arch,x-stainless-lang,x-stainless-os,x-stainless-package-version,x-stainless-retry-count,x-stainless-runtime,x-stainless-runtime-version,x-stainless-timeout,openai-organization,openai-project,x-api-key,anthropic-version,anthropic-beta,anthropic-dangerous-direct-browser-access";

fn preflight(s: &Server, path: &str, origin: &str) -> Response {
    s.request(
        "OPTIONS",
        path,
        &[
            ("Origin", origin),
            ("Access-Control-Request-Method", "POST"),
            ("Access-Control-Request-Headers", REQUESTED),
        ],
        b"",
    )
}

fn chat(s: &Server, origin: &str, key: Option<&str>) -> Response {
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let auth = key.map(|k| format!("Bearer {k}"));
    let mut headers = vec![("Origin", origin), ("Content-Type", "application/json")];
    if let Some(a) = &auth {
        headers.push(("Authorization", a));
    }
    s.request(
        "POST",
        "/v1/chat/completions",
        &headers,
        body.to_string().as_bytes(),
    )
}

#[test]
fn listed_origins_are_echoed_alone_and_others_get_no_cors_headers() {
    let s = Server::start(&["--api-key", "key", "--cors-origins", &format!("{A},{B}")]);
    for origin in [A, B] {
        for path in ["/v1/chat/completions", "/v1/messages"] {
            // Answered before authentication: browsers send no key with a preflight.
            let pre = preflight(&s, path, origin);
            assert_eq!(pre.status, 200, "{}", pre.text());
            assert_eq!(all(&pre, "access-control-allow-origin"), [origin]);
            assert_eq!(all(&pre, "access-control-allow-credentials"), ["true"]);
            let methods = all(&pre, "access-control-allow-methods").join(",");
            assert!(
                methods.contains("POST") && methods.contains("GET"),
                "{methods}"
            );
            // Every requested header by name: `*` would not cover Authorization.
            let allowed: Vec<String> = all(&pre, "access-control-allow-headers")
                .iter()
                .flat_map(|v| v.split(','))
                .map(|h| h.trim().to_ascii_lowercase())
                .collect();
            for wanted in REQUESTED.split(',') {
                assert!(allowed.iter().any(|h| h == wanted), "{wanted}: {allowed:?}");
            }
            assert!(varies_by_origin(&pre), "{:?}", pre.headers);
            for (k, v) in cors_headers(&pre) {
                assert!(!v.split(',').any(|x| x.trim() == "*"), "{k}: {v}");
            }
        }
        // The request itself: the answer, readable by this origin only.
        let r = chat(&s, origin, Some("key"));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(all(&r, "access-control-allow-origin"), [origin]);
        assert_eq!(all(&r, "access-control-allow-credentials"), ["true"]);
        assert!(varies_by_origin(&r), "{:?}", r.headers);
        // A refusal too, so that the page can read why.
        let r = chat(&s, origin, None);
        assert_eq!(r.status, 401, "{}", r.text());
        assert_eq!(all(&r, "access-control-allow-origin"), [origin]);
    }
    // An origin that is not listed, or differs from a listed one in scheme, host or port.
    for unlisted in [
        "http://c.example",
        "https://a.example",
        "http://a.example:8080",
        "http://b.example",
        "http://a.example.c.example",
        "null",
    ] {
        let pre = preflight(&s, "/v1/chat/completions", unlisted);
        assert_eq!(cors_headers(&pre), [], "{unlisted}");
        assert!(varies_by_origin(&pre), "{:?}", pre.headers);
        let r = chat(&s, unlisted, Some("key"));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(cors_headers(&r), [], "{unlisted}");
        assert!(varies_by_origin(&r), "{:?}", r.headers);
    }
    // A header nobody's client sends is not allowed, so the browser does not send the request.
    let odd = s.request(
        "OPTIONS",
        "/v1/chat/completions",
        &[
            ("Origin", A),
            ("Access-Control-Request-Method", "POST"),
            (
                "Access-Control-Request-Headers",
                "authorization,x-forwarded-for",
            ),
        ],
        b"",
    );
    assert_eq!(all(&odd, "access-control-allow-headers"), ["authorization"]);
    // Without an Origin (not a browser's cross-origin request) there is nothing to allow.
    let r = s.request("GET", "/health", &[], b"");
    assert_eq!(cors_headers(&r), []);
    assert!(varies_by_origin(&r), "{:?}", r.headers);

    // Without credentials, a list still echoes the origin alone; `*` is sent only for every
    // origin without credentials.
    let plain = Server::start(&["--cors-origins", A, "--no-cors-credentials"]);
    let r = plain.request("GET", "/health", &[("Origin", A)], b"");
    assert_eq!(all(&r, "access-control-allow-origin"), [A]);
    assert_eq!(all(&r, "access-control-allow-credentials"), [] as [&str; 0]);
    let any = Server::start(&["--no-cors-credentials"]);
    let r = any.request("GET", "/health", &[("Origin", A)], b"");
    assert_eq!(all(&r, "access-control-allow-origin"), ["*"]);
    assert_eq!(all(&r, "access-control-allow-credentials"), [] as [&str; 0]);
}

#[test]
fn a_cors_origin_that_is_not_an_origin_is_refused_at_start() {
    for (value, words) in [
        ("http://a.example/app", "has a path"),
        ("a.example", "is not an origin"),
        ("*,http://a.example", "cannot be listed"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_nextn"))
            .args(["serve", "--port", "0", "-m"])
            .arg(serve_common::bundled())
            .args(["--cors-origins", value])
            .output()
            .expect("run nextn serve");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{value}: {stderr}");
        assert!(
            stderr.contains("--cors-origins") && stderr.contains(words),
            "{value}: {stderr}"
        );
    }
}

/// A loopback HTTP server that answers every request with a blank HTML page: an origin for the
/// browser's pages, `http://127.0.0.1:PORT`.
fn page_origin() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            std::thread::spawn(move || answer_page(conn));
        }
    });
    format!("http://127.0.0.1:{port}")
}

fn answer_page(conn: TcpStream) {
    let Ok(read) = conn.try_clone() else { return };
    let mut r = BufReader::new(read);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
            break;
        }
    }
    let body = "<!doctype html><html><head><title>front-end</title></head><body></body></html>";
    let mut w = conn;
    let _ = write!(
        w,
        "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

#[test]
fn a_browser_page_on_a_listed_origin_reads_the_answer_with_its_api_key() {
    if let Some(why) = missing_browser() {
        assert!(!nextn_testdata::in_ci(), "required in CI (CI=true): {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let (listed, unlisted) = (page_origin(), page_origin());
    let s = Server::start(&["--api-key", "key", "--cors-origins", &listed, "-n", "2"]);
    let api = format!("http://127.0.0.1:{}", s.port);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/browser/cors_check.mjs");
    let (listed_page, unlisted_page) = (format!("{listed}/"), format!("{unlisted}/"));
    let out = Command::new("node")
        .arg(&script)
        .args([&api, "key", &listed_page, &unlisted_page])
        .env("NO_PROXY", "127.0.0.1,localhost")
        .output()
        .expect("run node");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let shown: Value = serde_json::from_str(stdout.trim()).expect("JSON from cors_check.mjs");

    // From the listed origin the page reads every answer: the browser let the key through.
    let page = &shown[&listed_page];
    assert_eq!(page["models"]["status"], 200, "{page}");
    assert_eq!(page["models"]["body"]["object"], "list", "{page}");
    assert_eq!(page["chat"]["status"], 200, "{page}");
    assert_eq!(page["chat"]["body"]["object"], "chat.completion", "{page}");
    assert_eq!(page["messages"]["status"], 200, "{page}");
    assert_eq!(page["messages"]["body"]["type"], "message", "{page}");
    // With credentials the browser takes no wildcard: the origin and the headers are named.
    assert_eq!(page["with_credentials"]["status"], 200, "{page}");
    // From the other origin the browser refuses every answer.
    let page = &shown[&unlisted_page];
    for call in ["models", "chat", "with_credentials", "messages"] {
        let error = page[call]["error"].as_str().unwrap_or_default();
        assert!(error.contains("TypeError"), "{call}: {page}");
        assert!(page[call].get("status").is_none(), "{call}: {page}");
    }
}
