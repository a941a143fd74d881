//! The queues of the store's migration engine and what goes with them: priorities, completion
//! handles, the priority queues that feed worker threads, the in-flight byte budget, and
//! statistics. The migration engine itself (the workers running each tensor's requests) is
//! the store's (`store::Inner::run_one`).
//!
//! The tensor store ([`crate::store`]) keeps one ordered queue of operations per tensor; only the
//! head of a tensor's queue may run, so operations on one tensor apply in issue order. When a
//! tensor has work, its id is sent to the priority channel of its head operation; workers always
//! take urgent work first, then normal, then background.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, select};
use parking_lot::{Condvar, Mutex};
use serde::Serialize;

use crate::Result;

/// How soon an operation must finish.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Default)]
pub enum Priority {
    /// Must finish before the next kernel: runs before everything else.
    Urgent = 0,
    /// Planned ahead of need.
    #[default]
    Normal = 1,
    /// Opportunistic work (e.g. checkpoints of cold tensors).
    Background = 2,
}

impl Priority {
    /// All priorities, most urgent first.
    pub const ALL: [Priority; 3] = [Priority::Urgent, Priority::Normal, Priority::Background];
}

/// A one-shot slot a worker fills and a [`Handle`] waits on.
pub(crate) struct Slot<T> {
    value: Mutex<Option<Result<T>>>,
    ready: Condvar,
    done: AtomicBool,
}

impl<T> Slot<T> {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            value: Mutex::new(None),
            ready: Condvar::new(),
            done: AtomicBool::new(false),
        })
    }

    /// Fill the slot. A slot is filled exactly once.
    pub(crate) fn complete(&self, value: Result<T>) {
        let mut v = self.value.lock();
        debug_assert!(v.is_none(), "a slot is completed once");
        *v = Some(value);
        self.done.store(true, Ordering::Release);
        self.ready.notify_all();
    }
}

/// A handle on an asynchronous store operation: wait on it or poll it.
///
/// Dropping a handle does not cancel the operation; it still runs to completion and its
/// resources are released by the engine.
#[must_use = "an operation's result (and errors) arrive through its handle"]
pub struct Handle<T> {
    slot: Arc<Slot<T>>,
}

impl<T> std::fmt::Debug for Handle<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle").field("done", &self.is_done()).finish()
    }
}

impl<T> Handle<T> {
    pub(crate) fn new(slot: Arc<Slot<T>>) -> Self {
        Self { slot }
    }

    /// A handle that is already complete.
    pub(crate) fn ready(value: Result<T>) -> Self {
        let slot = Slot::new();
        slot.complete(value);
        Self { slot }
    }

    /// Whether the operation has finished (successfully or not).
    pub fn is_done(&self) -> bool {
        self.slot.done.load(Ordering::Acquire)
    }

    /// Block until the operation finishes and return its result.
    pub fn wait(self) -> Result<T> {
        let mut v = self.slot.value.lock();
        while v.is_none() {
            self.slot.ready.wait(&mut v);
        }
        v.take().expect("checked above")
    }

    /// Look at the result without taking it (`None` while the operation runs).
    pub fn peek<R>(&self, f: impl FnOnce(Option<&Result<T>>) -> R) -> R {
        f(self.slot.value.lock().as_ref())
    }

    /// Wait at most `timeout`; gives the handle back if the operation is still running. A
    /// timeout that reaches beyond the clock's range (`Instant` + `timeout` overflows, e.g.
    /// 2^63 seconds) waits without a limit.
    pub fn wait_timeout(self, timeout: Duration) -> std::result::Result<Result<T>, Self> {
        let Some(deadline) = Instant::now().checked_add(timeout) else {
            return Ok(self.wait());
        };
        {
            let mut v = self.slot.value.lock();
            while v.is_none() {
                if self.slot.ready.wait_until(&mut v, deadline).timed_out() {
                    break;
                }
            }
            if let Some(r) = v.take() {
                return Ok(r);
            }
        }
        Err(self)
    }
}

/// Priority channels carrying "this tensor has runnable work" tokens.
///
/// Tokens are idempotent hints: a worker that receives one checks the tensor's state, so a stale
/// or duplicated token does nothing. The number of tokens is bounded by the store's bound on
/// queued operations (at most two per queued operation).
pub(crate) struct Queues {
    tx: [Sender<u64>; 3],
    rx: [Receiver<u64>; 3],
    shutdown_tx: Mutex<Option<Sender<()>>>,
    shutdown_rx: Receiver<()>,
}

impl Queues {
    pub(crate) fn new() -> Self {
        let (t0, r0) = crossbeam_channel::unbounded();
        let (t1, r1) = crossbeam_channel::unbounded();
        let (t2, r2) = crossbeam_channel::unbounded();
        let (shutdown_tx, shutdown_rx) = crossbeam_channel::bounded(0);
        Self {
            tx: [t0, t1, t2],
            rx: [r0, r1, r2],
            shutdown_tx: Mutex::new(Some(shutdown_tx)),
            shutdown_rx,
        }
    }

    pub(crate) fn push(&self, priority: Priority, tensor: u64) {
        // The receivers live as long as `self`, so sending cannot fail.
        let _ = self.tx[priority as usize].send(tensor);
    }

    /// Next token, most urgent first; `None` once shut down.
    pub(crate) fn pop(&self) -> Option<u64> {
        loop {
            for rx in &self.rx {
                if let Ok(t) = rx.try_recv() {
                    return Some(t);
                }
            }
            select! {
                recv(self.rx[0]) -> t => return t.ok(),
                recv(self.rx[1]) -> t => { if let Ok(t) = t { self.push(Priority::Normal, t); } },
                recv(self.rx[2]) -> t => { if let Ok(t) = t { self.push(Priority::Background, t); } },
                recv(self.shutdown_rx) -> _ => return None,
            }
            // A lower-priority token woke us: loop to take the most urgent one available.
        }
    }

    /// Wake every worker blocked in `pop` and make them return `None`.
    pub(crate) fn shutdown(&self) {
        // Dropping the only sender disconnects the channel: every `recv` on it returns at once.
        self.shutdown_tx.lock().take();
    }
}

/// A counting budget of bytes (in flight, or queued), with blocking acquire.
pub(crate) struct Budget {
    max: u64,
    used: Mutex<u64>,
    freed: Condvar,
}

impl Budget {
    pub(crate) fn new(max: u64) -> Self {
        Self { max: max.max(1), used: Mutex::new(0), freed: Condvar::new() }
    }

    /// Take `n` units, waiting while the budget is exhausted. A request larger than the whole
    /// budget waits until nothing else is held and then proceeds alone.
    pub(crate) fn acquire(&self, n: u64) -> u64 {
        let n = n.min(self.max);
        let mut used = self.used.lock();
        while *used + n > self.max {
            self.freed.wait(&mut used);
        }
        *used += n;
        n
    }

    pub(crate) fn release(&self, n: u64) {
        let mut used = self.used.lock();
        debug_assert!(*used >= n);
        *used -= n;
        self.freed.notify_all();
    }
}
