//! Faults and changes of plan while the executor runs: what it does when a write or a read
//! fails, how an iteration that lost a tensor ends so the next one can run, how a new plan
//! (made with the bandwidth an iteration measured) takes over between iterations, and how the
//! copies of dead tensors are freed.
//!
//! - A failed write leaves the tensor resident (its memory came back from the store); when the
//!   store has a host tier the write goes there once first ([`IterationReport::host_retries`]).
//! - A failed read is tried again ([`MAX_PREFETCH_RETRIES`] times, urgent). When every attempt
//!   fails the tensor is lost: the copy was the only one (its GPU memory was released after the
//!   write was stored), so the iteration cannot go on. [`Error::TensorLost`] names the tensor,
//!   the kernel that needed it and the device of the copy; every later call of the iteration
//!   returns it again until [`Executor::abort_iteration`].
//! - [`Executor::abort_iteration`] ends the iteration: what is in flight completes, the
//!   iteration's tensors go (with their copies), the global tensors are put where the plan
//!   expects them when an iteration starts, and the next iteration runs normally. A lost
//!   global tensor cannot be put back: that is an error (restore it and open a new executor).
//! - [`Executor::set_plan`] replaces the plan between iterations (same trace), moving the
//!   global tensors to the new plan's starting placement.

use std::time::Duration;

use serde::Serialize;
use teraio_scheduler::{Plan, TensorId, Tier, Trace};

use super::{Alloc, Event, Executor, IterationReport, Phase, State, destination, key, stored};
use crate::executor::AllocFor;
use crate::queue::Priority;
use crate::store::{Destination, OffloadOptions};
use crate::tier::TensorMem;
use crate::{Error, Result};

/// Times a failed prefetch is tried again before the tensor counts as lost.
pub const MAX_PREFETCH_RETRIES: u8 = 2;

/// A tensor whose only copy could not be read back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LostTensor {
    /// The tensor (index in the trace).
    pub tensor: usize,
    /// Its name in the trace.
    pub name: String,
    /// Whether it is a global tensor (lives across iterations: it cannot be made again).
    pub global: bool,
    /// The kernel that needed it.
    pub kernel: usize,
    /// That kernel's name.
    pub kernel_name: String,
    /// Where the unreadable copy is ("device 2", "the host tier", "the SSD array").
    pub device: String,
    /// The last error reading it.
    pub detail: String,
}

impl LostTensor {
    /// The error a caller gets.
    pub fn error(&self) -> Error {
        Error::TensorLost {
            tensor: format!("t{} ({})", self.tensor, self.name),
            kernel: self.kernel,
            kernel_name: self.kernel_name.clone(),
            device: self.device.clone(),
            detail: self.detail.clone(),
        }
    }
}

/// Check that `plan` is one the executor runs, for `trace`.
pub(super) fn check_plan(trace: &Trace, plan: &Plan) -> Result<()> {
    plan.validate(trace)
        .map_err(|e| Error::InvalidArgument(format!("the plan does not fit the trace: {e}")))?;
    if !plan.host_kernels.is_empty() {
        return Err(Error::Unsupported(format!(
            "the `{}` plan runs {} kernels on the CPU (host kernels); the executor runs GPU \
             kernels only, so simulate this policy with `teraio simulate`",
            plan.policy,
            plan.host_kernels.len()
        )));
    }
    if !plan.host_updates.is_empty() {
        return Err(Error::Unsupported(format!(
            "the `{}` plan runs {} optimizer updates on the host CPU (host updates, made by \
             the optimizer's placement); the executor runs GPU kernels only: the trainer runs \
             those updates itself (teraio.torch's Session(optimizer_on='auto')) and hands the \
             executor the plan without them",
            plan.policy,
            plan.host_updates.len()
        )));
    }
    Ok(())
}

