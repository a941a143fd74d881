//! Quiet kernels: the ones a caller may run without calling the executor.
//!
//! Most kernels of a plan need nothing from it: no instruction is issued before them, no drop
//! or recomputation, and every tensor they create or end is one the plan never moves (a
//! *staying* tensor: no offload, prefetch or drop names it). They may read and write tensors the
//! plan moves, while those are resident. For those the executor only accounts bytes (and marks
//! the writes), so a caller that pays for every call (a Python dispatch mode pays microseconds)
//! skips them:
//!
//! ```text
//! before_kernel(k); ... kernel k ...; after_kernel(k)
//! u = quiet_until(k)                // kernels k+1..=u need no call
//! ... kernels k+1..=u run ...
//! before_kernel(u + 1)              // accounts the skipped kernels first (their creations
//!                                   // reserved, their deaths released, in order)
//! ```
//!
//! `quiet_until` skips only what cannot wait for the executor: the skipped kernels' tensors are
//! resident now (one the executor evicted is not, nor one whose copy back to the GPU the
//! caller's stream has not been ordered after and has not finished), their new tensors fit
//! the budget left now
//! (nothing in flight has to free memory for them), and while a
//! migration is in flight at most [`POLL_EVERY`] kernels go by before the next call collects
//! what finished. A staying tensor's memory is the caller's (it is never attached, so the
//! executor never evicts it; `make_room` moves only attached tensors). With
//! [`ExecutorConfig::allocate_created`](super::ExecutorConfig::allocate_created) no kernel is
//! quiet (the executor allocates every created tensor).

use teraio_scheduler::Move;

use super::{Executor, Phase, State};
use crate::Result;
use crate::tier::TensorMem;

/// While a migration is in flight, the most kernels a caller skips between two calls.
pub const POLL_EVERY: usize = 8;

/// Per tensor: whether the plan moves it; per kernel: whether it is quiet. (Computed from the
/// plan, again when it changes.)
pub(super) struct Quiet {
    pub(super) movable: Vec<bool>,
    /// The tensors `movable` names, in order.
    moved: Vec<usize>,
    pub(super) quiet: Vec<bool>,
    /// Per kernel: bytes of the tensors it creates, and of those ending after it.
    create_bytes: Vec<u64>,
    death_bytes: Vec<u64>,
}

impl Quiet {
    /// Nothing quiet (before the plan is known).
    pub(super) fn none() -> Quiet {
        Quiet {
            movable: Vec::new(),
            moved: Vec::new(),
            quiet: Vec::new(),
            create_bytes: Vec::new(),
            death_bytes: Vec::new(),
        }
    }

    pub(super) fn new(ex: &Executor) -> Quiet {
        let plan = &ex.plan;
        let n = ex.creations.len();
        let mut movable = vec![false; ex.slots.len()];
        let mut issues = vec![false; n + 1];
        for ins in &plan.instructions {
            if matches!(ins.op, Move::Offload { .. } | Move::Prefetch) {
                movable[ins.tensor.index()] = true;
            }
            issues[ins.issue_before_kernel.min(n)] = true;
        }
        for p in &plan.initially_offloaded {
            movable[p.tensor.index()] = true;
        }
        for r in &plan.recomputations {
            movable[r.tensor.index()] = true;
        }
        let quiet = (0..n)
            .map(|k| {
                !ex.cfg.allocate_created
                    && !issues[k]
                    && ex.drops[k].is_empty()
                    && ex.remakes[k].is_empty()
                    && ex.creations[k].iter().chain(&ex.deaths[k]).all(|&t| !movable[t])
            })
            .collect();
        let sum = |v: &Vec<usize>| v.iter().map(|&t| ex.trace.tensors[t].bytes).sum::<u64>();
        Quiet {
            moved: (0..movable.len()).filter(|&t| movable[t]).collect(),
            movable,
            quiet,
            create_bytes: ex.creations.iter().map(sum).collect(),
            death_bytes: ex.deaths.iter().map(sum).collect(),
        }
    }
}

