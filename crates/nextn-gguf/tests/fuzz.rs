//! Property test on stable Rust: mutated and random inputs must give `Ok` or a typed `Err`,
//! never a panic or an allocation out of proportion to the input; accepted inputs must rewrite
//! to themselves byte for byte, and the rewrite must parse to the same thing.
//!
//! `cargo test -p nextn-gguf --test fuzz` runs a short deterministic pass (NEXTN_FUZZ_ITERS
//! iterations, default 40000, seed NEXTN_FUZZ_SEED). The long variant runs for
//! NEXTN_FUZZ_SECS seconds (default 300) with a time-based seed:
//! `cargo test -p nextn-gguf --release --test fuzz -- --ignored --nocapture`.
//! A failing input is saved to the temp dir and its path printed.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use nextn_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, MetadataArray, MetadataValue};

// ---- largest single allocation, per thread ----

struct TrackingAlloc;

thread_local! {
    static LARGEST_ALLOC: Cell<usize> = const { Cell::new(0) };
}

fn note_alloc(size: usize) {
    // try_with: the slot may be gone during thread teardown.
    let _ = LARGEST_ALLOC.try_with(|m| {
        if size > m.get() {
            m.set(size)
        }
    });
}

unsafe impl GlobalAlloc for TrackingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_alloc(layout.size());
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_alloc(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_alloc(new_size);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: TrackingAlloc = TrackingAlloc;

// ---- PRNG (SplitMix64) ----

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
    fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }
}

// ---- where the numeric fields of a valid file are, for targeted inflation ----

/// (offset, width) of every count, length, type id, dim, offset and integer value of a valid file.
fn numeric_fields(b: &[u8]) -> Vec<(usize, usize)> {
    fn u32_at(b: &[u8], p: usize) -> u32 {
        u32::from_le_bytes(b[p..p + 4].try_into().unwrap())
    }
    fn u64_at(b: &[u8], p: usize) -> u64 {
        u64::from_le_bytes(b[p..p + 8].try_into().unwrap())
    }
    fn string(b: &[u8], p: &mut usize, out: &mut Vec<(usize, usize)>) {
        out.push((*p, 8));
        *p += 8 + u64_at(b, *p) as usize;
    }
    fn value(b: &[u8], ty: u32, p: &mut usize, out: &mut Vec<(usize, usize)>) {
        // Integer scalars count as fields too: `general.alignment` and `split.*` are values.
        match ty {
            0 | 1 | 7 => *p += 1,
            2 | 3 => *p += 2,
            4 | 5 => {
                out.push((*p, 4));
                *p += 4
            }
            6 => *p += 4,
            10 | 11 => {
                out.push((*p, 8));
                *p += 8
            }
            12 => *p += 8,
            8 => string(b, p, out),
            9 => {
                let et = u32_at(b, *p);
                out.push((*p, 4));
                out.push((*p + 4, 8));
                let n = u64_at(b, *p + 4);
                *p += 12;
                for _ in 0..n {
                    value(b, et, p, out);
                }
            }
            _ => unreachable!("seed files are valid"),
        }
    }
    let mut out = vec![(4, 4), (8, 8), (16, 8)];
    let (n_tensors, n_kv) = (u64_at(b, 8), u64_at(b, 16));
    let mut p = 24;
    for _ in 0..n_kv {
        string(b, &mut p, &mut out);
        let ty = u32_at(b, p);
        out.push((p, 4));
        p += 4;
        value(b, ty, &mut p, &mut out);
    }
    for _ in 0..n_tensors {
        string(b, &mut p, &mut out);
        let n_dims = u32_at(b, p) as usize;
        out.push((p, 4));
        p += 4;
        for _ in 0..n_dims {
            out.push((p, 8));
            p += 8;
        }
        out.push((p, 4));
        out.push((p + 4, 8));
        p += 12;
    }
    out
}

struct Seed {
    bytes: Vec<u8>,
    fields: Vec<(usize, usize)>,
}