impl Executor {
    /// An offload of tensor `t` failed and the store gave its memory back: try the host tier
    /// once (when there is one and no prefetch wants the tensor back), else keep it resident.
    pub(super) fn offload_failed(
        &mut self,
        t: usize,
        keep: bool,
        mem: TensorMem,
        e: &Error,
    ) -> Result<()> {
        self.last_write_error = Some(e.to_string());
        if !keep && self.safe.is_none() && self.store.has_host_tier() && !self.slots[t].host_retried
        {
            self.slots[t].host_retried = true;
            self.report.host_retries += 1;
            let opts = OffloadOptions {
                destination: Destination::Host,
                priority: Priority::Urgent,
                name: None,
            };
            let handle = self.offload_keep(t, mem, opts)?;
            self.flying.push(t);
            self.slots[t].state = State::Offloading { handle, keep: false };
            return Ok(());
        }
        self.slots[t].host_retried = false;
        self.report.failed_offloads += 1;
        self.slots[t].stayed = true;
        self.slots[t].state = State::Resident(mem);
        Ok(())
    }

    /// A prefetch of tensor `t` failed (its destination memory went with it): try again, or
    /// declare the tensor lost.
    pub(super) fn prefetch_failed(&mut self, t: usize, e: Error) -> Result<()> {
        self.set_used(self.used - self.bytes(t));
        let has_copy = self.store.info(key(t)).is_some();
        if has_copy && self.slots[t].attempts < MAX_PREFETCH_RETRIES {
            self.slots[t].attempts += 1;
            self.report.prefetch_retries += 1;
            self.slots[t].state = State::QueuedPrefetch;
            self.allocs.push_front(Alloc::Prefetch(t, Priority::Urgent));
            return Ok(());
        }
        self.slots[t].attempts = 0;
        self.slots[t].evicted = false;
        // What is left of the copy stays in the store: a later attempt (abort_iteration for a
        // global tensor) may read it if the fault was transient.
        self.slots[t].state = if has_copy { State::Offloaded } else { State::Absent };
        let lost = self.lost_tensor(t, &e);
        if self.report.lost.is_none() {
            self.report.lost = Some(lost.clone());
        }
        let err = lost.error();
        self.failed = Some(lost);
        Err(err)
    }

    /// The recomputation of tensor `t` (memory `mem`) failed: its memory goes back, the tensor
    /// is lost (it has no copy: the plan dropped it), the iteration stops as for a failed read.
    pub(super) fn recompute_failed(&mut self, t: usize, mem: TensorMem, e: Error) -> Error {
        self.give_back(TensorId(t as u32), mem);
        self.set_used(self.used - self.bytes(t));
        self.slots[t].state = State::Dropped;
        let mut lost = self.lost_tensor(t, &e);
        lost.device = "no tier (the plan dropped it to recompute it, and that failed)".into();
        if self.report.lost.is_none() {
            self.report.lost = Some(lost.clone());
        }
        let err = lost.error();
        self.failed = Some(lost);
        err
    }

    /// For an out-of-memory message: how many tensors stayed because their writes failed.
    pub(super) fn stayed_note(&self) -> String {
        let stayed: u64 = self
            .slots
            .iter()
            .filter(|s| s.stayed && matches!(s.state, State::Resident(_)))
            .map(|_| 1)
            .sum();
        match (&self.last_write_error, stayed) {
            (Some(e), n) if n > 0 => format!(
                "; {n} tensors stayed in GPU memory because their writes failed (last: {e}): \
                 a host tier (--host-memory) would take them"
            ),
            _ => String::new(),
        }
    }