impl Executor {
    /// Per tensor of the trace: whether the plan moves it (offloads, prefetches or drops it).
    /// A caller attaches only these; the others stay in its memory.
    pub fn movable(&self) -> &[bool] {
        &self.quiet.movable
    }

    /// Per kernel: whether it is quiet (see the module documentation).
    pub fn quiet_kernels(&self) -> &[bool] {
        &self.quiet.quiet
    }

    /// After `after_kernel(k)`: the last kernel the caller may run before calling the executor
    /// again (`k` when the next one needs a call). In safe mode, `k`.
    pub fn quiet_until(&self, k: usize) -> usize {
        if self.safe.is_some() || self.failed.is_some() || self.phase != Phase::Running {
            return k;
        }
        let q = &self.quiet;
        let n = q.quiet.len();
        let limit = if self.flying.is_empty() && self.allocs.is_empty() {
            n
        } else {
            n.min(k + 1 + POLL_EVERY)
        };
        let room = i128::from(self.cfg.gpu_budget_bytes) - i128::from(self.used);
        let mut net = 0i128;
        let mut j = k + 1;
        // (A tensor the plan does not move may still be off the GPU: the executor evicted it
        // when memory ran short; the call before its kernel reads it back. Tensors the skipped
        // kernels create are there when their readers run.)
        // A tensor the plan moves that was read back may still be arriving on a copy queue:
        // the call before its next kernel orders the caller's stream after the copy (and
        // clears the fence), so a kernel that reads it is skipped only once that happened or
        // the copy has finished.
        let there = |t: usize| match &self.slots[t].state {
            State::Resident(TensorMem::Device(m)) => m.ready().is_none_or(|f| f.is_done()),
            s => s.is_resident() || self.trace.tensors[t].created_by.is_some_and(|c| c > k),
        };
        while j < limit && q.quiet[j] && self.needs[j].iter().all(|&t| there(t)) {
            net += i128::from(q.create_bytes[j]);
            if net > room {
                break;
            }
            net -= i128::from(q.death_bytes[j]);
            j += 1;
        }
        j - 1
    }

    /// Whether nothing the plan moves is away from the GPU now: no migration in flight or
    /// waiting for memory, and every tensor the plan moves either resident or not alive (not
    /// created yet, or ended). While this holds, every tensor the caller can reach has its
    /// memory, so an operator the caller runs without asking (one that is not the profiled
    /// one) reads and writes real memory, at worst bytes the executor does not account; a
    /// caller that stops watching its operators for a while (teraio.torch's unwatched stretches)
    /// does so only then. Costs one look at each moved tensor.
    pub fn nothing_away(&self) -> bool {
        self.flying.is_empty()
            && self.allocs.is_empty()
            && self.quiet.moved.iter().all(|&t| {
                matches!(self.slots[t].state, State::Absent | State::Reserved | State::Resident(_))
            })
    }

    /// Whether the caller may be at kernel `k` having skipped the kernels since the last one it
    /// called about (all quiet, and their boundaries not issued).
    pub(super) fn may_skip_to(&self, k: usize) -> bool {
        k > self.next_kernel
            && k <= self.quiet.quiet.len()
            && self.issued == self.next_kernel
            && self.quiet.quiet[self.next_kernel..k].iter().all(|&q| q)
    }

    /// Account the quiet kernels the caller ran since the last call, up to `k` (exclusive): their
    /// creations reserved, then their deaths released, kernel by kernel.
    pub(super) fn catch_up(&mut self, k: usize) -> Result<()> {
        self.report.quiet_kernels += (k - self.next_kernel) as u64;
        for j in self.next_kernel..k {
            self.issued = j + 1;
            for i in 0..self.creations[j].len() {
                let t = self.creations[j][i];
                self.slots[t].current = false;
                self.slots[t].state = State::Reserved;
                self.set_used(self.used + self.trace.tensors[t].bytes);
            }
            self.next_kernel = j + 1;
            self.after_kernel(j)?;
        }
        Ok(())
    }
}
