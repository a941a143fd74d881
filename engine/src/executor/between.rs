//! Between iterations: every global tensor resident and complete for the caller's own code.
//!
//! A plan's steady state leaves some global tensors off the GPU when an iteration ends (those in
//! [`Plan::initially_offloaded`](teraio_scheduler::Plan::initially_offloaded): offloaded after
//! their last use, prefetched in the next iteration) and some still moving (an offload being
//! written, a prefetch arriving). A trainer that reads or writes its parameters and optimizer
//! states between steps (logging, evaluation, a checkpoint, loading one) must not see that.
//!
//! - [`Executor::gather_globals`] (after `end_iteration`): offloads still being written keep
//!   their GPU memory (the write completes in the background, the copy becomes current), global
//!   tensors already off the GPU are read back (urgent, past the budget: between iterations only
//!   global tensors are alive), and it returns once every global tensor is resident with its
//!   bytes in place (on a GPU: the caller's stream waits for them). Only reads the plan did not
//!   schedule cost time: tensors whose offload had already finished.
//! - [`Executor::gather_globals_within`]: the same under a limit (the budget): tensors off the
//!   GPU are read back in the order the next iteration first uses them while they fit; the
//!   others stay in the store, where the plan starts them anyway (a caller reads them with a
//!   full [`gather_globals`](Executor::gather_globals) when its own code needs them all).
//! - [`Executor::modified`]: the caller wrote a global tensor between iterations, so the store's
//!   copy is stale (a write still in flight completes first).
//! - At the next iteration's boundary 0 the gathered tensors go back where the plan starts
//!   them: an offload still being written releases its memory when stored (as planned), a
//!   resident one is dropped without writing when the store's SSD copy is current (it was not
//!   modified), else written again.

use std::time::{Duration, Instant};

use serde::Serialize;
use teraio_scheduler::{TensorId, Tier};

use super::{Alloc, Executor, Phase, State};
use crate::queue::Priority;
use crate::tier::TensorMem;
use crate::{Error, Result};

/// What [`Executor::gather_globals`] did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GatherReport {
    /// Global tensors read back (their offload had finished).
    pub read_back: u64,
    /// Their bytes.
    pub read_back_bytes: u64,
    /// Global tensors whose offload was still being written: they keep their GPU memory (and
    /// go out again where the next iteration starts them offloaded).
    pub kept_in_flight: u64,
    /// Global tensors whose offload was still being written and which the plan keeps already
    /// (its prefetch was issued during the write): they keep their GPU memory, as planned.
    pub kept_by_plan: u64,
    /// Time the call waited, seconds.
    pub waited_s: f64,
    /// GPU bytes accounted once every global tensor is resident (may exceed the budget: the
    /// next iteration's boundary 0 puts them back where the plan starts them).
    pub used_bytes: u64,
    /// Global tensors left in the store by [`Executor::gather_globals_within`] (they did not
    /// fit the limit, or the plan's prefetch of them still waits for memory).
    pub left_off: u64,
    /// Their bytes.
    pub left_off_bytes: u64,
}

impl Executor {
    /// Make every global tensor resident and complete until the next iteration starts (see the
    /// module documentation). Call it after [`end_iteration`](Self::end_iteration) or
    /// [`abort_iteration`](Self::abort_iteration).
    pub fn gather_globals(&mut self) -> Result<GatherReport> {
        self.gather_globals_within(u64::MAX)
    }

    /// [`gather_globals`](Self::gather_globals) within `limit` GPU bytes (see the module
    /// documentation): what does not fit stays in the store and the report counts it.
    pub fn gather_globals_within(&mut self, limit: u64) -> Result<GatherReport> {
        if self.phase != Phase::Idle {
            return Err(Error::InvalidArgument(
                "gather_globals() between iterations only: after start(), end_iteration() or \
                 abort_iteration()"
                    .into(),
            ));
        }
        let start = Instant::now();
        let mut rep = GatherReport::default();
        // (in the order the iteration first uses them: what the next one needs first comes
        // back first when not all fit)
        let mut globals: Vec<usize> =
            (0..self.slots.len()).filter(|&t| self.trace.tensors[t].global).collect();
        globals.sort_by_key(|&t| {
            self.trace.tensors[t].accesses.first().copied().unwrap_or(usize::MAX)
        });
        let planned = self.safe.is_none();
        // (in safe mode nothing is planned: everything comes back)
        let limit = if planned { limit } else { u64::MAX };
        // Offloads still being written keep their memory (accounted already); reads come after.
        // (one the plan already keeps, its prefetch issued while the write was in flight, holds
        // its GPU memory too, not resident until the write completes)
        for &t in &globals {
            if let State::Offloading { keep, .. } = &mut self.slots[t].state {
                if *keep {
                    rep.kept_by_plan += 1;
                } else {
                    *keep = true;
                    self.slots[t].regather = planned;
                    rep.kept_in_flight += 1;
                }
            }
        }
        // The reads go ahead of what the plan queued (a prefetch of the next iteration waiting
        // for memory): they fit the limit by construction, so they never wait behind one that
        // does not.
        let mut will_use = self.used;
        let mut queued = Vec::new();
        for &t in &globals {
            if !matches!(self.slots[t].state, State::Offloaded) {
                continue;
            }
            let bytes = self.trace.tensors[t].bytes;
            if will_use.saturating_add(bytes) > limit {
                continue;
            }
            will_use += bytes;
            self.slots[t].state = State::QueuedPrefetch;
            self.slots[t].regather = planned;
            queued.push(t);
            rep.read_back += 1;
            rep.read_back_bytes += bytes;
        }
        for &t in queued.iter().rev() {
            self.allocs.push_front(Alloc::Prefetch(t, Priority::Urgent));
        }
        // Past the budget up to the limit: between iterations only global tensors are alive.
        // A prefetch the plan queued is granted when it fits too (and then waited for); one
        // that does not stays queued for the next iteration.
        self.gather_cap = Some(limit);
        let full = limit == u64::MAX;
        let waited = self.wait_globals(&globals, full, |t, s| match s {
            State::Prefetching(_) => true,
            State::QueuedPrefetch => full || queued.contains(&t),
            _ => false,
        });
        self.gather_cap = None;
        waited?;
        // A read queued here that the caller's allocator had no room for goes now: the tensor
        // stays on its tier, where the plan starts it (were it left queued, it could land in
        // the next iteration just as the plan's own prefetch of it comes due).
        let unplaced: Vec<usize> = queued
            .iter()
            .copied()
            .filter(|&t| matches!(self.slots[t].state, State::QueuedPrefetch))
            .collect();
        if !unplaced.is_empty() {
            self.allocs.retain(|a| !matches!(a, Alloc::Prefetch(x, _) if unplaced.contains(x)));
            for &t in &unplaced {
                self.slots[t].state = State::Offloaded;
                self.slots[t].regather = false;
            }
            self.refused = None;
        }
        for &t in &globals {
            if matches!(self.slots[t].state, State::Offloaded | State::QueuedPrefetch) {
                rep.left_off += 1;
                rep.left_off_bytes += self.trace.tensors[t].bytes;
            }
        }
        // On a GPU the caller's stream waits for the reads, as for a kernel.
        if let Some(stream) = self.cfg.stream {
            for &t in &globals {
                if let State::Resident(TensorMem::Device(m)) = &mut self.slots[t].state
                    && let Some(f) = m.ready()
                {
                    f.wait_on_stream(stream)?;
                    m.set_ready(None);
                }
            }
        }
        rep.waited_s = start.elapsed().as_secs_f64();
        rep.used_bytes = self.used;
        Ok(rep)
    }

