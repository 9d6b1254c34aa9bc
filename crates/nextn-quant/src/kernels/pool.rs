//! A persistent thread pool for the matrix kernels.
//!
//! Decoding one token runs hundreds of matrix products a few microseconds to a millisecond
//! each, so waking threads must cost microseconds: workers spin on a generation counter for
//! a short while after each job and only then park on a condition variable.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
const SPIN_BEFORE_PARK: Duration = Duration::from_micros(100);

type Job = dyn Fn(usize, usize) + Sync;

struct Shared {
    /// Bumped once per job (and once at shutdown); workers run each generation once.
    generation: AtomicU64,
    /// The current job. Written only by the dispatching thread while no worker is inside
    /// a job (all have decremented `remaining`), read by workers after they observe the
    /// generation bump that published it.
    job: UnsafeCell<Option<*const Job>>,
    n_tasks: AtomicUsize,
    next_task: AtomicUsize,
    /// Workers that have not yet finished the current generation.
    remaining: AtomicUsize,
    /// Workers parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
    worker_panicked: AtomicBool,
}

// SAFETY: `job` is only accessed under the generation/remaining protocol described above.
unsafe impl Sync for Shared {}
// SAFETY: as for `Sync`: the job pointer is only dereferenced under that protocol, while the
// dispatcher keeps the job alive; every other field is `Send`.
unsafe impl Send for Shared {}

/// Persistent worker threads; `run` hands them numbered tasks.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Held while a job is being dispatched; a concurrent or nested `run` finds it taken
    /// and runs its tasks on the calling thread instead.
    dispatch: Mutex<()>,
}

