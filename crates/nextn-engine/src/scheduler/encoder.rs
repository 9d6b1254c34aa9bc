//! The image encoder: the vision tower on a thread of its own, beside the generation loop.
//!
//! Encoding a picture takes seconds to tens of seconds on a CPU (about 27 s for 1024x768 with
//! the Qwen3.5 tower on two cores), so it does not run inside a step: at admission a request's
//! images go to this thread, the request's slot goes on with the prompt up to its first image and
//! then waits, out of the steps, while the other slots keep decoding; the embeddings come back
//! through the scheduler's inbox (waking the loop), and the image then runs through the target as
//! any prompt chunk does. Images are encoded one at a time, in the order they were handed over.
//!
//! Threads: the encoder has its own pool. With one slot nothing else can be decoding while a
//! request waits for its picture, so the encoder takes as many threads as the inference pool;
//! with several it takes half of them (at least one), so that both pools together ask for at
//! most one and a half times the threads given (`-t`) and a decode step keeps most of the cores
//! it had while a picture is being encoded, rather than both pools spinning on every core. A
//! tower on the device takes one thread: the host only records its blocks and waits for them.
//!
//! A request that goes away (its client disconnected, it failed, the server shut down) drops its
//! [`EncodeTicket`], which cancels its encodes: one not started is skipped, one running stops
//! after the tower's current block ([`VisionTower::encode_cancellable`]).

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use nextn_quant::kernels::ThreadPool;
use nextn_vision::{ImageEmbedding, PreparedImage, VisionError, VisionTower};

use super::{lock, Shared};

/// Threads of the encoder's pool for a loop of `n_slots` slots whose inference pool has
/// `inference_threads` (see the module's documentation); one for a tower on a device
/// (`on_device`), whose encode only records and waits.
pub(super) fn encoder_threads(on_device: bool, n_slots: usize, inference_threads: usize) -> usize {
    if on_device {
        1
    } else if n_slots <= 1 {
        inference_threads.max(1)
    } else {
        (inference_threads / 2).max(1)
    }
}

/// Which request's which image an encode is for: the slot, the request's admission number (a
/// slot freed and taken again is another request) and the image's index in the prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct EncodeKey {
    pub slot: usize,
    pub seq_no: u64,
    pub image: usize,
}

/// A finished encode, for the loop to pick up.
pub(super) struct Encoded {
    pub key: EncodeKey,
    pub result: Result<ImageEmbedding, String>,
    /// Milliseconds the encode took (the wait in the queue not counted).
    pub ms: f64,
}

/// Held by a request while its images are encoded; dropping it cancels them.
pub(super) struct EncodeTicket {
    cancelled: Arc<AtomicBool>,
}

impl Drop for EncodeTicket {
    fn drop(&mut self) {
        self.cancelled.store(true, Ordering::Release);
    }
}

struct Job {
    key: EncodeKey,
    image: Arc<PreparedImage>,
    cancelled: Arc<AtomicBool>,
}

struct Queue {
    jobs: Mutex<VecDeque<Job>>,
    /// Signalled when a job is queued or the encoder shuts down.
    ready: Condvar,
    shutdown: AtomicBool,
}

/// The encoder thread and its queue; dropping it cancels what is queued or running and waits
/// for the thread to end.
pub(super) struct ImageEncoder {
    queue: Arc<Queue>,
    thread: Option<JoinHandle<()>>,
}

impl ImageEncoder {
    /// Starts the thread; `shared` is the loop's, whose inbox receives the results.
    pub fn spawn(
        tower: Arc<VisionTower>,
        threads: usize,
        shared: Arc<Shared>,
    ) -> std::io::Result<ImageEncoder> {
        let queue = Arc::new(Queue {
            jobs: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        let q = queue.clone();
        let thread = std::thread::Builder::new()
            .name("nextn-image-encoder".into())
            .spawn(move || encoder_loop(&tower, threads, &q, &shared))?;
        Ok(ImageEncoder {
            queue,
            thread: Some(thread),
        })
    }

    /// Queues the images of one request (`(index, image)` pairs) and returns the ticket whose
    /// drop cancels them.
    pub fn submit(
        &self,
        slot: usize,
        seq_no: u64,
        images: impl IntoIterator<Item = (usize, Arc<PreparedImage>)>,
    ) -> EncodeTicket {
        let cancelled = Arc::new(AtomicBool::new(false));
        let mut jobs = lock(&self.queue.jobs);
        for (image, prepared) in images {
            jobs.push_back(Job {
                key: EncodeKey {
                    slot,
                    seq_no,
                    image,
                },
                image: prepared,
                cancelled: cancelled.clone(),
            });
        }
        drop(jobs);
        self.queue.ready.notify_one();
        EncodeTicket { cancelled }
    }
}

impl Drop for ImageEncoder {
    fn drop(&mut self) {
        self.queue.shutdown.store(true, Ordering::Release);
        {
            // Under the lock: the thread is either waiting (and gets the notification) or will
            // see the flag before it waits.
            let _jobs = lock(&self.queue.jobs);
            self.queue.ready.notify_all();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn encoder_loop(tower: &VisionTower, threads: usize, queue: &Queue, shared: &Shared) {
    let pool = ThreadPool::new(threads);
    loop {
        let job = {
            let mut jobs = lock(&queue.jobs);
            loop {
                if queue.shutdown.load(Ordering::Acquire) {
                    return;
                }
                if let Some(job) = jobs.pop_front() {
                    break job;
                }
                jobs = queue.ready.wait(jobs).unwrap_or_else(|e| e.into_inner());
            }
        };
        let stop =
            || job.cancelled.load(Ordering::Acquire) || queue.shutdown.load(Ordering::Acquire);
        let t = Instant::now();
        let outcome = (!stop()).then(|| {
            catch_unwind(AssertUnwindSafe(|| {
                tower.encode_cancellable(&job.image, &pool, &stop)
            }))
        });
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let image = job.key.image;
        let result = match outcome {
            None | Some(Ok(Err(VisionError::EncodeCancelled))) => {
                // Nobody waits for it: counted, not delivered.
                lock(&shared.metrics).image_encodes_cancelled_total += 1;
                continue;
            }
            Some(Ok(Ok(emb))) => {
                let mut m = lock(&shared.metrics);
                m.images_encoded_total += 1;
                m.image_encode_seconds_total += ms / 1000.0;
                Ok(emb)
            }
            Some(Ok(Err(e))) => Err(format!("encoding image {image}: {e}")),
            Some(Err(_)) => Err(format!(
                "encoding image {image}: internal error (panic in the vision tower)"
            )),
        };
        let mut inbox = lock(&shared.inbox);
        inbox.encoded.push(Encoded {
            key: job.key,
            result,
            ms,
        });
        drop(inbox);
        shared.wake.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_slot_takes_every_thread_several_take_half() {
        assert_eq!(encoder_threads(false, 1, 8), 8);
        assert_eq!(encoder_threads(false, 1, 0), 1);
        assert_eq!(encoder_threads(false, 4, 8), 4);
        assert_eq!(encoder_threads(false, 2, 2), 1);
        assert_eq!(encoder_threads(false, 2, 1), 1);
    }

    #[test]
    fn a_tower_on_the_device_takes_one_thread() {
        assert_eq!(encoder_threads(true, 1, 8), 1);
        assert_eq!(encoder_threads(true, 4, 16), 1);
    }
}
