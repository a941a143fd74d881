//! The migration engine: the store's workers take the most urgent tensor from the priority
//! queues and run the head request of its queue ([`Inner::run_one`]).

use std::sync::Arc;

use super::commit::Update;
use super::{
    Active, Destination, Done, Entry, Inner, OffloadOutcome, Request, RequestKind, TensorKey,
};
use crate::tier::TensorMem;
use crate::{Error, Result};

pub(super) enum Outcome {
    Offload(Result<OffloadOutcome>),
    Prefetch(Result<TensorMem>),
    Free(Result<()>),
    Discard,
}

impl Inner {
    pub(super) fn enqueue(&self, id: TensorKey, entry: &mut Entry, op: Request) {
        let priority = op.priority;
        entry.queue.push_back(op);
        if entry.active == Active::Idle {
            entry.active = Active::Dispatched;
            self.queues.push(priority, id.get());
        }
    }

    pub(super) fn worker(self: Arc<Self>) {
        while let Some(id) = self.queues.pop() {
            self.run_one(TensorKey(id));
        }
    }

    /// Run the head operation of tensor `id`, if it is dispatched.
    fn run_one(&self, id: TensorKey) {
        let (kind, priority, enqueued, ssd, host, held, no_copy) = {
            let mut table = self.table.lock();
            let Some(entry) = table.get_mut(&id) else { return };
            if entry.active != Active::Dispatched {
                return; // stale token
            }
            let Some(op) = entry.queue.front_mut() else {
                entry.active = Active::Idle;
                return;
            };
            entry.active = Active::Running;
            let kind = std::mem::replace(&mut op.kind, RequestKind::Free);
            // Put a marker back so location() still says what runs.
            op.kind = match &kind {
                RequestKind::Offload { destination, .. } => RequestKind::Offload {
                    src: None,
                    destination: *destination,
                    name: None,
                    after: None,
                    queued: false,
                },
                RequestKind::Prefetch { .. } => RequestKind::Prefetch { dst: None, after: None },
                RequestKind::Free => RequestKind::Free,
                RequestKind::Discard => RequestKind::Discard,
            };
            let (priority, enqueued) = (op.priority, op.enqueued);
            let (ssd, host, held) = match &kind {
                // A prefetch reads from whatever copy exists; take the memory copies out of the
                // table while the worker uses them (they go back unless consumed).
                // (An SSD copy older than the newest version is never read.)
                RequestKind::Prefetch { .. } => {
                    (entry.readable_ssd().cloned(), entry.host.take(), entry.held.take())
                }
                RequestKind::Free | RequestKind::Discard => {
                    (entry.ssd.take(), entry.host.take(), entry.held.take())
                }
                RequestKind::Offload { .. } => (None, None, entry.held.take()),
            };
            // What a prefetch that finds nothing says (the entry knows why).
            let no_copy = match &kind {
                RequestKind::Prefetch { .. }
                    if ssd.is_none() && host.is_none() && held.is_none() =>
                {
                    Some(entry.no_copy_detail())
                }
                _ => None,
            };
            (kind, priority, enqueued, ssd, host, held, no_copy)
        };
        self.stats.lock().queue_wait[priority as usize].record(enqueued.elapsed());
        let (outcome, update) = match kind {
            RequestKind::Offload { src, destination, name, after, queued } => {
                drop(held); // a newer version replaces the memory of a failed offload
                let src = src.expect("a dispatched offload owns its source");
                // The entry's size is that of the newest offload issued; this one has its own.
                let size = src.len();
                let on_device = queued
                    && destination == Destination::Host
                    && self.persist.is_none()
                    && src.device().is_some();
                match (on_device, after) {
                    (true, after) => self.run_offload_queued(id, size, src, name, after),
                    // The caller's queued work on the tensor finishes before it is read.
                    (false, after) => match after.map_or(Ok(()), |f| f.wait()) {
                        Ok(()) => self.run_offload(id, size, src, destination, name),
                        Err(e) => (Outcome::Offload(Err(e)), Update::Held(src)),
                    },
                }
            }
            RequestKind::Prefetch { dst, after } => {
                let mut dst = dst.expect("a dispatched prefetch owns its destination");
                // Device memory: what is copied into it waits for the caller's queued work on the
                // device (its ready fence), not in this worker.
                let after = match (after, &mut dst) {
                    (Some(f), TensorMem::Device(d)) if d.ready().is_none() => {
                        d.set_ready(Some(f));
                        None
                    }
                    (after, _) => after,
                };
                match after.map_or(Ok(()), |f| f.wait()) {
                    Ok(()) => match no_copy {
                        Some(detail) => {
                            let e = Error::InvalidState { tensor: id.to_string(), detail };
                            (Outcome::Prefetch(Err(e)), Update::None)
                        }
                        None => self.run_prefetch(id, dst, ssd, host, held),
                    },
                    Err(e) => (Outcome::Prefetch(Err(e)), Update::Restore { host, held }),
                }
            }
            RequestKind::Free => self.run_free(ssd, host, held),
            RequestKind::Discard => {
                drop((host, held));
                (Outcome::Discard, Update::Discarded(ssd))
            }
        };
        let (outcome, update, gate) = self.commit(id, outcome, update);
        // Apply the result to the table and dispatch the tensor's next operation.
        let (done, release) = {
            let mut table = self.table.lock();
            let entry = table.get_mut(&id).expect("an entry with a running op stays in the table");
            let release = update.apply(self, entry);
            let op = entry.queue.pop_front().expect("the running op is at the head");
            if let Some(next) = entry.queue.front() {
                entry.active = Active::Dispatched;
                self.queues.push(next.priority, id.get());
            } else {
                entry.active = Active::Idle;
                if !entry.has_copy() && matches!(outcome, Outcome::Free(Ok(()))) {
                    table.remove(&id);
                }
            }
            (op.done, release)
        };
        drop(gate);
        self.queued.release(1);
        let mut release = release;
        match (done, outcome) {
            (Done::Offload(s), Outcome::Offload(r)) => {
                // The source memory goes back before the handle completes: a waiter that sees
                // the offload done sees its memory released too (the tier's budget included).
                drop(release.take());
                s.complete(r)
            }
            (Done::OffloadKeep(s), Outcome::Offload(r)) => {
                let src = release.take();
                s.complete(r.map(|o| (o, src.expect("a stored offload hands back its source"))))
            }
            (Done::Prefetch(s), Outcome::Prefetch(r)) => s.complete(r),
            (Done::Free(s), Outcome::Free(r)) => s.complete(r),
            (Done::Discard, Outcome::Discard) => {}
            _ => unreachable!("an op's outcome matches its kind"),
        }
        // The rest (a prefetch's volatile copy, a freed tensor's memory) is released only now:
        // after the write and its journal record are durable and the table names the new copy.
        drop(release);
    }
}
