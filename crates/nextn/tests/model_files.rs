//! Damaged and hostile model files through the real binary: `inspect`, `verify` and `run` each
//! give a clear error naming the key or tensor, exit 1, within a time and memory budget, and a
//! file `verify` accepts is one `run` can generate from.
//!
//! The files are made from the bundled model by a structure-aware generator: every mutated file
//! is a valid GGUF (written by `GgufWriter`), so the mutations reach the model's own checks
//! rather than the container parser (which `nextn-gguf`'s byte-level fuzzing covers). The
//! generator edits metadata values (integers to edge values, floats to NaN/∞/0, strings,
//! arrays resized or retyped, keys removed), tensor shapes (rows cut or added, dims swapped),
//! tensor types (values re-encoded in another type), names (moved to another layer, removed)
//! and data (filled with a byte pattern such as 0xFF, which makes NaN scales).
//!
//! `cargo test --release -p nextn --test model_files` runs the listed cases and a fixed-seed
//! corpus; `NEXTN_FUZZ_CASES=N cargo test --release -p nextn --test model_files -- --ignored`
//! runs N more cases from a time-based seed (default 2,000), printing each finding.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nextn_gguf::{GgmlType, GgufFile, GgufWriter, MetadataArray, MetadataValue};

fn bundled() -> PathBuf {
    nextn_testdata::bundled_model()
}

fn tmp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nextn-model-files-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

// ---------------------------------------------------------------------------------------------
// Running a command with a deadline and measuring its peak memory.

/// How one command ended.
#[derive(Debug)]
struct Finished {
    /// Exit status code, or `None` when killed by a signal.
    code: Option<i32>,
    signal: Option<i32>,
    /// Peak resident set size in MiB (the kernel's `ru_maxrss` of the child).
    peak_mib: f64,
    wall: Duration,
    stderr: String,
    timed_out: bool,
}

impl Finished {
    fn describe(&self) -> String {
        format!(
            "code {:?} signal {:?}, {:.0} MiB, {:.2} s{}\nstderr: {}",
            self.code,
            self.signal,
            self.peak_mib,
            self.wall.as_secs_f64(),
            if self.timed_out { ", TIMED OUT" } else { "" },
            self.stderr.trim_end()
        )
    }
}

/// Run `nextn args...`, killing it after `limit`; stdout is discarded.
fn nextn(args: &[&str], limit: Duration) -> Finished {
    let start = Instant::now();
    let stderr_path = tmp_dir().join(format!(
        "stderr-{:?}-{}",
        std::thread::current().id(),
        start.elapsed().as_nanos()
    ));
    let stderr_file = std::fs::File::create(&stderr_path).expect("stderr file");
    // Reaped below with wait4, which also gives the child's peak memory.
    #[allow(clippy::zombie_processes)]
    let child = Command::new(env!("CARGO_BIN_EXE_nextn"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr_file)
        .spawn()
        .expect("spawn nextn");
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: plain struct of integers, filled in by wait4.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let mut timed_out = false;
    loop {
        // SAFETY: pid is our child; status and usage are valid for writes.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if r == pid {
            break;
        }
        assert!(r == 0, "wait4 failed");
        if start.elapsed() > limit && !timed_out {
            timed_out = true;
            // SAFETY: sending a signal to our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let wall = start.elapsed();
    let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    let _ = std::fs::remove_file(&stderr_path);
    Finished {
        code: libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status)),
        signal: libc::WIFSIGNALED(status).then(|| libc::WTERMSIG(status)),
        peak_mib: usage.ru_maxrss as f64 / 1024.0,
        wall,
        stderr,
        timed_out,
    }
}

// ---------------------------------------------------------------------------------------------
// Edits of a model file.

/// One edit of a model file, applied through `GgufWriter` so the result is a valid GGUF.
#[derive(Clone, Debug)]
enum Edit {
    SetKv(String, MetadataValue),
    RemoveKv(String),
    /// Give a tensor this many rows (ne[1]): the first rows kept, or the last row repeated.
    Rows(String, u64),
    /// Store a tensor's values in another type.
    Retype(String, GgmlType),
    /// Swap ne[0] and ne[1], keeping the bytes.
    SwapDims(String),
    RemoveTensor(String),
    RenameTensor(String, String),
    /// Overwrite every byte of a tensor's data.
    Fill(String, u8),
}

