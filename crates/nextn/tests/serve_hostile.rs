//! A hostile client against the real server on loopback (tools/hostile_check.py): thousands of
//! unknown fields, thousands of tiny images declaring huge pictures, many image URLs (private
//! addresses only, refused before any connection), stored-response replays and another API
//! key's reads of a stored response. Every such request is a 4xx naming its problem, the
//! server's RSS after the run stays within 50 MiB of before, and it goes on answering `/health`
//! and a normal request as before.

mod serve_common;

use serve_common::{run_python_tool, start_with_mmproj};

#[test]
fn hostile_requests_are_refused_and_pin_no_memory() {
    let s = start_with_mmproj(&[
        "-np",
        "1",
        "-c",
        "2048",
        "--api-key",
        "k1,k2",
        // Debug logging on: unknown fields are remembered (boundedly) only then.
        "--verbose",
        "--allow-image-urls",
    ]);
    let pid = s.child.as_ref().expect("a server child").id().to_string();
    let url = format!("http://127.0.0.1:{}", s.port);
    let out = run_python_tool(
        "hostile_check.py",
        &[
            "--url",
            &url,
            "--pid",
            &pid,
            "--key",
            "k1",
            "--other-key",
            "k2",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}");
    let log = s.log_text();
    let tail: String = log
        .lines()
        .rev()
        .take(40)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        out.status.success() && stdout.contains("hostile client checks passed"),
        "tools/hostile_check.py failed ({}):\n{stdout}\n{stderr}\nserver log (last lines):\n{tail}",
        out.status
    );
    // The unknown names were logged, and only a bounded number of them.
    let named = log
        .lines()
        .filter(|l| l.contains("ignores unknown request fields"))
        .count();
    assert!(
        (1..=64).contains(&named),
        "{named} log lines of unknown fields"
    );
}
