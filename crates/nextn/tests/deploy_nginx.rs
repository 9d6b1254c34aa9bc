//! Two `nextn serve` replicas behind nginx with `deploy/nginx/nextn.conf` (its upstream list and
//! port rewritten for loopback test ports): a conversation's turns return to the replica that
//! holds its prefix cache, and when one replica is killed mid-run every request still gets an
//! answer from the other. Skipped with the reason where nginx is absent (.ci/run installs it).

mod serve_common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use serve_common::Server;

struct Nginx {
    child: Child,
    port: u16,
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The shipped configuration with the test's replicas, port and a private prefix.
fn config(replicas: &[u16], port: u16, prefix: &Path) -> String {
    let shipped = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/nginx/nextn.conf"),
    )
    .unwrap();
    let servers: String = replicas
        .iter()
        .map(|p| format!("        server 127.0.0.1:{p} max_fails=1 fail_timeout=10s;\n"))
        .collect();
    let mut out = String::new();
    let mut upstream_done = false;
    for line in shipped.lines() {
        let t = line.trim_start();
        if t.starts_with("server 127.0.0.1:") {
            if !upstream_done {
                out.push_str(&servers);
                upstream_done = true;
            }
            continue;
        }
        if t.starts_with("listen ") {
            out.push_str(&format!("        listen 127.0.0.1:{port};\n"));
            continue;
        }
        if t.starts_with("worker_processes") {
            // A private instance: its own pid file, logs and temporary files under the prefix.
            out.push_str("worker_processes 1;\npid nginx.pid;\nerror_log error.log;\n");
            continue;
        }
        out.push_str(line);
        out.push('\n');
        if t.starts_with("http {") {
            for d in ["client_body", "proxy", "fastcgi", "uwsgi", "scgi"] {
                let dir = prefix.join(d);
                std::fs::create_dir_all(&dir).unwrap();
                out.push_str(&format!("    {d}_temp_path {};\n", dir.display()));
            }
            out.push_str("    access_log off;\n");
        }
    }
    assert!(upstream_done, "the shipped config has no upstream servers");
    out
}