fn seeds() -> Vec<Seed> {
    let mut files = vec![common::rich_writer().to_bytes().unwrap()];
    let mut v2 = common::rich_writer();
    v2.set_version(2);
    v2.set_alignment(8);
    files.push(v2.to_bytes().unwrap());
    let mut tiny = GgufWriter::new();
    tiny.add_kv("general.alignment", MetadataValue::U32(16));
    tiny.add_tensor("x", vec![2], GgmlType::F32, vec![1; 8])
        .unwrap();
    files.push(tiny.to_bytes().unwrap());
    // Metadata only, without the padding (as gguf-py writes vocab-only files).
    let mut vocab_only = GgufWriter::new();
    vocab_only.set_alignment(32);
    vocab_only.add_kv(
        "tokenizer.ggml.tokens",
        MetadataArray::String(vec!["a".into(), "b".into()]),
    );
    let mut bytes = vocab_only.to_bytes().unwrap();
    // The last value ends in b'b', so the zeros after it are exactly the padding.
    while bytes.last() == Some(&0) {
        bytes.pop();
    }
    files.push(bytes);
    for name in [
        "gguf_py_all_types.gguf",
        "gguf_py_split-00001-of-00003.gguf",
        "gguf_py_split-00002-of-00003.gguf",
    ] {
        files.push(std::fs::read(common::data_dir().join(name)).unwrap());
    }
    // Real metadata (tokenizer arrays, chat template) with only the smallest tensors kept.
    if let Some(shared) = nextn_testdata::shared_dir() {
        let path = shared.join("golden/q35moe-b/q35moe-b-F32.gguf");
        if let Ok(f) = GgufFile::open(&path) {
            let mut w = GgufWriter::from_file(&f);
            let mut by_size: Vec<_> = f.tensors().iter().collect();
            by_size.sort_by_key(|t| t.n_bytes);
            for t in &by_size[4..] {
                w.remove_tensor(&t.name);
            }
            files.push(w.to_bytes().unwrap());
        }
    }
    files
        .into_iter()
        .map(|bytes| Seed {
            fields: numeric_fields(&bytes),
            bytes,
        })
        .collect()
}

fn mutate(rng: &mut Rng, seeds: &[Seed]) -> (Vec<u8>, &'static str) {
    if rng.chance(12) {
        let n = rng.below(512);
        let mut b: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
        if rng.chance(2) && b.len() >= 24 {
            // Past the magic/version check, so the random part reaches the KV and tensor parsers.
            b[..8].copy_from_slice(b"GGUF\x03\0\0\0");
            if rng.chance(2) {
                b[8..24].fill(0);
                b[8 + rng.below(2) * 8] = rng.below(4) as u8;
            }
        }
        return (b, "random");
    }
    let seed = &seeds[rng.below(seeds.len())];
    let mut b = seed.bytes.clone();
    let rounds = 1 + rng.below(3);
    let mut kind = "";
    for _ in 0..rounds {
        let len = b.len().max(1);
        match rng.below(8) {
            0 => {
                kind = "bitflip";
                for _ in 0..1 + rng.below(8) {
                    let i = rng.below(len);
                    if let Some(x) = b.get_mut(i) {
                        *x ^= 1 << rng.below(8);
                    }
                }
            }
            1 => {
                kind = "byte-set";
                let v = [0x00, 0xFF, 0x7F, 0x80][rng.below(4)];
                let i = rng.below(len);
                let n = 1 + rng.below(8);
                for x in b.iter_mut().skip(i).take(n) {
                    *x = v;
                }
            }
            2 => {
                kind = "truncate";
                b.truncate(rng.below(len));
            }
            3 | 4 => {
                kind = "inflate";
                let &(at, width) = &seed.fields[rng.below(seed.fields.len())];
                if at + width <= b.len() {
                    let old = if width == 8 {
                        u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
                    } else {
                        u32::from_le_bytes(b[at..at + 4].try_into().unwrap()).into()
                    };
                    let new = match rng.below(11) {
                        10 => 1 << rng.below(width * 8),
                        0 => u64::MAX,
                        1 => u64::MAX / 2 + rng.below(3) as u64,
                        2 => 1 << 32,
                        3 => 1 << 63,
                        4 => b.len() as u64 + rng.below(3) as u64,
                        5 => old.wrapping_add(1),
                        6 => old.wrapping_mul(2),
                        7 => old.wrapping_sub(1),
                        8 => rng.below(64) as u64,
                        _ => rng.next(),
                    };
                    b[at..at + width].copy_from_slice(&new.to_le_bytes()[..width]);
                }
            }
            5 => {
                kind = "splice";
                let other = &seeds[rng.below(seeds.len())].bytes;
                let cut = rng.below(len);
                let from = rng.below(other.len());
                b.truncate(cut);
                b.extend_from_slice(&other[from..]);
            }
            6 => {
                kind = "copy-chunk";
                let src = rng.below(len);
                let n = rng.below(64).min(b.len().saturating_sub(src));
                let chunk = b[src..src + n].to_vec();
                let dst = rng.below(len);
                for (i, x) in chunk.into_iter().enumerate() {
                    if let Some(y) = b.get_mut(dst + i) {
                        *y = x;
                    }
                }
            }
            _ => {
                kind = "insert-delete";
                let i = rng.below(len).min(b.len());
                if rng.chance(2) {
                    let n = 1 + rng.below(16);
                    for _ in 0..n {
                        b.insert(i, rng.next() as u8);
                    }
                } else {
                    let n = (1 + rng.below(16)).min(b.len() - i);
                    b.drain(i..i + n);
                }
            }
        }
    }
    (b, kind)
}

