//! `nextn serve` against slow, idle and misbehaving clients: the header-read, idle keep-alive and
//! write-stall timeouts, the connection cap, JSON bodies for every refusal, and streams ended by
//! SIGTERM closing with `[DONE]`.

mod serve_common;

use std::io::{BufReader, Write};
use std::net::TcpStream;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use serve_common::{chat, metric, still_open, wait_closed, KeepAlive, Response, Server};

/// These tests time when the server closes connections; one at a time, so that they do not slow
/// each other down on a small machine.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// An OpenAI-style error body with `status` as its code and a message.
fn assert_json_error(r: &Response, status: u16) -> Value {
    assert_eq!(r.status, status, "{}", r.text());
    assert!(
        r.header("content-type")
            .is_some_and(|v| v.starts_with("application/json")),
        "{status} without a JSON content type: {:?}",
        r.headers
    );
    let v = r.json();
    assert_eq!(v["error"]["code"], status, "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    v
}

const SECOND: Duration = Duration::from_secs(1);

#[test]
fn two_thousand_slow_clients_are_cut_off_while_others_are_served() {
    let _alone = one_at_a_time();
    const N: usize = 2000;
    #[cfg(unix)]
    {
        let limit = serve_common::raise_open_files(N as u64 + 512);
        assert!(
            limit >= N as u64 + 512,
            "the open-file limit is {limit}: this test holds {N} sockets (raise the hard limit)"
        );
    }
    let header_read = 2 * SECOND;
    let s = Server::start(&[
        "--timeout-header-read",
        "2",
        "--max-connections",
        "4096",
        "-np",
        "2",
        "--log-disable",
    ]);
    let accepted_before = s.metric("nextn:http_connections_accepted_total");
    // A quarter send nothing at all, a quarter nothing yet, a quarter half a request line, a
    // quarter half the headers.
    let mut slow = Vec::with_capacity(N);
    for i in 0..N {
        let mut c = TcpStream::connect(("127.0.0.1", s.port)).expect("connect");
        match i % 4 {
            2 => c.write_all(b"POST /v1/chat/comp").unwrap(),
            3 => c
                .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
                .unwrap(),
            _ => {}
        }
        slow.push((Instant::now(), c));
    }
    // Not cut before their time: the last ones opened are still open.
    for (opened, c) in slow.iter().rev().take(100) {
        if opened.elapsed() < header_read / 2 {
            assert!(still_open(c), "a slow connection was closed early");
        }
    }
    // Meanwhile, other clients are answered.
    let body = chat("def add(a, b):", json!({"max_tokens": 8}));
    for _ in 0..3 {
        let r = s.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["usage"]["completion_tokens"], 8);
        assert_eq!(s.get("/health").status, 200);
    }
    let m = s.metrics();
    assert!(
        metric(&m, "nextn:http_connections_accepted_total") >= accepted_before + N as f64,
        "the slow connections were not all accepted:\n{m}"
    );

    // Then every one of them is closed, within the timeout and a margin for a busy machine,
    // without an answer (there was no request to answer).
    let margin = 5 * SECOND;
    let mut latest = Duration::ZERO;
    for (i, (opened, c)) in slow.iter_mut().enumerate() {
        let left = (*opened + header_read + margin).saturating_duration_since(Instant::now());
        let Some((_, got)) = wait_closed(c, left) else {
            panic!(
                "slow connection {i} was still open {:?} after it was opened",
                opened.elapsed()
            );
        };
        assert_eq!(got, 0, "slow connection {i} got {got} bytes");
        latest = latest.max(opened.elapsed());
    }
    eprintln!("all {N} slow connections closed; the last seen closed {latest:?} after it opened");
    let m = s.metrics();
    assert!(
        metric(
            &m,
            "nextn:http_connections_timed_out_total{reason=\"header_read\"}"
        ) >= N as f64,
        "{m}"
    );
    assert!(metric(&m, "nextn:http_connections") < 10.0, "{m}");
    let r = s.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn idle_keep_alive_connections_close_and_busy_ones_stay() {
    let _alone = one_at_a_time();
    let (header_read, idle) = (SECOND, 3 * SECOND);
    let s = Server::start(&[
        "--timeout-header-read",
        "1",
        "--timeout-idle",
        "3",
        "-np",
        "2",
        "-c",
        "65536",
        "--log-disable",
    ]);

    // A kept-alive connection may rest longer than the header-read timeout (which counts from a
    // request's first byte), and is closed once it has rested for the idle timeout.
    let mut a = KeepAlive::open(s.port);
    assert_eq!(a.get("/health").unwrap().status, 200);
    std::thread::sleep(2 * SECOND);
    let r = a
        .get("/health")
        .expect("a connection idle for 2 s (idle timeout 3 s) was closed");
    assert_eq!(r.status, 200);
    let (closed, got) = wait_closed(a.r.get_mut(), idle + 5 * SECOND)
        .expect("an idle kept-alive connection stayed open");
    assert_eq!(got, 0);
    assert!(
        closed >= idle - Duration::from_millis(300) && closed <= idle + 3 * SECOND,
        "closed {closed:?} after its last answer (idle timeout {idle:?})"
    );

    // A connection that sends a request every second for three idle timeouts stays open.
    let mut b = KeepAlive::open(s.port);
    let t0 = Instant::now();
    let mut served = 0;
    while t0.elapsed() < 3 * idle {
        let r = b.get("/health").unwrap_or_else(|e| {
            panic!("the busy connection was closed after {served} requests: {e}")
        });
        assert_eq!(r.status, 200);
        served += 1;
        std::thread::sleep(SECOND);
    }
    assert!(served >= 8);

    // A request begun on a kept-alive connection has the header-read timeout from its first
    // byte, not the idle timeout.
    let mut c = KeepAlive::open(s.port);
    assert_eq!(c.get("/health").unwrap().status, 200);
    std::thread::sleep(Duration::from_millis(500));
    c.r.get_mut()
        .write_all(b"GET /health HTTP/1.1\r\nHo")
        .unwrap();
    let (closed, _) =
        wait_closed(c.r.get_mut(), 10 * SECOND).expect("a half-sent head was never cut off");
    assert!(
        closed >= header_read - Duration::from_millis(300) && closed < idle - SECOND / 2,
        "a half-sent head was cut off {closed:?} after its first byte (header-read timeout {header_read:?})"
    );

    // A stream that runs for three idle timeouts is not cut while the client reads it (at most
    // 200 events a second, so that it cannot reach its end first).
    let body = chat(
        "def parse(line):",
        json!({"max_tokens": 60000, "ignore_eos": true, "stream": true}),
    );
    let (status, mut r) = s.open_stream("/v1/chat/completions", &body);
    assert_eq!(status, 200);
    let t0 = Instant::now();
    let mut events = 0;
    while t0.elapsed() < 3 * idle {
        let ev = r
            .next_event()
            .unwrap_or_else(|| panic!("the stream was cut after {:?}", t0.elapsed()));
        assert!(!ev.contains("\"error\""), "{ev}");
        assert_ne!(
            ev, "[DONE]",
            "the stream ended before the timeouts could matter"
        );
        events += 1;
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(events > 100);
    let m = s.metrics();
    assert!(
        metric(
            &m,
            "nextn:http_connections_timed_out_total{reason=\"idle\"}"
        ) >= 1.0
    );
    assert!(
        metric(
            &m,
            "nextn:http_connections_timed_out_total{reason=\"header_read\"}"
        ) >= 1.0
    );
}

/// A loopback connection whose receive buffer is 4 KiB (set before connecting, so that the
/// window is small from the start).
#[cfg(unix)]
fn connect_with_small_receive_buffer(port: u16) -> TcpStream {
    use std::os::fd::FromRawFd;
    // SAFETY: a fresh socket is configured and connected; the TcpStream owns its descriptor from
    // the moment it exists, and every pointer passed points at a live local of the stated size.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let stream = TcpStream::from_raw_fd(fd);
        let size: libc::c_int = 4096;
        let rc = libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&size as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
        assert_eq!(rc, 0, "SO_RCVBUF: {}", std::io::Error::last_os_error());
        let addr = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from_be_bytes([127, 0, 0, 1]).to_be(),
            },
            sin_zero: [0; 8],
        };
        let rc = libc::connect(
            fd,
            (&addr as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        assert_eq!(rc, 0, "connect: {}", std::io::Error::last_os_error());
        stream
            .set_read_timeout(Some(Duration::from_secs(300)))
            .unwrap();
        stream
    }
}

#[cfg(not(unix))]
fn connect_with_small_receive_buffer(port: u16) -> TcpStream {
    TcpStream::connect(("127.0.0.1", port)).expect("connect")
}

#[test]
fn a_client_that_stops_reading_is_cut_off_and_its_slot_freed() {
    let _alone = one_at_a_time();
    let s = Server::start(&[
        "--timeout-write",
        "2",
        "-np",
        "1",
        "-c",
        "65536",
        "--log-disable",
    ]);
    // Log probabilities make every event a few KiB and a small receive buffer keeps the
    // server's send buffer from growing, so the socket fills after a few dozen tokens.
    let body = chat(
        "def parse(line):",
        json!({"max_tokens": 60000, "ignore_eos": true, "stream": true, "logprobs": true, "top_logprobs": 20}),
    );
    let (status, mut stalled) = serve_common::open_stream_on(
        connect_with_small_receive_buffer(s.port),
        "/v1/chat/completions",
        &body,
    );
    assert_eq!(status, 200);
    assert!(stalled.next_event().is_some());
    // The client reads nothing more. Within the write timeout of the buffers filling, the
    // server closes the connection and the slot is free.
    let t0 = Instant::now();
    loop {
        let m = s.metrics();
        let cut = metric(
            &m,
            "nextn:http_connections_timed_out_total{reason=\"write\"}",
        );
        if cut >= 1.0 && metric(&m, "llamacpp:requests_processing") == 0.0 {
            assert_eq!(metric(&m, "nextn:requests_cancelled_total"), 1.0, "{m}");
            assert_eq!(metric(&m, "nextn:requests_finished_total"), 0.0, "{m}");
            break;
        }
        assert!(
            t0.elapsed() < 120 * SECOND,
            "the stalled stream still holds its slot:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "stalled client cut off {:?} after it stopped reading",
        t0.elapsed()
    );
    // What was already on its way arrives, then the connection ends without `[DONE]`.
    let mut last = None;
    while let Some(ev) = stalled.next_event() {
        last = Some(ev);
    }
    assert_ne!(last.as_deref(), Some("[DONE]"));
    // The slot serves the next request.
    let r = s.post(
        "/v1/chat/completions",
        &chat("x = 1", json!({"max_tokens": 4})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn refusals_have_json_bodies() {
    let _alone = one_at_a_time();
    let s = Server::start(&["-np", "1", "--max-body-size", "4096", "--log-disable"]);

    // 431 for a 1 MB header, answered by hyper itself and given a JSON body here; the client is
    // still sending when the answer comes.
    let c = s.connect();
    let mut w = c.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        let big = "a".repeat(1 << 20);
        let _ = w.write_all(
            format!("GET /health HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\n\r\n").as_bytes(),
        );
    });
    let r = serve_common::read_response(&mut BufReader::new(c));
    let v = assert_json_error(&r, 431);
    assert!(
        v["error"]["message"].as_str().unwrap().contains("64 KiB"),
        "{v}"
    );
    writer.join().unwrap();

    // 400 for a request line that is not HTTP.
    let mut c = s.connect();
    c.write_all(b"HELLO THERE\r\n\r\n").unwrap();
    let r = serve_common::read_response(&mut BufReader::new(c));
    assert_json_error(&r, 400);

    // 415 for a body labelled as something other than JSON, on every POST endpoint.
    let chat_body = chat("hi", json!({"max_tokens": 2})).to_string();
    let tokenize_body = json!({"content": "hi"}).to_string();
    for (path, body) in [
        ("/v1/chat/completions", &chat_body),
        ("/v1/completions", &tokenize_body),
        ("/completion", &tokenize_body),
        ("/tokenize", &tokenize_body),
        ("/apply-template", &chat_body),
    ] {
        for ct in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
        ] {
            let r = s.request("POST", path, &[("Content-Type", ct)], body.as_bytes());
            let v = assert_json_error(&r, 415);
            assert!(
                v["error"]["message"].as_str().unwrap().contains(ct),
                "{path} {ct}: {v}"
            );
        }
    }
    // JSON in any spelling is accepted, and so is a body without a Content-Type, as
    // llama-server accepts it.
    for headers in [
        &[("Content-Type", "application/json; charset=utf-8")][..],
        &[("Content-Type", "Application/JSON")][..],
        &[][..],
    ] {
        let r = s.request(
            "POST",
            "/v1/chat/completions",
            headers,
            chat_body.as_bytes(),
        );
        assert_eq!(r.status, 200, "{headers:?}: {}", r.text());
        let r = s.request("POST", "/tokenize", headers, tokenize_body.as_bytes());
        assert_eq!(r.status, 200, "{headers:?}: {}", r.text());
    }
    // An empty body has no media type to refuse: it is refused as JSON (400).
    let r = s.request("POST", "/tokenize", &[("Content-Type", "text/plain")], b"");
    assert_json_error(&r, 400);

    // 413 above --max-body-size, on the OpenAI and the native endpoints.
    let big = json!({"content": "word ".repeat(2000)}).to_string();
    for path in ["/v1/completions", "/tokenize"] {
        let r = s.request(
            "POST",
            path,
            &[("Content-Type", "application/json")],
            big.as_bytes(),
        );
        assert_json_error(&r, 413);
    }
    assert_eq!(s.get("/health").status, 200);
}

#[test]
fn sigterm_ends_every_stream_with_the_error_then_done() {
    let _alone = one_at_a_time();
    let mut s = Server::start(&[
        "-np",
        "9",
        "-c",
        "147456",
        "--shutdown-grace",
        "0.5",
        "--log-disable",
    ]);
    let long = json!({"max_tokens": 100000, "ignore_eos": true, "stream": true, "temperature": 0});
    let mut streams = Vec::new();
    for i in 0..9 {
        let (path, mut body) = match i % 3 {
            0 => (
                "/v1/chat/completions",
                chat(&format!("def f{i}(x):"), long.clone()),
            ),
            1 => (
                "/v1/completions",
                json!({"prompt": format!("def g{i}(x):")}),
            ),
            _ if i == 8 => ("/completion", json!({"prompt": "def native(x):"})),
            _ => ("/v1/completions", json!({"prompt": format!("class C{i}:")})),
        };
        if let (Value::Object(b), Value::Object(l)) = (&mut body, &long) {
            for (k, v) in l {
                b.entry(k.clone()).or_insert(v.clone());
            }
        }
        let (status, mut r) = s.open_stream(path, &body);
        assert_eq!(status, 200, "{path}");
        assert!(r.next_event().is_some(), "{path}: no first event");
        streams.push((path, r));
    }
    let readers: Vec<_> = streams
        .into_iter()
        .map(|(path, mut r)| {
            std::thread::spawn(move || {
                let mut events = Vec::new();
                while let Some(ev) = r.next_event() {
                    events.push(ev);
                }
                (path, events)
            })
        })
        .collect();
    assert_eq!(s.metric("llamacpp:requests_processing"), 9.0);
    let exit = s.terminate(60 * SECOND);
    assert!(exit.success(), "exit status {exit}; log:\n{}", s.log_text());
    for r in readers {
        let (path, events) = r.join().unwrap();
        let n = events.len();
        assert!(n >= 2, "{path}: {events:?}");
        let (error, last) = if path == "/completion" {
            // llama-server's native stream has no end marker: the error is its last event.
            assert!(!events.iter().any(|e| e == "[DONE]"), "{path}");
            (&events[n - 1], None)
        } else {
            (&events[n - 2], Some(&events[n - 1]))
        };
        let v: Value = serde_json::from_str(error).unwrap_or_else(|e| {
            panic!("{path}: the event before the end is not JSON ({e}): {error}")
        });
        assert_eq!(v["error"]["code"], 503, "{path}: {v}");
        assert_eq!(v["error"]["type"], "unavailable_error", "{path}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("shutting down"),
            "{path}: {v}"
        );
        if let Some(last) = last {
            assert_eq!(last, "[DONE]", "{path}");
        }
    }
}

#[test]
fn the_connection_cap_holds_new_connections_until_one_closes() {
    let _alone = one_at_a_time();
    let s = Server::start(&[
        "--max-connections",
        "4",
        "--timeout-idle",
        "60",
        "-np",
        "1",
        "--log-disable",
    ]);
    // Four kept-alive connections, each served once, hold the cap.
    let mut held: Vec<KeepAlive> = (0..4).map(|_| KeepAlive::open(s.port)).collect();
    for k in &mut held {
        assert_eq!(k.get("/health").unwrap().status, 200);
    }
    // A fifth connects (the kernel's backlog takes it) but is not served.
    let mut fifth = TcpStream::connect(("127.0.0.1", s.port)).expect("connect");
    fifth
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    std::thread::sleep(2 * SECOND);
    assert!(
        still_open(&fifth),
        "the fifth connection was answered or closed while four were open"
    );
    // One of the four closes: the fifth is served at once.
    drop(held.pop());
    let t0 = Instant::now();
    fifth.set_read_timeout(Some(30 * SECOND)).unwrap();
    let r = serve_common::read_response(&mut BufReader::new(fifth));
    assert_eq!(r.status, 200);
    assert!(
        t0.elapsed() < 10 * SECOND,
        "served {:?} after a slot freed",
        t0.elapsed()
    );
    let m = r.text();
    assert_eq!(metric(&m, "nextn:http_connections_max"), 4.0);
    assert_eq!(metric(&m, "nextn:http_connections"), 4.0, "{m}");
    // The held connections still work, and so does the server once they are gone.
    for k in &mut held {
        assert_eq!(k.get("/health").unwrap().status, 200);
    }
    drop(held);
    let r = s.post(
        "/v1/chat/completions",
        &chat("x = 1", json!({"max_tokens": 4})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}
