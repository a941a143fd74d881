//! The optimizer's worker threads: started once, on the first step that splits a tensor, and
//! parked (blocked on a channel) between steps.
//!
//! A step over one tensor cuts it into blocks that several threads take. Starting those threads for every
//! call (`std::thread::scope`) costs a thread creation each (a stack mapped, a clone, the first
//! schedule): tens of microseconds, paid by every parameter of every step, which for a model of
//! a few hundred tensors stepped on 16 threads adds up to milliseconds a step on the critical
//! path. Here the jobs go to threads that already exist; the caller runs one itself and
//! returns only when every job is done, so the jobs may borrow the caller's buffers (as
//! `std::thread::scope`'s threads do).
//!
//! Any number of callers may step at once (each waits for its own chunks only); a panic in a
//! chunk is caught on the worker and raised again on the caller once every chunk is done.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use crossbeam_channel::{Sender, unbounded};

type Job = Box<dyn FnOnce() + Send + 'static>;

/// The started workers: where jobs go, and how many threads take them (0: none could start).
struct Workers {
    jobs: Sender<Job>,
    threads: usize,
}

fn workers() -> &'static Workers {
    static WORKERS: OnceLock<Workers> = OnceLock::new();
    WORKERS.get_or_init(|| {
        let (jobs, take) = unbounded::<Job>();
        let mut threads = 0;
        for i in 0..super::default_threads().saturating_sub(1) {
            let take = take.clone();
            let started =
                std::thread::Builder::new().name(format!("teraio-optim-{i}")).spawn(move || {
                    for job in take {
                        job();
                    }
                });
            // A thread that cannot start leaves fewer workers; with none, chunks run on the
            // caller's thread one after another (slower, still correct).
            if started.is_ok() {
                threads += 1;
            }
        }
        Workers { jobs, threads }
    })
}

/// Chunks of one call still running, and the first panic among them.
struct Latch {
    state: Mutex<(usize, Option<Box<dyn Any + Send>>)>,
    done: Condvar,
}

impl Latch {
    fn finish(&self, panic: Option<Box<dyn Any + Send>>) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.0 -= 1;
        if s.1.is_none() {
            s.1 = panic;
        }
        if s.0 == 0 {
            self.done.notify_all();
        }
    }

    /// Block until every chunk has finished; the first panic among them, if any.
    fn wait(&self) -> Option<Box<dyn Any + Send>> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while s.0 > 0 {
            s = self.done.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.1.take()
    }
}

/// Run every job of `jobs` on the workers and `last` on this thread; return when all are done
/// (raising the first panic of any of them).
pub(super) fn scope<'a>(jobs: Vec<Box<dyn FnOnce() + Send + 'a>>, last: impl FnOnce()) {
    let w = workers();
    if w.threads == 0 {
        for job in jobs {
            job();
        }
        return last();
    }
    let latch = Arc::new(Latch { state: Mutex::new((jobs.len(), None)), done: Condvar::new() });
    for job in jobs {
        // SAFETY: the job borrows data that lives for 'a, at least until this function returns;
        // this function returns (or unwinds) only after `latch.wait()` below has seen every job
        // finish (jobs never unwind past `catch_unwind`, and `finish` runs after the job is
        // dropped), so no job outlives what it borrows. The lifetime is only erased to pass it
        // through the channel.
        let job: Job = unsafe {
            std::mem::transmute::<Box<dyn FnOnce() + Send + 'a>, Box<dyn FnOnce() + Send + 'static>>(
                job,
            )
        };
        let latch = Arc::clone(&latch);
        let wrapped: Job = Box::new(move || {
            let panic = catch_unwind(AssertUnwindSafe(job)).err();
            latch.finish(panic);
        });
        if let Err(e) = w.jobs.send(wrapped) {
            // The workers' channel never closes (its receivers live for the process), but if it
            // did, run the job here rather than wait for it forever.
            (e.into_inner())();
        }
    }
    let mine = catch_unwind(AssertUnwindSafe(last)).err();
    let theirs = latch.wait();
    if let Some(p) = mine.or(theirs) {
        resume_unwind(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_job_runs_before_scope_returns_and_may_borrow() {
        let mut out = vec![0usize; 64];
        let (head, tail) = out.split_at_mut(48);
        let jobs: Vec<Box<dyn FnOnce() + Send + '_>> = head
            .chunks_mut(16)
            .enumerate()
            .map(|(i, c)| {
                Box::new(move || {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                    c.fill(i + 1);
                }) as Box<dyn FnOnce() + Send + '_>
            })
            .collect();
        scope(jobs, || tail.fill(9));
        assert_eq!(&out[..16], &[1; 16]);
        assert_eq!(&out[16..32], &[2; 16]);
        assert_eq!(&out[32..48], &[3; 16]);
        assert_eq!(&out[48..], &[9; 16]);
    }

    #[test]
    fn a_panicking_job_is_raised_on_the_caller_after_the_others_finish() {
        let finished = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            let jobs: Vec<Box<dyn FnOnce() + Send + '_>> = vec![
                Box::new(|| panic!("chunk failed")),
                Box::new(|| {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    finished.fetch_add(1, Ordering::SeqCst);
                }),
            ];
            scope(jobs, || {
                finished.fetch_add(1, Ordering::SeqCst);
            });
        }));
        let msg = r.expect_err("the panic reaches the caller");
        assert_eq!(msg.downcast_ref::<&str>(), Some(&"chunk failed"));
        assert_eq!(finished.load(Ordering::SeqCst), 2, "the other chunks ran to the end first");
    }

    #[test]
    fn callers_on_several_threads_each_get_their_own_chunks() {
        std::thread::scope(|s| {
            for t in 0..4usize {
                s.spawn(move || {
                    for round in 0..50usize {
                        let mut v = vec![0usize; 40];
                        let (a, b) = v.split_at_mut(20);
                        let jobs: Vec<Box<dyn FnOnce() + Send + '_>> = a
                            .chunks_mut(5)
                            .map(|c| {
                                Box::new(move || c.fill(t * 1000 + round))
                                    as Box<dyn FnOnce() + Send + '_>
                            })
                            .collect();
                        scope(jobs, || b.fill(t * 1000 + round));
                        assert!(v.iter().all(|&x| x == t * 1000 + round));
                    }
                });
            }
        });
    }
}