fn start_nginx(replicas: &[u16]) -> Option<Nginx> {
    let nginx = ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())?;
    let prefix = std::env::temp_dir().join(format!("nextn-nginx-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&prefix);
    std::fs::create_dir_all(&prefix).unwrap();
    let port = free_port();
    let conf = prefix.join("nginx.conf");
    std::fs::write(&conf, config(replicas, port, &prefix)).unwrap();
    let child = Command::new(nginx)
        .arg("-p")
        .arg(&prefix)
        .arg("-c")
        .arg(&conf)
        .args(["-g", "daemon off;"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start nginx");
    let n = Nginx { child, port };
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "nginx did not start; error.log: {}",
            std::fs::read_to_string(prefix.join("error.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Some(n)
}

fn turn(lb: &Server, conversation: &str, messages: &[Value]) -> Value {
    let r = lb.request(
        "POST",
        "/v1/chat/completions",
        &[
            ("Content-Type", "application/json"),
            ("X-Conversation-Id", conversation),
        ],
        json!({"messages": messages, "max_tokens": 8, "temperature": 0})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(r.status, 200, "{conversation}: {}", r.text());
    r.json()
}

/// The two tests each keep several servers busy; run side by side they would time each other's
/// contention (the drain test sizes its streams from a measured rate).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn replicas_behind_nginx_keep_conversations_and_survive_a_lost_replica() {
    let _alone = one_at_a_time();
    let mut a = Server::start(&["-np", "2"]);
    let b = Server::start(&["-np", "2"]);
    let Some(nginx) = start_nginx(&[a.port, b.port]) else {
        assert!(
            !nextn_testdata::in_ci(),
            "required in CI (CI=true): nginx is not installed"
        );
        eprintln!("skipped: nginx is not installed (.ci/run installs Debian's package)");
        return;
    };
    let lb = Server::attach(nginx.port);
    let system = json!({"role": "system", "content": "You are a coding agent. ".repeat(20)});
    let conversations: Vec<String> = (0..6).map(|i| format!("conversation-{i}")).collect();
    let mut histories: Vec<Vec<Value>> = Vec::new();
    for c in &conversations {
        let mut m = vec![
            system.clone(),
            json!({"role": "user", "content": format!("{c}: first question")}),
        ];
        let r = turn(&lb, c, &m);
        m.push(json!({"role": "assistant", "content": r["choices"][0]["message"]["content"]}));
        m.push(json!({"role": "user", "content": "and the next one"}));
        histories.push(m);
    }
    // Both replicas took part, and every second turn found its first turn's state: the hash sent
    // it back to the same replica.
    let served = |s: &Server| s.metric("nextn:requests_finished_total");
    assert!(
        served(&a) > 0.0 && served(&b) > 0.0,
        "one replica took every conversation"
    );
    for (c, m) in conversations.iter().zip(&histories) {
        let r = turn(&lb, c, m);
        let cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(
            cached > 0,
            "{c} came back to a replica without its state: {r}"
        );
    }

    // One replica dies: every conversation still gets answers (from the other).
    if let Some(child) = a.child.as_mut() {
        child.kill().unwrap();
        child.wait().unwrap();
    }
    for (c, m) in conversations.iter().zip(&histories) {
        turn(&lb, c, m);
    }
    assert!(served(&b) >= conversations.len() as f64);
}

/// The drain a replica goes through when it is taken out: SIGTERM with 8 streams running lets all
/// of them finish (each ends with `[DONE]`), refuses new connections, and exits 0.
#[test]
fn sigterm_drains_eight_streams_and_exits_zero() {
    let _alone = one_at_a_time();
    // Room for long answers in every slot: the tiny bundled model generates thousands of tokens a
    // second on a fast machine.
    let mut s = Server::start(&["-np", "8", "-c", "131072", "--drain-timeout", "300"]);
    // How fast eight answers go side by side here, so that the streams below run for about
    // fifteen seconds whatever the machine: long enough that none ends before the signal even if
    // the machine gets several times faster meanwhile, short enough that the drain ends well
    // inside its timeout.
    let probe = json!({
        "messages": [{"role": "user", "content": "def parse(line):"}],
        "max_tokens": 128, "ignore_eos": true, "temperature": 0
    });
    let t0 = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..8 {
            scope.spawn(|| assert_eq!(s.post("/v1/chat/completions", &probe).status, 200));
        }
    });
    let per_stream = 128.0 / t0.elapsed().as_secs_f64();
    let max_tokens = ((per_stream * 15.0) as u64).clamp(256, 16_000);
    let body = json!({
        "messages": [{"role": "user", "content": "def parse(line):"}],
        "max_tokens": max_tokens, "ignore_eos": true, "temperature": 0, "stream": true
    });
    let mut streams = Vec::new();
    for _ in 0..8 {
        let (status, mut r) = s.open_stream("/v1/chat/completions", &body);
        assert_eq!(status, 200);
        assert!(r.next_event().is_some());
        streams.push(r);
    }
    let port = s.port;
    let readers: Vec<_> = streams
        .into_iter()
        .map(|mut r| {
            std::thread::spawn(move || {
                let mut last = None;
                let mut text = 0;
                while let Some(ev) = r.next_event() {
                    if ev.contains("\"content\"") {
                        text += 1;
                    }
                    last = Some(ev);
                }
                (last, text)
            })
        })
        .collect();
    // All eight are still generating when the signal comes.
    assert_eq!(s.metric("llamacpp:requests_processing"), 8.0);
    let exit = s.terminate(Duration::from_secs(300));
    assert!(exit.success(), "exit status {exit}; log:\n{}", s.log_text());
    for r in readers {
        let (last, text) = r.join().unwrap();
        assert_eq!(last.as_deref(), Some("[DONE]"), "a stream was cut");
        assert!(text > 0);
    }
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the drained server still accepts connections"
    );
}