/// The bundled model with `edits` applied, written to `path`. `None` when an edit cannot be
/// made into a valid file (say a type whose blocks do not divide the row).
fn write_edited(base: &GgufFile, edits: &[Edit], path: &Path) -> Option<()> {
    let mut w = GgufWriter::from_file(base);
    for edit in edits {
        match edit {
            Edit::SetKv(k, v) => w.set_kv(k.clone(), v.clone()),
            Edit::RemoveKv(k) => {
                w.remove_kv(k)?;
            }
            Edit::RemoveTensor(name) => {
                if !w.remove_tensor(name) {
                    return None;
                }
            }
            Edit::Rows(name, rows) => {
                let t = base.tensor(name)?;
                let row_bytes = t.row_bytes() as usize;
                let data = base.tensor_data(t);
                let mut bytes = Vec::with_capacity(row_bytes * *rows as usize);
                for r in 0..*rows as usize {
                    let src = r.min(t.n_rows() as usize - 1);
                    bytes.extend_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
                }
                let mut dims = t.dims.clone();
                if dims.len() < 2 {
                    dims.push(1);
                }
                dims[1] = *rows;
                w.remove_tensor(name);
                w.add_tensor(name.clone(), dims, t.ty, bytes).ok()?;
            }
            Edit::Retype(name, ty) => {
                let t = base.tensor(name)?;
                let n0 = t.dims[0] as usize;
                if !n0.is_multiple_of(ty.block_size()) || !nextn_quant::formats::can_quantize(*ty) {
                    return None;
                }
                let data = base.tensor_data(t);
                let (src_row, dst_row) =
                    (t.row_bytes() as usize, ty.row_bytes(n0 as u64)? as usize);
                let mut values = vec![0.0f32; n0];
                let mut bytes = vec![0u8; dst_row * t.n_rows() as usize];
                for r in 0..t.n_rows() as usize {
                    nextn_quant::formats::dequantize(
                        t.ty,
                        &data[r * src_row..(r + 1) * src_row],
                        &mut values,
                    )
                    .ok()?;
                    nextn_quant::formats::quantize(
                        *ty,
                        &values,
                        &mut bytes[r * dst_row..(r + 1) * dst_row],
                    )
                    .ok()?;
                }
                w.remove_tensor(name);
                w.add_tensor(name.clone(), t.dims.clone(), *ty, bytes)
                    .ok()?;
            }
            Edit::SwapDims(name) => {
                let t = base.tensor(name)?;
                if t.dims.len() < 2 || t.dims[0] == t.dims[1] {
                    return None;
                }
                let mut dims = t.dims.clone();
                dims.swap(0, 1);
                let bytes = base.tensor_data(t).to_vec();
                w.remove_tensor(name);
                w.add_tensor(name.clone(), dims, t.ty, bytes).ok()?;
            }
            Edit::RenameTensor(from, to) => {
                let t = base.tensor(from)?;
                let bytes = base.tensor_data(t).to_vec();
                w.remove_tensor(from);
                w.add_tensor(to.clone(), t.dims.clone(), t.ty, bytes).ok()?;
            }
            Edit::Fill(name, byte) => {
                let t = base.tensor(name)?;
                let bytes = vec![*byte; t.n_bytes as usize];
                w.remove_tensor(name);
                w.add_tensor(name.clone(), t.dims.clone(), t.ty, bytes)
                    .ok()?;
            }
        }
    }
    w.discard_preserved_layout();
    w.write_file(path).ok()
}

fn kv(key: &str, v: impl Into<MetadataValue>) -> Edit {
    Edit::SetKv(key.to_string(), v.into())
}

fn sections(s: [i32; 4]) -> Edit {
    kv(
        "qwen35.rope.dimension_sections",
        MetadataArray::from(s.to_vec()),
    )
}