impl ThreadPool {
    /// A pool of `n_threads` threads in all, counting the thread that calls `run`
    /// (so `n_threads - 1` workers are spawned; 0 is treated as 1). If the OS refuses to
    /// start a thread, the pool works with the ones it has.
    pub fn new(n_threads: usize) -> Self {
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            n_tasks: AtomicUsize::new(0),
            next_task: AtomicUsize::new(0),
            remaining: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
            worker_panicked: AtomicBool::new(false),
        });
        let mut workers = Vec::new();
        for i in 1..n_threads.max(1) {
            let s = Arc::clone(&shared);
            match std::thread::Builder::new()
                .name(format!("nextn-pool-{i}"))
                .spawn(move || worker_loop(&s))
            {
                Ok(handle) => workers.push(handle),
                Err(_) => break,
            }
        }
        ThreadPool {
            shared,
            workers,
            dispatch: Mutex::new(()),
        }
    }

    /// Threads that execute tasks, the caller of `run` included.
    pub fn n_threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Call `f(task, n_tasks)` once for every `task` in `0..n_tasks`, spread over the pool;
    /// the calling thread takes tasks too. Returns when all have finished. Which thread
    /// runs which task is not fixed. A panic in a task is re-raised here after every task
    /// has finished.
    pub fn run<F: Fn(usize, usize) + Sync>(&self, n_tasks: usize, f: F) {
        if n_tasks == 0 {
            return;
        }
        if self.workers.is_empty() || n_tasks == 1 {
            for t in 0..n_tasks {
                f(t, n_tasks);
            }
            return;
        }
        let Ok(_dispatching) = self.dispatch.try_lock() else {
            // Another job is in flight (a nested call from inside a task, or another
            // thread sharing the pool): do this one here rather than wait or deadlock.
            for t in 0..n_tasks {
                f(t, n_tasks);
            }
            return;
        };
        let sh = &*self.shared;
        let job: &(dyn Fn(usize, usize) + Sync) = &f;
        // SAFETY: the lifetime is erased only for the duration of this call: we do not
        // return before every worker has finished this generation, after which none reads
        // the pointer again, and we clear it below.
        let job: &'static Job =
            unsafe { std::mem::transmute::<&(dyn Fn(usize, usize) + Sync), &'static Job>(job) };
        // SAFETY: no worker is inside a job (the last `run` waited for `remaining` to reach 0,
        // and the `dispatch` lock keeps other dispatchers out), and the generation bump below
        // publishes the write before any worker reads it.
        unsafe { *sh.job.get() = Some(job as *const Job) };
        sh.n_tasks.store(n_tasks, Ordering::Relaxed);
        sh.next_task.store(0, Ordering::Relaxed);
        sh.remaining.store(self.workers.len(), Ordering::Relaxed);
        sh.generation.fetch_add(1, Ordering::SeqCst);
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.wake.notify_all();
        }

        let own = catch_unwind(AssertUnwindSafe(|| take_tasks(sh, job)));

        let mut spins = 0u32;
        while sh.remaining.load(Ordering::Acquire) != 0 {
            if spins < 1 << 14 {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // SAFETY: every worker has finished this generation (`remaining` is 0), so none reads
        // `job` until the next bump.
        unsafe { *sh.job.get() = None };
        let worker_panicked = sh.worker_panicked.swap(false, Ordering::Relaxed);
        if let Err(payload) = own {
            resume_unwind(payload);
        }
        if worker_panicked {
            panic!("a ThreadPool task panicked on a worker thread");
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        let sh = &*self.shared;
        sh.shutdown.store(true, Ordering::SeqCst);
        sh.generation.fetch_add(1, Ordering::SeqCst);
        {
            let _guard = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("n_threads", &self.n_threads())
            .finish()
    }
}

/// Claim and run tasks until none are left.
fn take_tasks(sh: &Shared, job: &Job) {
    let n = sh.n_tasks.load(Ordering::Relaxed);
    loop {
        let t = sh.next_task.fetch_add(1, Ordering::Relaxed);
        if t >= n {
            break;
        }
        job(t, n);
    }
}

fn worker_loop(sh: &Shared) {
    let mut seen = 0u64;
    loop {
        wait_for_generation(sh, seen);
        if sh.shutdown.load(Ordering::SeqCst) {
            return;
        }
        seen = sh.generation.load(Ordering::Acquire);
        // SAFETY: published before the generation bump we just observed, and kept alive
        // by the dispatcher until we decrement `remaining`.
        let job = unsafe { *sh.job.get() };
        if let Some(job) = job {
            // SAFETY: the dispatcher keeps the job it points at alive until `remaining` reaches
            // 0, which needs this worker's decrement below.
            let job: &Job = unsafe { &*job };
            if catch_unwind(AssertUnwindSafe(|| take_tasks(sh, job))).is_err() {
                sh.worker_panicked.store(true, Ordering::Relaxed);
            }
        }
        sh.remaining.fetch_sub(1, Ordering::Release);
    }
}

/// Return once the generation differs from `seen` (or shutdown began): spin first, then park.
fn wait_for_generation(sh: &Shared, seen: u64) {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if sh.generation.load(Ordering::Acquire) != seen || sh.shutdown.load(Ordering::Relaxed) {
            return;
        }
        spins = spins.wrapping_add(1);
        std::hint::spin_loop();
        if spins.is_multiple_of(64) && start.elapsed() > SPIN_BEFORE_PARK {
            break;
        }
    }
    let mut guard = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
    sh.sleepers.fetch_add(1, Ordering::SeqCst);
    while sh.generation.load(Ordering::SeqCst) == seen && !sh.shutdown.load(Ordering::SeqCst) {
        guard = sh.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
    }
    sh.sleepers.fetch_sub(1, Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_exactly_once() {
        for threads in 1..=4 {
            let pool = ThreadPool::new(threads);
            assert_eq!(pool.n_threads(), threads);
            for n in [0usize, 1, 2, 3, 17, 100] {
                let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                pool.run(n, |t, total| {
                    assert_eq!(total, n);
                    hits[t].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn workers_wake_after_parking() {
        let pool = ThreadPool::new(3);
        for round in 0..3 {
            std::thread::sleep(Duration::from_millis(5)); // long enough for workers to park
            let sum = AtomicUsize::new(0);
            pool.run(64, |t, _| {
                sum.fetch_add(t, Ordering::Relaxed);
            });
            assert_eq!(sum.load(Ordering::Relaxed), 63 * 64 / 2, "round {round}");
        }
    }

    #[test]
    fn nested_run_executes_inline() {
        let pool = ThreadPool::new(2);
        let count = AtomicUsize::new(0);
        pool.run(4, |_, _| {
            pool.run(3, |_, _| {
                count.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(count.load(Ordering::Relaxed), 12);
    }

    #[test]
    fn task_panic_propagates_and_pool_survives() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(8, |t, _| {
                if t == 5 {
                    panic!("task five");
                }
            })
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(8, |_, _| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn dispatch_is_fast_when_warm() {
        let pool = ThreadPool::new(2);
        let n = 2000;
        let start = Instant::now();
        for _ in 0..n {
            pool.run(2, |_, _| {});
        }
        let per = start.elapsed() / n;
        // Generous bound: a parked-thread wake-up per call would be tens of microseconds
        // at best; spinning workers take well under that.
        eprintln!("pool dispatch: {per:?} per run");
        assert!(per < Duration::from_millis(5), "dispatch took {per:?}");
    }
}
