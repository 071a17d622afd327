//! Background worker threads of a node (retraining, resizing, eviction).
//!
//! Inside a simulation (`--transport sim`) the pool has no OS threads: its
//! workers are simulated cores of the node, jobs run on them in virtual time
//! and are charged by the simulator's cost model.

use crossbeam_channel::{Receiver, Sender};
use dmkv_transport::sim::SimCores;
use dmkv_transport::thread_cpu_ns;
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Poll, Waker};
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Counts {
    cpu_ns: AtomicU64,
    done: AtomicU64,
    /// Jobs submitted and not yet finished.
    pending: Mutex<u64>,
    idle: Condvar,
    /// Tasks waiting for the pool to drain (simulated pools).
    sim_waiters: Mutex<Vec<Waker>>,
}

/// A fixed set of threads running submitted jobs in FIFO order, with the
/// CPU time of every job accounted. Dropping the pool finishes queued jobs
/// and joins the threads.
pub struct WorkerPool {
    sim: Option<SimCores>,
    workers: usize,
    tx: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
    counts: Arc<Counts>,
}

impl WorkerPool {
    pub fn new(name: &str, threads: usize) -> WorkerPool {
        if let Some(cores) = SimCores::new(&format!("{name} worker cores"), threads.max(1)) {
            return WorkerPool {
                sim: Some(cores),
                workers: threads.max(1),
                tx: None,
                threads: Vec::new(),
                counts: Arc::new(Counts::default()),
            };
        }
        let (tx, rx): (Sender<Job>, Receiver<Job>) = crossbeam_channel::unbounded();
        let counts = Arc::new(Counts::default());
        let threads: Vec<JoinHandle<()>> = (0..threads.max(1))
            .map(|i| {
                let rx = rx.clone();
                let counts = counts.clone();
                // The runtime's own worker threads (real backends only).
                #[allow(clippy::disallowed_methods)]
                std::thread::Builder::new()
                    .name(format!("{name}-w{i}"))
                    .spawn(move || {
                        while let Ok(job) = rx.recv() {
                            let start = thread_cpu_ns();
                            // A panicking job must not take the worker down
                            // or leave `pending` stuck.
                            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                            counts.cpu_ns.fetch_add(
                                thread_cpu_ns().saturating_sub(start),
                                Ordering::Relaxed,
                            );
                            counts.done.fetch_add(1, Ordering::Relaxed);
                            let mut p = counts.pending.lock();
                            *p -= 1;
                            if *p == 0 {
                                counts.idle.notify_all();
                            }
                        }
                    })
                    .expect("spawn a worker thread")
            })
            .collect();
        WorkerPool {
            sim: None,
            workers: threads.len(),
            tx: Some(tx),
            threads,
            counts,
        }
    }

    /// Queues `job`.
    pub fn submit(&self, job: impl FnOnce() + Send + 'static) {
        *self.counts.pending.lock() += 1;
        if let Some(cores) = &self.sim {
            let counts = self.counts.clone();
            cores.submit(
                Box::new(move || {
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }),
                Box::new(move |cpu| {
                    counts.cpu_ns.fetch_add(cpu, Ordering::Relaxed);
                    counts.done.fetch_add(1, Ordering::Relaxed);
                    let mut p = counts.pending.lock();
                    *p -= 1;
                    if *p == 0 {
                        for w in counts.sim_waiters.lock().drain(..) {
                            w.wake();
                        }
                    }
                }),
            );
            return;
        }
        self.tx
            .as_ref()
            .expect("pool is running")
            .send(Box::new(job))
            .expect("workers are running");
    }

    /// Waits until every submitted job has finished.
    pub fn wait_idle(&self) {
        if self.sim.is_some() {
            let counts = self.counts.clone();
            dmkv_transport::exec::block_on(std::future::poll_fn(move |cx| {
                if *counts.pending.lock() == 0 {
                    Poll::Ready(())
                } else {
                    counts.sim_waiters.lock().push(cx.waker().clone());
                    Poll::Pending
                }
            }));
            return;
        }
        let mut p = self.counts.pending.lock();
        while *p > 0 {
            self.counts.idle.wait(&mut p);
        }
    }

    /// Jobs queued or running.
    pub fn pending(&self) -> u64 {
        *self.counts.pending.lock()
    }

    /// CPU time spent in jobs so far.
    pub fn cpu_ns(&self) -> u64 {
        self.counts.cpu_ns.load(Ordering::Relaxed)
    }

    pub fn jobs_done(&self) -> u64 {
        self.counts.done.load(Ordering::Relaxed)
    }

    pub fn threads(&self) -> usize {
        self.workers
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        drop(self.tx.take());
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_jobs_and_accounts_cpu() {
        let pool = WorkerPool::new("t", 2);
        let sum = Arc::new(AtomicU64::new(0));
        for i in 0..100 {
            let s = sum.clone();
            pool.submit(move || {
                let mut x = 0u64;
                for j in 0..10_000u64 {
                    x = x.wrapping_add(j * i);
                }
                std::hint::black_box(x);
                s.fetch_add(i, Ordering::Relaxed);
            });
        }
        pool.wait_idle();
        assert_eq!(sum.load(Ordering::Relaxed), (0..100).sum::<u64>());
        assert_eq!(pool.jobs_done(), 100);
        assert_eq!(pool.pending(), 0);
        assert!(pool.cpu_ns() > 0);
    }

    #[test]
    fn a_panicking_job_does_not_stop_the_pool() {
        let pool = WorkerPool::new("t", 1);
        pool.submit(|| panic!("job failed"));
        let ok = Arc::new(AtomicU64::new(0));
        let o = ok.clone();
        pool.submit(move || {
            o.store(1, Ordering::Relaxed);
        });
        pool.wait_idle();
        assert_eq!(ok.load(Ordering::Relaxed), 1);
    }
}