/// The bundled model's tokens, cut or padded to `n`.
fn tokens(base: &GgufFile, n: usize) -> Edit {
    let mut t: Vec<String> = base
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.as_array())
        .and_then(|a| a.as_strings())
        .expect("tokens")
        .to_vec();
    let extra = (t.len()..n).map(|i| format!("<extra_{i}>"));
    t.extend(extra);
    t.truncate(n);
    kv("tokenizer.ggml.tokens", MetadataArray::from(t))
}

/// The damaged files a hostile user tried, each with what the error must name.
fn listed_cases(base: &GgufFile) -> Vec<(&'static str, Vec<Edit>, &'static str)> {
    vec![
        (
            "block_count 500000000",
            vec![kv("qwen35.block_count", 500_000_000u32)],
            "qwen35.block_count",
        ),
        (
            "block_count 1048576",
            vec![kv("qwen35.block_count", 1_048_576u32)],
            "qwen35.block_count",
        ),
        (
            "block_count 4294967295",
            vec![kv("qwen35.block_count", u32::MAX)],
            "qwen35.block_count",
        ),
        (
            "tokens missing",
            vec![Edit::RemoveKv("tokenizer.ggml.tokens".into())],
            "tokenizer.ggml.tokens",
        ),
        (
            "merges missing",
            vec![Edit::RemoveKv("tokenizer.ggml.merges".into())],
            "tokenizer.ggml.merges",
        ),
        (
            "context_length 0",
            vec![kv("qwen35.context_length", 0u32)],
            "qwen35.context_length",
        ),
        (
            "context_length 1",
            vec![kv("qwen35.context_length", 1u32)],
            "qwen35.context_length",
        ),
        (
            "8000 tokens for 8192 rows",
            vec![tokens(base, 8000)],
            "tokenizer.ggml.tokens",
        ),
        (
            "9000 tokens for 8192 rows",
            vec![tokens(base, 9000)],
            "tokenizer.ggml.tokens",
        ),
        (
            "token_embd with 8000 rows",
            vec![Edit::Rows("token_embd.weight".into(), 8000)],
            "token_embd.weight",
        ),
        (
            "rms epsilon NaN",
            vec![kv("qwen35.attention.layer_norm_rms_epsilon", f32::NAN)],
            "qwen35.attention.layer_norm_rms_epsilon",
        ),
        (
            "rope.freq_base 0",
            vec![kv("qwen35.rope.freq_base", 0.0f32)],
            "qwen35.rope.freq_base",
        ),
        (
            "rope.dimension_count 0",
            vec![kv("qwen35.rope.dimension_count", 0u32)],
            "qwen35.rope.dimension_count",
        ),
        (
            "rope sections [11,11,9,0]",
            vec![sections([11, 11, 9, 0])],
            "qwen35.rope.dimension_sections",
        ),
        (
            "rope sections [1000,1000,1000,1000]",
            vec![sections([1000; 4])],
            "qwen35.rope.dimension_sections",
        ),
        (
            "rope sections [-5,11,10,0]",
            vec![sections([-5, 11, 10, 0])],
            "qwen35.rope.dimension_sections",
        ),
        (
            "eos_token_id 100000",
            vec![kv("tokenizer.ggml.eos_token_id", 100_000u32)],
            "tokenizer.ggml.eos_token_id",
        ),
        (
            "output_norm as Q8_0",
            vec![Edit::Retype("output_norm.weight".into(), GgmlType::Q8_0)],
            "output_norm.weight",
        ),
        (
            "output_norm as F16",
            vec![Edit::Retype("output_norm.weight".into(), GgmlType::F16)],
            "output_norm.weight",
        ),
    ]
}