#[derive(Default)]
struct Stats {
    inputs: u64,
    accepted: u64,
    by_kind: BTreeMap<&'static str, (u64, u64)>,
    errors: BTreeMap<String, u64>,
}

fn error_name(e: &GgufError) -> String {
    let dbg = format!("{:?}", e.kind());
    dbg.split([' ', '(', '{']).next().unwrap_or("").to_owned()
}

/// Exercises every accessor on every key; none may panic.
fn touch_accessors(f: &GgufFile) {
    for (k, v) in f.metadata() {
        let _ = (
            f.get_u32(k),
            f.get_u64(k),
            f.get_i64(k),
            f.get_f32(k),
            f.get_bool(k),
        );
        let _ = (f.get_str(k), f.get_array(k), v.type_name());
        if let MetadataValue::Array(a) = v {
            let _ = (
                a.as_u32_vec(),
                a.as_i32_vec(),
                a.as_f32_vec(),
                a.element_type_name(),
            );
        }
    }
}

/// A `Write` sink that refuses to grow past `limit` bytes: writing an accepted file must not
/// produce output out of proportion to the input.
struct BoundedSink {
    buf: Vec<u8>,
    limit: usize,
}

impl std::io::Write for BoundedSink {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + data.len() > self.limit {
            return Err(std::io::Error::other("output exceeds the bound"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn write_bounded(w: &GgufWriter, input_len: usize) -> Result<Vec<u8>, String> {
    let mut sink = BoundedSink {
        buf: Vec::new(),
        limit: 4 * input_len + 4096,
    };
    w.write_to(&mut sink)
        .map_err(|e| format!("write of {input_len}-byte input: {e}"))?;
    Ok(sink.buf)
}

/// The properties, for one input. Returns whether the parser accepted it.
fn check_input(input: &[u8]) -> Result<bool, String> {
    LARGEST_ALLOC.with(|m| m.set(0));
    let parsed = GgufFile::from_bytes(input.to_vec());
    let largest = LARGEST_ALLOC.with(|m| m.get());
    // The input copy itself is `input.len()`; everything else must stay proportional to it.
    let limit = 16 * input.len() + (1 << 20);
    if largest > limit {
        return Err(format!(
            "allocation of {largest} bytes for a {}-byte input",
            input.len()
        ));
    }
    let f = match parsed {
        Ok(f) => f,
        Err(e) => {
            // Display must work too.
            let _ = e.to_string();
            return Ok(false);
        }
    };
    touch_accessors(&f);
    for t in f.tensors() {
        if f.tensor_data(t).len() as u64 != t.n_bytes {
            return Err(format!("tensor {} data length", t.name));
        }
    }
    let rewritten = write_bounded(&GgufWriter::from_file(&f), input.len())?;
    if rewritten != input {
        let at = rewritten.iter().zip(input).position(|(a, b)| a != b);
        return Err(format!(
            "rewrite differs: {} vs {} bytes, first difference at {at:?}",
            rewritten.len(),
            input.len()
        ));
    }
    let mut canonical = GgufWriter::from_file(&f);
    canonical.discard_preserved_layout();
    let canonical = write_bounded(&canonical, input.len())?;
    let g =
        GgufFile::from_bytes(canonical.clone()).map_err(|e| format!("canonical reparse: {e}"))?;
    let canonical2 = GgufWriter::from_file(&g)
        .to_bytes()
        .map_err(|e| e.to_string())?;
    if canonical2 != canonical {
        return Err("parse -> write -> parse -> write is not stable".into());
    }
    // Same metadata (compared through its encoding, since NaN != NaN) and same tensors.
    if g.metadata().len() != f.metadata().len() || g.tensors().len() != f.tensors().len() {
        return Err("canonical rewrite lost entries".into());
    }
    for (a, b) in f.tensors().iter().zip(g.tensors()) {
        if (&a.name, &a.dims, a.ty) != (&b.name, &b.dims, b.ty)
            || f.tensor_data(a) != g.tensor_data(b)
        {
            return Err(format!("tensor {} changed in canonical rewrite", a.name));
        }
    }
    Ok(true)
}

fn run(seed: u64, budget: impl Fn(u64) -> bool) -> Stats {
    let seeds = seeds();
    let mut rng = Rng(seed);
    let mut stats = Stats::default();
    // Seeds themselves are valid and must pass.
    for s in &seeds {
        assert_eq!(check_input(&s.bytes), Ok(true));
    }
    while budget(stats.inputs) {
        let (input, kind) = mutate(&mut rng, &seeds);
        let outcome = catch_unwind(AssertUnwindSafe(|| check_input(&input)));
        let failure = match outcome {
            Ok(Ok(accepted)) => {
                stats.accepted += u64::from(accepted);
                let e = stats.by_kind.entry(kind).or_default();
                e.0 += 1;
                e.1 += u64::from(accepted);
                if !accepted {
                    if let Err(err) = GgufFile::from_bytes(input.clone()) {
                        *stats.errors.entry(error_name(&err)).or_default() += 1;
                    }
                }
                None
            }
            Ok(Err(msg)) => Some(msg),
            Err(_) => Some("panic".to_owned()),
        };
        if let Some(msg) = failure {
            let path = std::env::temp_dir()
                .join(format!("nextn-gguf-fuzz-{seed:x}-{}.gguf", stats.inputs));
            let _ = std::fs::write(&path, &input);
            panic!(
                "input #{} ({kind}, seed {seed:#x}) failed: {msg}; saved to {}",
                stats.inputs,
                path.display()
            );
        }
        stats.inputs += 1;
    }
    stats
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn report(stats: &Stats, seed: u64, elapsed: Duration) {
    println!(
        "fuzz: seed {seed:#x}, {} inputs in {:.1}s, {} accepted",
        stats.inputs,
        elapsed.as_secs_f64(),
        stats.accepted
    );
    for (kind, (n, ok)) in &stats.by_kind {
        println!("  {kind:14} {n:9} inputs, {ok:7} accepted");
    }
    for (err, n) in &stats.errors {
        println!("  {err:30} {n}");
    }
}

/// Inputs that once failed (see docs/TESTING.md), kept so they keep passing.
#[test]
fn fuzz_regressions() {
    let dir = common::data_dir().join("regressions");
    let mut n = 0;
    for path in common::gguf_files_under(&dir) {
        let input = std::fs::read(&path).unwrap();
        assert_eq!(
            check_input(&input).map(|_| ()),
            Ok(()),
            "{}",
            path.display()
        );
        n += 1;
    }
    assert!(n >= 2, "regression inputs missing from {}", dir.display());
}

#[test]
fn fuzz_short() {
    let iters = env_u64("NEXTN_FUZZ_ITERS").unwrap_or(40_000);
    let seed = env_u64("NEXTN_FUZZ_SEED").unwrap_or(0x6775_6666);
    let start = Instant::now();
    let stats = run(seed, |n| n < iters);
    report(&stats, seed, start.elapsed());
    // The mutators must produce both kinds of input, or the test checks little.
    assert!(stats.accepted > 0 && stats.accepted < stats.inputs);
    assert!(
        stats.errors.len() >= 10,
        "too few distinct errors: {:?}",
        stats.errors
    );
}

#[test]
#[ignore = "long fuzz run; NEXTN_FUZZ_SECS (default 300)"]
fn fuzz_long() {
    let secs = env_u64("NEXTN_FUZZ_SECS").unwrap_or(300);
    let seed = env_u64("NEXTN_FUZZ_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let start = Instant::now();
    let deadline = start + Duration::from_secs(secs);
    let stats = run(seed, |n| n % 256 != 0 || Instant::now() < deadline);
    report(&stats, seed, start.elapsed());
}

#[test]
fn fuzz_split_shards() {
    // Corrupting one shard of a split model must fail cleanly (or open, if harmless).
    let dir = common::TempDir::new("fuzz-split");
    let paths = common::rich_writer()
        .write_split(dir.path("m"), nextn_gguf::SplitLimit::MaxTensors(2))
        .unwrap();
    let originals: Vec<Vec<u8>> = paths.iter().map(|p| std::fs::read(p).unwrap()).collect();
    let seeds: Vec<Seed> = originals
        .iter()
        .map(|b| Seed {
            bytes: b.clone(),
            fields: numeric_fields(b),
        })
        .collect();
    let mut rng = Rng(env_u64("NEXTN_FUZZ_SEED").unwrap_or(7));
    let (mut opened, mut refused) = (0, 0);
    for _ in 0..300 {
        let victim = rng.below(paths.len());
        let (bytes, _) = mutate(&mut rng, &seeds[victim..=victim]);
        std::fs::write(&paths[victim], &bytes).unwrap();
        match catch_unwind(|| GgufFile::open(&paths[0]).map(|f| f.tensors().len())) {
            Ok(Ok(_)) => opened += 1,
            Ok(Err(e)) => {
                let _ = e.to_string();
                refused += 1
            }
            Err(_) => panic!("panic opening a split model with shard {victim} mutated"),
        }
        std::fs::write(&paths[victim], &originals[victim]).unwrap();
    }
    println!("split fuzz: {opened} opened, {refused} refused");
    assert!(refused > 0);
}
