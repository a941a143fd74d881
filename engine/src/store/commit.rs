//! The version and commit logic: what a finished request changes in its tensor's entry
//! ([`Update`], applied under the table lock), made durable first in persistent mode (a
//! journal record, [`Inner::commit`]), and checkpoints.

use parking_lot::RwLockReadGuard;
use teraio_layout::format::RecordBody;

use super::host_copy::HostCopy;
use super::worker::Outcome;
use super::{Entry, Inner, Persistence, SsdCopy, TensorKey};
use crate::tier::{DeviceFence, TensorMem};
use crate::{Error, Result};

impl Inner {
    /// Persistent mode: make the operation's effect on the tensor table durable (a journal
    /// record) before it is applied. The returned guard is held until the table shows the
    /// change, so a checkpoint never covers a record whose effect it does not contain. A failed
    /// append turns a successful offload into a failure that keeps the source memory, and a
    /// free into a failure that keeps the tensor.
    pub(super) fn commit(
        &self,
        id: TensorKey,
        outcome: Outcome,
        update: Update,
    ) -> (Outcome, Update, Option<RwLockReadGuard<'_, ()>>) {
        let Some(p) = &self.persist else { return (outcome, update, None) };
        let record = match &update {
            Update::Ssd { copy, name, .. } => {
                let name = name
                    .clone()
                    .or_else(|| self.table.lock().get(&id).and_then(|e| e.name.clone()));
                Persistence::put_record(id, name.as_deref(), copy)
            }
            Update::Freed(Some(_)) => RecordBody::DeleteTensor { id: id.get() },
            // No copy of the tensor is known to be durable, so there is nothing to delete;
            // but after a failed metadata write the record of its failed offload may have
            // reached the disk all the same (a journal write that failed at its sync), and a
            // reopen would bring the tensor back: the free cannot be promised then.
            Update::Freed(None) => {
                return match p.writable() {
                    Ok(()) => (outcome, update, None),
                    Err(e) => (Outcome::Free(Err(e)), Update::None, None),
                };
            }
            _ => return (outcome, update, None),
        };
        loop {
            let gate = p.commit_gate();
            match p.append(&self.array, record.clone()) {
                Ok(true) => return (outcome, update, Some(gate)),
                Ok(false) => {
                    drop(gate);
                    if let Err(e) = self.checkpoint() {
                        return self.fail_commit(e, update);
                    }
                }
                Err(e) => {
                    drop(gate);
                    return self.fail_commit(e, update);
                }
            }
        }
    }

    fn fail_commit(
        &self,
        e: Error,
        update: Update,
    ) -> (Outcome, Update, Option<RwLockReadGuard<'_, ()>>) {
        match update {
            Update::Ssd { copy, src, .. } => {
                // The record may have reached the disk although the append failed: free the
                // extents only after the next checkpoint, never now.
                self.release_extents(&copy.map);
                (Outcome::Offload(Err(e)), Update::Held(src), None)
            }
            Update::Freed(Some(copy)) => (Outcome::Free(Err(e)), Update::KeepSsd(copy), None),
            other => unreachable!("only puts and deletes are journaled, not {}", other.name()),
        }
    }

    pub(super) fn checkpoint(&self) -> Result<()> {
        let Some(p) = &self.persist else { return Ok(()) };
        let _exclusive = p.exclusive_gate();
        // A consistent cut of the tensor table: every journaled change is applied.
        let table = self.table.lock();
        let tensors: Vec<_> = table
            .iter()
            .filter_map(|(id, e)| e.ssd.as_ref().map(|c| (*id, e.name.clone(), c.clone())))
            .collect();
        let mut alloc = self.alloc.lock();
        p.write_checkpoint(&self.array, &mut alloc, &tensors)
    }
}

/// What a finished operation changes in its tensor's entry (applied under the table lock).
pub(super) enum Update {
    None,
    /// Offload succeeded to SSD: the new copy replaces any old one; host copy dropped; the
    /// source memory is released after the table shows the copy.
    Ssd {
        copy: SsdCopy,
        name: Option<String>,
        src: TensorMem,
    },
    /// Offload succeeded to the host tier; the source is released after the table update.
    Host {
        mem: TensorMem,
        name: Option<String>,
        src: TensorMem,
        /// The queued copy from device memory that fills `mem`, if it is still on the device.
        written: Option<Box<dyn DeviceFence>>,
    },
    /// Offload failed: the store keeps the source memory.
    Held(TensorMem),
    /// Prefetch done: give back memory copies that were not consumed.
    Restore {
        host: Option<HostCopy>,
        held: Option<TensorMem>,
    },
    /// Free done: the SSD copy (if any) is released.
    Freed(Option<SsdCopy>),
    /// Discard done (volatile stores only, never journaled): the SSD copy (if any) is released.
    Discarded(Option<SsdCopy>),
    /// Free failed: the SSD copy stays.
    KeepSsd(SsdCopy),
    /// A volatile prefetch read the SSD copy: release it.
    ConsumedSsd,
}

impl Update {
    fn name(&self) -> &'static str {
        match self {
            Update::None => "none",
            Update::Ssd { .. } => "ssd",
            Update::Host { .. } => "host",
            Update::Held(_) => "held",
            Update::Restore { .. } => "restore",
            Update::Freed(_) => "freed",
            Update::Discarded(_) => "discarded",
            Update::KeepSsd(_) => "keep-ssd",
            Update::ConsumedSsd => "consumed-ssd",
        }
    }

    /// Apply to `entry`; returns memory to release once the table lock is dropped.
    pub(super) fn apply(self, inner: &Inner, entry: &mut Entry) -> Option<TensorMem> {
        match self {
            Update::None => None,
            Update::Ssd { copy, name, src } => {
                if let Some(old) = entry.ssd.replace(copy) {
                    inner.release_extents(&old.map);
                }
                entry.ssd_superseded = false;
                entry.host = None;
                if name.is_some() {
                    entry.name = name;
                }
                Some(src)
            }
            Update::Host { mem, name, src, written } => {
                let graveyard = inner.graveyard.clone();
                entry.host = Some(match written {
                    Some(w) => HostCopy::being_written(mem, w, graveyard),
                    None => HostCopy::new(mem, graveyard),
                });
                if let Some(old) = entry.ssd.take() {
                    inner.release_extents(&old.map);
                }
                entry.ssd_superseded = false;
                if name.is_some() {
                    entry.name = name;
                }
                Some(src)
            }
            Update::Held(mem) => {
                // The held source is the newest version: older copies must never be read again.
                // A volatile or retaining store drops them. A persistent one keeps the SSD copy
                // as the durable version (the one a reopen finds: the failed write was never
                // acknowledged) but marks it superseded, so this session never reads it.
                entry.held = Some(mem);
                entry.host = None;
                if inner.persist.is_some() {
                    entry.ssd_superseded = entry.ssd.is_some();
                } else if let Some(old) = entry.ssd.take() {
                    inner.release_extents(&old.map);
                }
                None
            }
            Update::Restore { host, held } => {
                if host.is_some() {
                    entry.host = host;
                }
                if held.is_some() {
                    entry.held = held;
                }
                None
            }
            Update::Freed(copy) | Update::Discarded(copy) => {
                if let Some(c) = copy {
                    inner.release_extents(&c.map);
                }
                entry.ssd_superseded = false;
                None
            }
            Update::KeepSsd(copy) => {
                entry.ssd = Some(copy);
                None
            }
            Update::ConsumedSsd => {
                if let Some(c) = entry.ssd.take() {
                    inner.release_extents(&c.map);
                }
                entry.ssd_superseded = false;
                None
            }
        }
    }
}