/// Each listed damaged file: inspect, verify and run each exit 1 with an error naming the key or
/// tensor, in under 2 s and 200 MiB of peak memory.
#[test]
fn damaged_files_are_refused_naming_the_key() {
    let base = GgufFile::open(bundled()).expect("bundled model");
    let dir = tmp_dir();
    let mut failures = Vec::new();
    for (i, (what, edits, names)) in listed_cases(&base).into_iter().enumerate() {
        let path = dir.join(format!("listed-{i}.gguf"));
        write_edited(&base, &edits, &path).unwrap_or_else(|| panic!("cannot make {what}"));
        let p = path.to_str().expect("utf-8 path");
        for args in [
            vec!["inspect", p],
            vec!["verify", p],
            vec!["run", "-m", p, "-p", "Hello", "-n", "4", "--temp", "0"],
        ] {
            let f = nextn(&args, Duration::from_secs(20));
            let ok = f.code == Some(1)
                && f.stderr.contains(names)
                && !f.stderr.contains("panicked")
                && f.wall < Duration::from_secs(2)
                && f.peak_mib < 200.0;
            eprintln!(
                "{what:<38} {:<8} exit {:?} {:>4.0} MiB {:.2} s",
                args[0],
                f.code,
                f.peak_mib,
                f.wall.as_secs_f64()
            );
            if !ok {
                failures.push(format!(
                    "{what}: `nextn {}` should exit 1 naming {names} within 2 s and 200 MiB: {}",
                    args[0],
                    f.describe()
                ));
            }
        }
        let _ = std::fs::remove_file(&path);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

// ---------------------------------------------------------------------------------------------
// The structure-aware generator.

/// SplitMix64: small, seedable, and the same sequence on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// An integer near the edges: the ones that break sizing, indexing and division.
fn edge_integer(rng: &mut Rng, current: u64) -> u64 {
    let choices = [
        0,
        1,
        2,
        3,
        current.wrapping_sub(1),
        current + 1,
        current.saturating_mul(2),
        current / 2,
        255,
        65_535,
        1 << 20,
        500_000_000,
        (1 << 31) - 1,
        1 << 31,
        u32::MAX as u64,
        1 << 40,
        u64::MAX,
        rng.next() % 100_000,
    ];
    *rng.pick(&choices)
}

fn edge_float(rng: &mut Rng, current: f64) -> f64 {
    let choices = [
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        0.0,
        -0.0,
        -current,
        current * 10.0,
        current / 10.0,
        1e30,
        1e-30,
        1.0,
        -1.0,
    ];
    *rng.pick(&choices)
}

/// A new value for `v`: an edge value of its own type, or a value of another type.
fn mutate_value(rng: &mut Rng, v: &MetadataValue) -> MetadataValue {
    if rng.below(8) == 0 {
        // Another type altogether.
        return match rng.below(5) {
            0 => MetadataValue::String("qwen35".into()),
            1 => MetadataValue::F32(1.5),
            2 => MetadataValue::I32(-7),
            3 => MetadataValue::Bool(true),
            _ => MetadataArray::from(vec![1u32, 2, 3]).into(),
        };
    }
    match v {
        MetadataValue::F32(x) => MetadataValue::F32(edge_float(rng, *x as f64) as f32),
        MetadataValue::F64(x) => MetadataValue::F64(edge_float(rng, *x)),
        MetadataValue::Bool(b) => MetadataValue::Bool(!b),
        MetadataValue::String(s) => match rng.below(4) {
            0 => MetadataValue::String(String::new()),
            1 => MetadataValue::String("llama".into()),
            2 => MetadataValue::String(s.chars().rev().collect()),
            _ => MetadataValue::String("{% for x in %}".into()),
        },
        MetadataValue::Array(a) => MetadataValue::Array(mutate_array(rng, a)),
        other => {
            let current = other.as_u64().unwrap_or(0);
            let x = edge_integer(rng, current);
            match other {
                MetadataValue::U8(_) => MetadataValue::U8(x as u8),
                MetadataValue::I8(_) => MetadataValue::I8(x as i8),
                MetadataValue::U16(_) => MetadataValue::U16(x as u16),
                MetadataValue::I16(_) => MetadataValue::I16(x as i16),
                MetadataValue::I32(_) => MetadataValue::I32(x as i32),
                MetadataValue::U64(_) => MetadataValue::U64(x),
                MetadataValue::I64(_) => MetadataValue::I64(x as i64),
                _ => MetadataValue::U32(x as u32),
            }
        }
    }
}

fn mutate_array(rng: &mut Rng, a: &MetadataArray) -> MetadataArray {
    fn resize<T: Clone>(rng: &mut Rng, v: &[T]) -> Vec<T> {
        let mut v = v.to_vec();
        match rng.below(4) {
            0 => v.clear(),
            1 => {
                let keep = v.len().saturating_sub(1 + rng.below(3));
                v.truncate(keep);
            }
            2 => {
                let keep = v.len() / 2;
                v.truncate(keep);
            }
            _ => {
                if let Some(last) = v.last().cloned() {
                    let extra = 1 + rng.below(3);
                    v.extend(std::iter::repeat_n(last, extra));
                }
            }
        }
        v
    }
    match a {
        MetadataArray::String(v) => MetadataArray::String(resize(rng, v)),
        MetadataArray::I32(v) if rng.below(2) == 0 && !v.is_empty() => {
            let mut v = v.clone();
            let i = rng.below(v.len());
            v[i] = *rng.pick(&[-1, -5, 1000, i32::MAX, i32::MIN]);
            MetadataArray::I32(v)
        }
        MetadataArray::I32(v) => MetadataArray::I32(resize(rng, v)),
        MetadataArray::U32(v) => MetadataArray::U32(resize(rng, v)),
        MetadataArray::F32(v) => MetadataArray::F32(resize(rng, v)),
        MetadataArray::Bool(v) => MetadataArray::Bool(resize(rng, v)),
        other => match other.as_i64_vec() {
            Some(v) => MetadataArray::F32(v.iter().map(|&x| x as f32).collect()),
            None => MetadataArray::I32(vec![]),
        },
    }
}

/// One to three random edits of the bundled model.
fn random_edits(rng: &mut Rng, base: &GgufFile) -> Vec<Edit> {
    let keys: Vec<&String> = base.metadata().iter().map(|(k, _)| k).collect();
    let tensors: Vec<&str> = base.tensors().iter().map(|t| t.name.as_str()).collect();
    let n = 1 + rng.below(3);
    (0..n)
        .map(|_| match rng.below(10) {
            0..=3 => {
                let key = *rng.pick(&keys);
                let v = base.get(key).expect("key");
                Edit::SetKv(key.clone(), mutate_value(rng, v))
            }
            4 => Edit::RemoveKv((*rng.pick(&keys)).clone()),
            5 => {
                let name: &&str = rng.pick(&tensors);
                let t = base.tensor(name).expect("tensor");
                let rows = edge_integer(rng, t.n_rows()).clamp(1, 3 * t.n_rows().max(1));
                Edit::Rows(t.name.clone(), rows)
            }
            6 => Edit::Retype(
                (*rng.pick(&tensors)).to_string(),
                *rng.pick(&[
                    GgmlType::F32,
                    GgmlType::F16,
                    GgmlType::BF16,
                    GgmlType::Q8_0,
                    GgmlType::Q4_0,
                    GgmlType::Q4_K,
                    GgmlType::Q6_K,
                ]),
            ),
            7 => match rng.below(3) {
                0 => Edit::SwapDims((*rng.pick(&tensors)).to_string()),
                1 => Edit::RemoveTensor((*rng.pick(&tensors)).to_string()),
                _ => {
                    let from = *rng.pick(&tensors);
                    let to = match from.split_once('.') {
                        Some(("blk", rest)) => {
                            let tail = rest.split_once('.').map_or(rest, |(_, t)| t);
                            format!("blk.{}.{tail}", rng.pick(&[0usize, 3, 7, 9, 12, 999_999]))
                        }
                        _ => format!("blk.0.{from}"),
                    };
                    Edit::RenameTensor(from.to_string(), to)
                }
            },
            _ => Edit::Fill(
                (*rng.pick(&tensors)).to_string(),
                *rng.pick(&[0x00u8, 0xFF, 0x7F, 0x80, 0x7C]),
            ),
        })
        .collect()
}

/// What went wrong with one generated file, or `None` when every property held.
fn check_case(path: &Path, limit: Duration, peak_limit_mib: f64) -> Option<String> {
    let p = path.to_str().expect("utf-8 path");
    let sane = |what: &str, f: &Finished, codes: &[i32]| -> Option<String> {
        let clean_exit = f.code.is_some_and(|c| codes.contains(&c));
        let explained = f.code == Some(0) || !f.stderr.trim().is_empty();
        if !clean_exit
            || !explained
            || f.timed_out
            || f.stderr.contains("panicked")
            || f.peak_mib > peak_limit_mib
        {
            Some(format!("`nextn {what}`: {}", f.describe()))
        } else {
            None
        }
    };
    let inspect = nextn(&["inspect", p], limit);
    if let Some(e) = sane("inspect", &inspect, &[0, 1]) {
        return Some(e);
    }
    let verify = nextn(&["verify", p], limit);
    if let Some(e) = sane("verify", &verify, &[0, 1, 2]) {
        return Some(e);
    }
    let run = nextn(
        &["run", "-m", p, "-p", "Hello", "-n", "4", "--temp", "0"],
        limit,
    );
    if let Some(e) = sane("run", &run, &[0, 1]) {
        return Some(e);
    }
    // verify's promise: a file it accepts is one run can generate from.
    if verify.code == Some(0) && run.code != Some(0) {
        return Some(format!(
            "verify accepted the file but run failed: {}",
            run.describe()
        ));
    }
    None
}

/// A fixed-seed corpus of generated files: every command ends cleanly (exit 0 or 1 with a
/// message, no panic, no signal, within 10 s and 200 MiB), and `verify` exit 0 implies
/// `run -n 4` succeeds.
#[test]
fn generated_model_files_fail_cleanly_and_verify_implies_run() {
    let base = GgufFile::open(bundled()).expect("bundled model");
    let dir = tmp_dir();
    let mut rng = Rng(0x6E65_7874_6E5F_6D66);
    let (mut made, mut accepted, mut findings) = (0, 0, Vec::new());
    let cases = 300;
    for case in 0..cases {
        let edits = random_edits(&mut rng, &base);
        let path = dir.join(format!("gen-{case}.gguf"));
        if write_edited(&base, &edits, &path).is_none() {
            continue;
        }
        made += 1;
        if let Some(finding) = check_case(&path, Duration::from_secs(10), 200.0) {
            findings.push(format!("case {case} {edits:?}: {finding}"));
        } else if nextn(
            &["verify", path.to_str().expect("path")],
            Duration::from_secs(10),
        )
        .code
            == Some(0)
        {
            accepted += 1;
        }
        let _ = std::fs::remove_file(&path);
    }
    eprintln!("{made} generated files, {accepted} accepted by verify (and run)");
    assert!(
        made >= cases * 3 / 4,
        "only {made} of {cases} edits made files"
    );
    assert!(findings.is_empty(), "{}", findings.join("\n\n"));
}

/// The long run outside the test suite: `NEXTN_FUZZ_CASES` cases (default 2,000) from a seed
/// taken from the clock (or `NEXTN_FUZZ_SEED`), printing each finding with its edits.
#[test]
#[ignore]
fn generated_model_files_long_run() {
    let base = GgufFile::open(bundled()).expect("bundled model");
    let dir = tmp_dir();
    let cases: usize = std::env::var("NEXTN_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let seed: u64 = std::env::var("NEXTN_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("seed {seed}, {cases} cases");
    let mut rng = Rng(seed);
    let (mut made, mut findings) = (0, 0);
    for case in 0..cases {
        let edits = random_edits(&mut rng, &base);
        let path = dir.join(format!("long-{case}.gguf"));
        if write_edited(&base, &edits, &path).is_none() {
            continue;
        }
        made += 1;
        if let Some(finding) = check_case(&path, Duration::from_secs(10), 200.0) {
            findings += 1;
            eprintln!("FINDING case {case} {edits:?}: {finding}");
            let keep = dir.join(format!("finding-{case}.gguf"));
            let _ = std::fs::rename(&path, &keep);
            eprintln!("  kept as {}", keep.display());
        } else {
            let _ = std::fs::remove_file(&path);
        }
    }
    eprintln!("{made} files, {findings} findings");
    assert_eq!(findings, 0);
}