    fn lost_tensor(&self, t: usize, e: &Error) -> LostTensor {
        let tensor = &self.trace.tensors[t];
        let kernel = tensor
            .accesses
            .iter()
            .copied()
            .find(|&a| a >= self.next_kernel)
            .or_else(|| tensor.accesses.first().copied())
            .unwrap_or(self.next_kernel);
        let info = self.store.info(key(t));
        let device = match e {
            Error::Io { device, .. } | Error::ShortTransfer { device, .. } => {
                format!("device {device}")
            }
            Error::ChecksumMismatch { offset, .. } => {
                match info.as_ref().and_then(|i| i.stripe_map.as_ref()).map(|m| m.locate(*offset)) {
                    Some(Ok((d, at))) => format!("device {d} (device offset {at})"),
                    _ => "the SSD array".into(),
                }
            }
            _ if info.as_ref().is_some_and(|i| i.host_copy) => "the host tier".into(),
            _ => "the SSD array".into(),
        };
        LostTensor {
            tensor: t,
            name: tensor.name.clone(),
            global: tensor.global,
            kernel,
            kernel_name: self
                .trace
                .kernels
                .get(kernel)
                .map_or_else(String::new, |k| k.name.clone()),
            device,
            detail: e.to_string(),
        }
    }

    /// Free the store's copy of tensor `t` (it died): its SSD extents go back to the array.
    pub(super) fn free_copy(&mut self, t: usize) {
        let Some(info) = self.store.info(key(t)) else { return };
        if let Ok(h) = self.store.free(key(t)) {
            if info.stripe_map.is_some() || info.host_copy {
                self.report.copies_freed += 1;
            }
            self.frees.push(h);
        }
        self.slots[t].current = false;
    }

