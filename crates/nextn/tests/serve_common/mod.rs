//! The real `nextn serve` binary on a loopback port, and a small HTTP/1.1 client that can also
//! misbehave (malformed bodies, dropped connections) the way hostile clients do.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

pub fn bundled() -> PathBuf {
    nextn_testdata::bundled_model()
}

pub struct Server {
    /// `None` for a client-only handle on a server started elsewhere.
    pub child: Option<Child>,
    pub port: u16,
    pub log: Arc<Mutex<Vec<String>>>,
    /// /health status seen by the first poll after the port was announced.
    pub first_health: u16,
}

impl Server {
    /// Start `nextn serve` on a free port with extra flags and wait until /health says ready.
    pub fn start(args: &[&str]) -> Server {
        Server::start_with_env(args, &[])
    }

    /// [`Server::start`] with environment variables set for the server.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_nextn"));
        cmd.envs(env.iter().copied());
        cmd.arg("serve").arg("--port").arg("0").arg("-t").arg("2");
        if !args.contains(&"-m") {
            cmd.arg("-m").arg(bundled());
        }
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("start nextn serve");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let l = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let port = rest
                        .split_whitespace()
                        .next()
                        .and_then(|a| a.rsplit(':').next())
                        .and_then(|p| p.parse::<u16>().ok());
                    if let Some(p) = port {
                        let _ = tx.send(p);
                    }
                }
                l.lock().unwrap().push(line);
            }
        });
        let port = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(p) => p,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "the server did not announce its port; log:\n{}",
                    log.lock().unwrap().join("\n")
                );
            }
        };
        let mut s = Server {
            child: Some(child),
            port,
            log,
            first_health: 0,
        };
        s.first_health = s.get("/health").status;
        let t0 = Instant::now();
        while s.get("/health").status != 200 {
            if t0.elapsed() > Duration::from_secs(120) {
                panic!("the server never became ready; log:\n{}", s.log_text());
            }
            if let Some(Ok(Some(status))) = s.child.as_mut().map(|c| c.try_wait()) {
                panic!("the server exited with {status}; log:\n{}", s.log_text());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    /// A client-only handle on the server listening on `port`.
    pub fn attach(port: u16) -> Server {
        Server {
            child: None,
            port,
            log: Arc::new(Mutex::new(Vec::new())),
            first_health: 0,
        }
    }

    pub fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    pub fn get(&self, path: &str) -> Response {
        self.request("GET", path, &[], b"")
    }

    pub fn post(&self, path: &str, body: &Value) -> Response {
        self.request(
            "POST",
            path,
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        )
    }

    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Response {
        let mut s = self.connect();
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
        for (k, v) in headers {
            head += &format!("{k}: {v}\r\n");
        }
        head += "\r\n";
        s.write_all(head.as_bytes()).unwrap();
        // The server may answer (413) before reading a large body; a reset while writing is fine.
        let _ = s.write_all(body);
        read_response(&mut BufReader::new(s))
    }

    pub fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(("127.0.0.1", self.port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
        s
    }

    /// Start a streaming request and return the reader positioned at the body.
    pub fn open_stream(&self, path: &str, body: &Value) -> (u16, SseReader) {
        open_stream_on(self.connect(), path, body)
    }

    /// A whole SSE stream: the JSON of every `data:` chunk, and whether it ended with `[DONE]`.
    pub fn stream(&self, path: &str, body: &Value) -> (u16, Vec<Value>, bool) {
        let (status, mut r) = self.open_stream(path, body);
        let mut chunks = Vec::new();
        let mut done = false;
        while let Some(data) = r.next_event() {
            if data == "[DONE]" {
                done = true;
                continue;
            }
            chunks.push(
                serde_json::from_str(&data)
                    .unwrap_or_else(|e| panic!("chunk {data:?} is not JSON: {e}")),
            );
        }
        (status, chunks, done)
    }

    pub fn metrics(&self) -> String {
        let r = self.get("/metrics");
        assert_eq!(r.status, 200);
        r.text()
    }

    pub fn metric(&self, name: &str) -> f64 {
        metric(&self.metrics(), name)
    }

    /// Send SIGTERM and wait for the exit status.
    pub fn terminate(&mut self, within: Duration) -> std::process::ExitStatus {
        let child = self.child.as_mut().expect("a server this handle started");
        let ok = Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status()
            .expect("run kill");
        assert!(ok.success());
        let t0 = Instant::now();
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                return st;
            }
            if t0.elapsed() > within {
                let _ = child.kill();
                panic!(
                    "the server did not exit within {within:?} of SIGTERM; log:\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(name)
                .and_then(|rest| rest.strip_prefix(' '))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or_else(|| panic!("metric {name} missing in\n{text}"))
}

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.text()))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

fn read_head(r: &mut impl BufRead) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    r.read_line(&mut line).expect("status line");
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h).expect("header");
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    (status, headers)
}