    /// Poll until no global tensor `waits` for memory or a read. Where the caller's allocator
    /// refuses a read's memory the budget allows: a `full` gather is [`Error::NoSpace`]; under
    /// a limit the tensors left stay in the store (the next iteration reads them).
    fn wait_globals(
        &mut self,
        globals: &[usize],
        full: bool,
        waits: impl Fn(usize, &State) -> bool,
    ) -> Result<()> {
        loop {
            let changed = self.poll()?;
            let waiting = globals.iter().any(|&t| waits(t, &self.slots[t].state));
            if !waiting {
                return Ok(());
            }
            if !changed && self.flying.is_empty() {
                if self.refused.is_some() && !full {
                    return Ok(());
                }
                if let Some((need, words)) = self.refused.take() {
                    return Err(Error::NoSpace(format!(
                        "gathering the global tensors: the caller's allocator refused {need} \
                         bytes ({words}) with {} bytes accounted; they do not all fit beside \
                         what else holds GPU memory (gather within the budget, or free memory \
                         held outside the plan)",
                        self.used
                    )));
                }
                return Err(Error::InvalidState {
                    tensor: "global tensors".into(),
                    detail: "they wait to be read back and nothing is in flight".into(),
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// The caller wrote global tensor `t` between iterations: the store's copy is stale, so the
    /// next offload writes it (a write of it still in flight completes first).
    pub fn modified(&mut self, t: TensorId) -> Result<()> {
        let i = self.tensor_index(t)?;
        if !self.trace.tensors[i].global {
            return Err(Error::InvalidArgument(format!(
                "modified({t}): {} is not a global tensor (only global tensors live between \
                 iterations)",
                self.trace.tensors[i].name
            )));
        }
        if self.phase == Phase::Running {
            return Err(Error::InvalidArgument(
                "modified() inside an iteration: the trace says which kernels write".into(),
            ));
        }
        while matches!(self.slots[i].state, State::Offloading { .. }) {
            if !self.poll()? {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        if !self.slots[i].state.is_resident() {
            return Err(Error::InvalidState {
                tensor: t.to_string(),
                detail: format!(
                    "{} is off the GPU: it was written without being resident (call \
                     gather_globals() after end_iteration())",
                    self.trace.tensors[i].name
                ),
            });
        }
        self.slots[i].current = false;
        Ok(())
    }

    /// Boundary 0: put the tensors [`gather_globals`](Self::gather_globals) kept or read back
    /// where the plan starts them.
    pub(super) fn scatter_gathered(&mut self) -> Result<()> {
        if !self.slots.iter().any(|s| s.regather) {
            return Ok(());
        }
        let initial: Vec<(usize, Tier)> =
            self.plan.initially_offloaded.iter().map(|p| (p.tensor.index(), p.tier)).collect();
        for (t, tier) in initial {
            if !std::mem::take(&mut self.slots[t].regather) {
                continue;
            }
            match std::mem::replace(&mut self.slots[t].state, State::Absent) {
                State::Offloading { handle, .. } => {
                    self.slots[t].state = State::Offloading { handle, keep: false };
                }
                State::Resident(mem) => {
                    let clean = self.is_clean_in(t, tier);
                    self.offload_or_drop(t, mem, tier, Priority::Normal, clean)?;
                }
                other => self.slots[t].state = other,
            }
        }
        self.slots.iter_mut().for_each(|s| s.regather = false);
        Ok(())
    }
}