    /// Let everything in flight complete, starting nothing new: queued prefetches go back to
    /// offloaded, queued creations are dropped.
    fn drain(&mut self) -> Result<()> {
        loop {
            for a in std::mem::take(&mut self.allocs) {
                if let Alloc::Prefetch(t, _) = a {
                    self.slots[t].state = State::Offloaded;
                }
            }
            if self.flying.is_empty() {
                return Ok(());
            }
            match self.poll() {
                Ok(_) | Err(Error::TensorLost { .. }) => {}
                Err(e) => return Err(e),
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// End an iteration that stopped (a lost tensor, or any error the caller does not want to
    /// go on from): migrations in flight complete, the iteration's tensors are released (and
    /// their copies freed), global tensors are moved to where the plan has them when an
    /// iteration starts. The next iteration starts at kernel 0 as usual. Returns the
    /// iteration's report ([`IterationReport::lost`] says what was lost).
    ///
    /// Fails (with [`Error::TensorLost`]) when the tensor lost is a global one, or a global
    /// tensor cannot be read back now: nothing makes it again, so restore it (from a
    /// checkpoint) and open a new executor.
    pub fn abort_iteration(&mut self) -> Result<IterationReport> {
        if self.phase != Phase::Running {
            return Err(Error::InvalidArgument(
                "abort_iteration() outside an iteration (nothing to end)".into(),
            ));
        }
        let drained = self.drain();
        for t in 0..self.slots.len() {
            if !self.trace.tensors[t].global {
                // Reserved memory the caller never attached is dropped with the reservation.
                self.release(t)?;
                self.slots[t].stayed = false;
                self.slots[t].attempts = 0;
                self.slots[t].host_retried = false;
            }
        }
        let settled = match drained {
            Ok(()) if self.safe.is_none() => self.settle_globals(),
            other => other,
        };
        let lost_global = self.failed.take().filter(|l| l.global);
        let report = self.finish_iteration();
        settled?;
        match lost_global {
            // Nothing makes a global tensor again: going on would run without it.
            Some(l) => Err(l.error()),
            None => Ok(report),
        }
    }

    /// Run `plan` (for the same trace) from the next iteration on: called between iterations
    /// (before the first, or after `end_iteration` / `abort_iteration`). Migrations in flight
    /// complete first; global tensors move to the new plan's starting placement (written out,
    /// or read back) before it returns. The next iteration's report has `replanned` set.
    pub fn set_plan(&mut self, plan: Plan) -> Result<()> {
        if self.phase == Phase::Running {
            return Err(Error::InvalidArgument(
                "set_plan() inside an iteration: call it after end_iteration() or abort_iteration()"
                    .into(),
            ));
        }
        if self.safe.is_some() {
            return Err(Error::InvalidArgument(
                "set_plan() in safe mode: the iteration left the trace, so open a new executor for a new trace and plan"
                    .into(),
            ));
        }
        check_plan(&self.trace, &plan)?;
        if self.phase == Phase::Setup {
            self.plan = plan;
            self.quiet = super::quiet::Quiet::new(self);
            return Ok(());
        }
        self.drain()?;
        self.failed = None;
        self.plan = plan;
        self.quiet = super::quiet::Quiet::new(self);
        for t in 0..self.slots.len() {
            self.slots[t].stayed = false;
            self.slots[t].evicted = false;
            self.slots[t].attempts = 0;
        }
        self.replanned = true;
        self.settle_globals()
    }

    /// Nothing in flight: write out the global tensors the plan starts offloaded and read back
    /// the others, waiting for both.
    fn settle_globals(&mut self) -> Result<()> {
        let mut want: Vec<Option<Tier>> = vec![None; self.slots.len()];
        for p in &self.plan.initially_offloaded {
            want[p.tensor.index()] = Some(p.tier);
        }
        let globals: Vec<usize> =
            (0..self.slots.len()).filter(|&t| self.trace.tensors[t].global).collect();
        let mut writes = Vec::new();
        for &t in &globals {
            self.slots[t].evicted = false;
            let Some(tier) = want[t] else { continue };
            if !matches!(self.slots[t].state, State::Resident(_)) {
                continue;
            }
            let State::Resident(mem) = std::mem::replace(&mut self.slots[t].state, State::Absent)
            else {
                unreachable!("checked above")
            };
            if self.is_clean_in(t, tier) {
                self.let_go(t, mem);
                continue;
            }
            let opts = OffloadOptions {
                destination: destination(tier),
                priority: Priority::Urgent,
                name: None,
            };
            writes.push((t, self.offload_keep(t, mem, opts)?));
        }
        for (t, h) in writes {
            let id = TensorId(t as u32);
            match h.wait() {
                Ok((outcome, mem)) => {
                    self.slots[t].current = stored(outcome);
                    self.let_go(t, mem);
                }
                Err(e) => {
                    let mem = self.store.take_held(key(t)).ok_or_else(|| Error::InvalidState {
                        tensor: id.to_string(),
                        detail: format!(
                            "its offload failed ({e}) and the store did not hand its memory back"
                        ),
                    })?;
                    // It stays: the plan's prefetch of it is a no-op.
                    self.last_write_error = Some(e.to_string());
                    self.report.failed_offloads += 1;
                    self.slots[t].stayed = true;
                    self.slots[t].state = State::Resident(mem);
                }
            }
        }
        for &t in &globals {
            if want[t].is_some() || !matches!(self.slots[t].state, State::Offloaded) {
                continue;
            }
            let id = TensorId(t as u32);
            let mut last = None;
            for _ in 0..=MAX_PREFETCH_RETRIES {
                let mem = self.alloc.alloc(id, self.bytes(t), AllocFor::Prefetch)?;
                let h = match (self.cfg.stream, mem.device().is_some()) {
                    (Some(stream), true) => {
                        self.store.prefetch_after_stream(key(t), mem, Priority::Urgent, stream)?
                    }
                    _ => self.store.prefetch(key(t), mem, Priority::Urgent)?,
                };
                match h.wait() {
                    Ok(mem) => {
                        self.set_used(self.used + self.bytes(t));
                        self.slots[t].current = self.has_copy(t);
                        self.slots[t].state = State::Resident(mem);
                        self.events.push_back(Event::Arrived(id));
                        last = None;
                        break;
                    }
                    Err(e) => last = Some(e),
                }
            }
            if let Some(e) = last {
                let lost = self.lost_tensor(t, &e);
                if self.report.lost.is_none() {
                    self.report.lost = Some(lost.clone());
                }
                return Err(lost.error());
            }
        }
        Ok(())
    }
}