pub fn read_response(r: &mut impl BufRead) -> Response {
    let (status, headers) = read_head(r);
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let mut body = Vec::new();
    if chunked {
        while let Some(c) = read_chunk(r) {
            body.extend_from_slice(&c);
        }
    } else {
        let _ = r.read_to_end(&mut body);
    }
    Response {
        status,
        headers,
        body,
    }
}

/// One chunk of a chunked body; `None` at the end.
fn read_chunk(r: &mut impl BufRead) -> Option<Vec<u8>> {
    let mut size = String::new();
    if r.read_line(&mut size).ok()? == 0 {
        return None;
    }
    let n = usize::from_str_radix(size.trim().split(';').next()?, 16).ok()?;
    if n == 0 {
        return None;
    }
    let mut buf = vec![0u8; n + 2];
    r.read_exact(&mut buf).ok()?;
    buf.truncate(n);
    Some(buf)
}

/// Start a streaming request on the connection `s` and return the reader positioned at the body.
pub fn open_stream_on(mut s: TcpStream, path: &str, body: &Value) -> (u16, SseReader) {
    let b = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        b.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(b.as_bytes()).unwrap();
    let mut r = BufReader::new(s);
    let (status, _) = read_head(&mut r);
    (
        status,
        SseReader {
            r,
            pending: String::new(),
        },
    )
}

/// A chunked SSE body read event by event.
pub struct SseReader {
    pub r: BufReader<TcpStream>,
    pending: String,
}

impl SseReader {
    /// The next event's `data:` payload; `None` at the end of the body.
    pub fn next_event(&mut self) -> Option<String> {
        loop {
            if let Some(at) = self.pending.find("\n\n") {
                let ev: String = self.pending[..at].to_string();
                self.pending.drain(..at + 2);
                let data: Vec<&str> = ev
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .collect();
                if !data.is_empty() {
                    return Some(data.join("\n"));
                }
                continue;
            }
            let c = read_chunk(&mut self.r)?;
            self.pending.push_str(&String::from_utf8_lossy(&c));
        }
    }
}

/// The text a stream carried (content deltas of chat chunks, text of completion chunks).
pub fn stream_text(chunks: &[Value], field: &str) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .filter_map(|ch| {
            ch["delta"][field].as_str().or_else(|| {
                if field == "content" {
                    ch["text"].as_str()
                } else {
                    None
                }
            })
        })
        .collect()
}

pub fn chat(content: &str, extra: Value) -> Value {
    let mut v = serde_json::json!({"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 24});
    if let (Value::Object(m), Value::Object(e)) = (&mut v, extra) {
        for (k, x) in e {
            m.insert(k, x);
        }
    }
    v
}

/// Why a check through Python cannot run here (python3 or one of `modules` is missing), if it
/// cannot. Only absent modules count: a broken install is a failure worth seeing.
pub fn missing_python_modules(modules: &[&str]) -> Option<String> {
    for m in modules {
        let probe = match Command::new("python3")
            .args(["-c", &format!("import {m}")])
            .output()
        {
            Ok(o) => o,
            Err(e) => return Some(format!("python3 not found ({e})")),
        };
        if probe.status.success() {
            continue;
        }
        let err = String::from_utf8_lossy(&probe.stderr);
        assert!(
            err.contains("ModuleNotFoundError"),
            "`python3 -c 'import {m}'` failed:\n{err}"
        );
        return Some(format!(
            "the {m} Python module is not installed (.ci/run installs it)"
        ));
    }
    None
}

/// Run a Python script under tools/ with `args`, with no proxy or OpenAI settings from the
/// environment in the way of loopback traffic.
pub fn run_python_tool(script: &str, args: &[&str]) -> std::process::Output {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tools")
        .join(script);
    Command::new("python3")
        .arg(&path)
        .args(args)
        .env_remove("HTTP_PROXY")
        .env_remove("HTTPS_PROXY")
        .env_remove("ALL_PROXY")
        .env_remove("http_proxy")
        .env_remove("https_proxy")
        .env_remove("all_proxy")
        .env_remove("OPENAI_BASE_URL")
        .env_remove("OPENAI_API_KEY")
        .env("NO_PROXY", "127.0.0.1,localhost")
        .output()
        .unwrap_or_else(|e| panic!("run python3 tools/{script}: {e}"))
}

/// A response read from a kept-alive connection: the body framed by `Content-Length` or chunked
/// encoding, never by the end of the connection. `Err` when the connection ended first.
pub fn read_framed_response(r: &mut impl BufRead) -> std::io::Result<Response> {
    use std::io::{Error, ErrorKind};
    let line = |r: &mut dyn BufRead| -> std::io::Result<String> {
        let mut l = String::new();
        if r.read_line(&mut l)? == 0 {
            return Err(Error::new(ErrorKind::UnexpectedEof, "the connection ended"));
        }
        Ok(l.trim_end().to_string())
    };
    let status_line = line(r)?;
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidData,
                format!("bad status line {status_line:?}"),
            )
        })?;
    let mut headers = Vec::new();
    loop {
        let h = line(r)?;
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    let mut resp = Response {
        status,
        headers,
        body: Vec::new(),
    };
    if resp
        .header("transfer-encoding")
        .is_some_and(|v| v.contains("chunked"))
    {
        loop {
            let size = line(r)?;
            let n = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|e| {
                    Error::new(ErrorKind::InvalidData, format!("chunk size {size:?}: {e}"))
                })?;
            let mut buf = vec![0u8; n + 2];
            r.read_exact(&mut buf)?;
            if n == 0 {
                break;
            }
            resp.body.extend_from_slice(&buf[..n]);
        }
    } else {
        let n: usize = resp
            .header("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        resp.body.resize(n, 0);
        r.read_exact(&mut resp.body)?;
    }
    Ok(resp)
}

