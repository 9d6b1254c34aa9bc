//! Weight matrix × 1, 2, 4, 8 activation rows for every weight type: the decode-time
//! matmul. Criterion reports weight bytes per second; a summary table with ms, GB/s,
//! GFLOP/s and the cost relative to one row is printed at the end (markdown).
//!
//! Environment: NEXTN_BENCH_THREADS (default 2), NEXTN_BENCH_TYPES (comma-separated
//! filter, e.g. "Q4_K,Q8_0"), NEXTN_BENCH_DIM (default 4096), NEXTN_SIMD (force a level),
//! NEXTN_BENCH_SUMMARY_ONLY (skip criterion, print only the table).

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use nextn_quant::kernels::{simd_level, QMatrix, ThreadPool, SUPPORTED_WEIGHT_TYPES};
use nextn_quant::GgmlType;

const ROW_COUNTS: [usize; 8] = [1, 2, 3, 4, 5, 6, 7, 8];

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Random well-formed blocks: random bits with finite, moderate scale fields.
fn random_matrix(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let n = rows * cols;
    let f16 = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
    match ty {
        GgmlType::F32 => (0..n).flat_map(|_| rng.uniform().to_le_bytes()).collect(),
        GgmlType::F16 => (0..n).flat_map(|_| f16(rng.uniform())).collect(),
        GgmlType::BF16 => (0..n)
            .flat_map(|_| half::bf16::from_f32(rng.uniform()).to_bits().to_le_bytes())
            .collect(),
        _ => {
            let mut data: Vec<u8> = (0..n / ty.block_size() * ty.type_size())
                .map(|_| rng.next() as u8)
                .collect();
            let fields: &[usize] = match ty {
                GgmlType::Q4_0
                | GgmlType::Q5_0
                | GgmlType::Q8_0
                | GgmlType::IQ4_NL
                | GgmlType::IQ4_XS => &[0],
                GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
                GgmlType::Q2_K => &[80, 82],
                GgmlType::Q3_K => &[108],
                GgmlType::Q6_K => &[208],
                _ => &[],
            };
            for blk in data.chunks_exact_mut(ty.type_size()) {
                for &at in fields {
                    blk[at..at + 2].copy_from_slice(&f16(0.01 * rng.uniform()));
                }
                match ty {
                    GgmlType::MXFP4 => blk[0] = 120 + (rng.next() % 10) as u8,
                    GgmlType::Q8_K => {
                        blk[0..4].copy_from_slice(&(0.01 * rng.uniform()).to_le_bytes())
                    }
                    _ => {}
                }
            }
            data
        }
    }
}

fn selected_types() -> Vec<GgmlType> {
    match std::env::var("NEXTN_BENCH_TYPES") {
        Ok(list) => list
            .split(',')
            .filter_map(|s| GgmlType::from_name(s.trim()))
            .collect(),
        Err(_) => SUPPORTED_WEIGHT_TYPES.to_vec(),
    }
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// CPU time consumed so far by the calling thread, if the OS reports it.
fn thread_cpu_time() -> Option<Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: plain syscall wrapper writing into `ts`.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    (rc == 0).then(|| Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

/// Minimum CPU time of the calling thread per `mul_rows` on a one-thread pool: the
/// kernel's cost without interference from other processes' scheduling.
fn cpu_time_one_thread(
    m: &QMatrix,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    budget: Duration,
) -> Option<Duration> {
    let pool = ThreadPool::new(1);
    let start = Instant::now();
    let mut best: Option<Duration> = None;
    let mut runs = 0;
    while runs < 5 || (start.elapsed() < budget && runs < 1000) {
        let before = thread_cpu_time()?;
        m.mul_rows(x, n, out, &pool).expect("mul_rows");
        let spent = thread_cpu_time()? - before;
        best = Some(best.map_or(spent, |b| b.min(spent)));
        runs += 1;
    }
    best
}

/// (median, minimum) wall time of `mul_rows` over repeated runs for about `budget`. The
/// minimum is the better estimate on a machine shared with other work.
fn times(
    m: &QMatrix,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    pool: &ThreadPool,
    budget: Duration,
) -> (Duration, Duration) {
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < 5 || (start.elapsed() < budget && times.len() < 1000) {
        let t = Instant::now();
        m.mul_rows(x, n, out, pool).expect("mul_rows");
        times.push(t.elapsed());
    }
    times.sort();
    (times[times.len() / 2], times[0])
}

fn main() {
    let dim = env_usize("NEXTN_BENCH_DIM", 4096);
    let threads = env_usize("NEXTN_BENCH_THREADS", 2);
    let pool = ThreadPool::new(threads);
    let mut criterion = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(900))
        .configure_from_args();
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let x: Vec<f32> = (0..8 * dim).map(|_| rng.uniform()).collect();
    let mut out = vec![0f32; 8 * dim];
    let mut table = Vec::new();

    for ty in selected_types() {
        let data = random_matrix(ty, dim, dim, &mut rng);
        let m = QMatrix::new(ty, dim, dim, &data).expect("matrix");
        if std::env::var_os("NEXTN_BENCH_SUMMARY_ONLY").is_none() {
            let mut group =
                criterion.benchmark_group(format!("matmul_{dim}x{dim}_{threads}t/{ty}"));
            group.throughput(Throughput::Bytes(data.len() as u64));
            for n in ROW_COUNTS {
                group.bench_with_input(BenchmarkId::new("rows", n), &n, |b, &n| {
                    b.iter(|| {
                        m.mul_rows(&x[..n * dim], n, &mut out[..n * dim], &pool)
                            .expect("mul_rows")
                    })
                });
            }
            group.finish();
        }
        let (mut one_row, mut one_row_cpu) = (None, None);
        for n in ROW_COUNTS {
            let (xs, outs) = (&x[..n * dim], &mut out[..n * dim]);
            let (median, min) = times(&m, xs, n, outs, &pool, Duration::from_millis(400));
            let secs = min.as_secs_f64();
            let base = *one_row.get_or_insert(secs);
            let cpu = cpu_time_one_thread(&m, xs, n, outs, Duration::from_millis(300));
            let cpu_cols = match cpu.map(|t| t.as_secs_f64()) {
                Some(c) => {
                    let base_cpu = *one_row_cpu.get_or_insert(c);
                    let gbs = data.len() as f64 / c / 1e9;
                    format!("{:.3} | {gbs:.2} | {:.2}", c * 1e3, c / base_cpu)
                }
                None => "n/a | n/a | n/a".to_string(),
            };
            table.push(format!(
                "| {ty} | {n} | {:.3} | {:.3} | {:.2} | {:.2} | {:.2} | {cpu_cols} |",
                median.as_secs_f64() * 1e3,
                secs * 1e3,
                data.len() as f64 / secs / 1e9,
                2.0 * (dim * dim * n) as f64 / secs / 1e9,
                secs / base
            ));
        }
    }
    criterion.final_summary();
    println!(
        "\nSummary: {dim}x{dim} weights, {threads} threads, SIMD level {}",
        simd_level()
    );
    println!("Wall-time columns ({threads} threads): GB/s, GFLOP/s and the ratio use the minimum.");
    println!(
        "CPU columns: calling thread's CPU time on a 1-thread pool (minimum), its GB/s and ratio."
    );
    println!(
        "| type | rows | ms median | ms min | weight GB/s | GFLOP/s | time / 1-row | 1-thread CPU ms | 1-thread GB/s | CPU / 1-row |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for line in table {
        println!("{line}");
    }
}