/// One kept-alive HTTP/1.1 connection: requests one after another on the same socket.
pub struct KeepAlive {
    pub r: BufReader<TcpStream>,
}

impl KeepAlive {
    pub fn open(port: u16) -> KeepAlive {
        let s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
        KeepAlive {
            r: BufReader::new(s),
        }
    }

    /// Send a request and read its answer; `Err` when the server has closed the connection.
    pub fn send(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> std::io::Result<Response> {
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (k, v) in headers {
            head += &format!("{k}: {v}\r\n");
        }
        head += "\r\n";
        let s = self.r.get_mut();
        s.write_all(head.as_bytes())?;
        s.write_all(body)?;
        read_framed_response(&mut self.r)
    }

    pub fn get(&mut self, path: &str) -> std::io::Result<Response> {
        self.send("GET", path, &[], b"")
    }
}

/// Read until the server closes `s` (end of stream or a reset): how long that took and how many
/// bytes arrived meanwhile, or `None` if it was still open after `within`.
pub fn wait_closed(s: &mut TcpStream, within: Duration) -> Option<(Duration, usize)> {
    use std::io::Read;
    let t0 = Instant::now();
    let mut buf = [0u8; 16384];
    let mut got = 0;
    loop {
        let left = within.saturating_sub(t0.elapsed());
        s.set_read_timeout(Some(left.max(Duration::from_millis(5))))
            .unwrap();
        match s.read(&mut buf) {
            Ok(0) => return Some((t0.elapsed(), got)),
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if t0.elapsed() >= within {
                    return None;
                }
            }
            Err(_) => return Some((t0.elapsed(), got)),
        }
    }
}

/// Whether the server still holds `s` open: nothing to read and no end of stream yet.
pub fn still_open(s: &TcpStream) -> bool {
    let mut buf = [0u8; 1];
    s.set_nonblocking(true).unwrap();
    let open = matches!(s.peek(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
    s.set_nonblocking(false).unwrap();
    open
}

/// Raise this process's soft open-file limit to at least `want` (up to the hard limit), so that a
/// test can hold thousands of sockets; servers it starts inherit the limit. The limit in force.
#[cfg(unix)]
// `rlim_t` is not `u64` on every Unix.
#[allow(clippy::unnecessary_cast)]
pub fn raise_open_files(want: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    unsafe {
        assert_eq!(
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim),
            0,
            "getrlimit"
        );
        if (lim.rlim_cur as u64) < want {
            lim.rlim_cur = (want.min(lim.rlim_max as u64)) as libc::rlim_t;
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0, "setrlimit");
        }
    }
    lim.rlim_cur as u64
}

/// Resident memory of a process in KiB (`VmRSS` in /proc), on Linux.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// A server on the bundled model with a random-weight vision tower of its width (256), written
/// for it and removed once the server has loaded it; `args` come after `--mmproj FILE`.
pub fn start_with_mmproj(args: &[&str]) -> Server {
    start_with_tower(&nextn_vision::synth::TowerSpec::fixture(256), args)
}

/// [`start_with_mmproj`] with the tower of `spec`.
pub fn start_with_tower(spec: &nextn_vision::synth::TowerSpec, args: &[&str]) -> Server {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("nextn-mmproj-{}-{k}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("mmproj.gguf");
    nextn_vision::synth::write_mmproj(spec, &path).expect("write mmproj");
    let mut all = vec!["--mmproj", path.to_str().expect("utf-8 path")];
    all.extend_from_slice(args);
    let s = Server::start(&all);
    std::fs::remove_dir_all(&dir).ok();
    s
}

/// The ramp picture of nextn-vision's test data (PNG, 100x75).
pub fn ramp_png() -> Vec<u8> {
    let p = nextn_testdata::repo_root().join("crates/nextn-vision/tests/data/ramp-100x75.png");
    std::fs::read(p).expect("picture")
}

/// Why a headless-Chromium check (tools/browser) cannot run here, if it cannot.
pub fn missing_browser() -> Option<String> {
    if Command::new("node").arg("--version").output().is_err() {
        return Some("node is not installed".into());
    }
    if !Path::new("/usr/bin/chromium").exists() && std::env::var_os("CHROMIUM").is_none() {
        return Some("chromium is not installed (.ci/run installs Debian's package)".into());
    }
    let module = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tools/browser/node_modules/playwright-core");
    if !module.exists() {
        return Some(
            "playwright-core is not installed in tools/browser (.ci/run runs npm ci there)".into(),
        );
    }
    None
}
