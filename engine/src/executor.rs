//! The plan executor: executes a scheduler [`Plan`] for a trainer that drives it with its own
//! progress. One implementation of the plan's semantics for every front end: the emulated
//! replay ([`crate::replay::replay`]), teraio.torch (through the Python package) and a
//! C++ trainer (through the C ABI).
//!
//! The semantics are those of the scheduler's simulator (`teraio_scheduler::plan`):
//! - at boundary `i` (kernel `i` about to start; `kernel_count`: the iteration's end) the
//!   instructions issued there run in plan order: an offload starts at once and releases the
//!   tensor's GPU memory when its copy is stored; a prefetch allocates GPU memory first (FIFO,
//!   waiting while the budget is full), then reads. A prefetch issued while the tensor's
//!   offload is still being written keeps the GPU copy (no read).
//! - a kernel runs once the tensors it creates have memory granted and every tensor it
//!   accesses is resident; tensors die after their last kernel.
//! - GPU memory is accounted in exact bytes against the budget.
//! - a clean drop releases the memory without writing when the store holds a current copy.
//!
//! # Driving it
//!
//! ```text
//! attach(t, mem) for every global tensor        // parameters, gradients, optimizer states
//! start()                                       // the plan's initially offloaded tensors go
//! per iteration:
//!     for k in 0..kernels:
//!         before_kernel(k)                      // issue boundary k, wait until k can run
//!         (or: boundary(k); while !kernel_ready(k) { do other work })
//!         attach(t, mem) for tensors k creates  // unless the executor allocates them
//!         ... the kernel runs; resident(t) gives a tensor's memory ...
//!         after_kernel(k)                       // tensors whose last use was k die
//!         (optional: quiet_until(k) = u: kernels k+1..=u need no call; the next call accounts
//!         them; only the tensors movable() names need attaching: the `quiet` module)
//!     end_iteration()                           // wrap-around instructions, the report
//!     gather_globals()                          // optional: every global resident until
//!                                               // kernel 0 (the caller's code between steps)
//! finish()
//! ```
//!
//! Memory the executor needs (prefetch destinations, created tensors when
//! [`ExecutorConfig::allocate_created`]) comes from a [`TensorAllocator`]; memory it no longer
//! needs (an offload is stored, a tensor died) goes back to it. [`Executor::events`] tells the
//! caller which tensors arrived and which were released, for callers that keep their own
//! references (a framework's tensor objects).
//!
//! # Divergence
//!
//! A caller whose iteration differs from the trace (another kernel count, a tensor of another
//! size) gets [`Error::Diverged`] naming where, once; the executor then switches to a safe
//! mode: no more offloads, every offloaded tensor is read back, budgets are no longer enforced,
//! and every later call succeeds without plan checks until the caller re-plans (a new
//! executor). No tensor is lost and none is handed back wrong.
//!
//! # Between iterations
//!
//! When an iteration ends the plan may leave global tensors off the GPU or still moving. A
//! caller whose own code touches them between iterations calls
//! [`Executor::gather_globals`]: every global tensor resident with its bytes in place until the
//! next iteration's boundary 0 puts them back (the `between` module; [`Executor::modified`]
//! when that code wrote one).
//!
//! # Faults
//!
//! A failed offload write leaves the tensor resident (its memory comes back from the store)
//! and is counted in the report; when the store has a host tier the write is tried there once
//! first. The plan's later clean drops or prefetches of a tensor that stayed become no-ops. A
//! failed prefetch (an I/O error, a checksum mismatch) is tried again; when every attempt
//! fails the tensor is lost: [`Error::TensorLost`] names the tensor, the kernel and the device,
//! the iteration stops, and [`Executor::abort_iteration`] ends it so the next one can run (see
//! the `recover` module). A tensor's SSD copy is freed when the tensor dies.

mod between;
mod quiet;
mod recover;

pub use between::GatherReport;
pub use recover::LostTensor;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use teraio_scheduler::{Move, Plan, TensorId, Tier, Trace};

use crate::queue::{Handle, Priority};
use crate::store::StoreStats;
pub use crate::store::diff_stats;
use crate::store::{Destination, OffloadOptions, OffloadOutcome, TensorKey, TensorStore};
use crate::tier::{MemoryTier, TensorMem};
use crate::{Error, Result};

/// Why the executor asks for memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocFor {
    /// A tensor created by a kernel (only with [`ExecutorConfig::allocate_created`]).
    Create,
    /// The destination of a prefetch.
    Prefetch,
    /// A tensor the plan dropped and recomputes ([`TensorAllocator::recompute`] fills it).
    Recompute,
}

/// Where the executor's memory comes from and goes back to.
pub trait TensorAllocator: Send {
    /// Memory of exactly `bytes` bytes for tensor `t`.
    fn alloc(&mut self, t: TensorId, bytes: u64, why: AllocFor) -> Result<TensorMem>;
    /// Memory of tensor `t` the executor no longer holds (an offload was stored, the tensor
    /// died). The default drops it.
    fn release(&mut self, t: TensorId, mem: TensorMem) {
        let _ = t;
        drop(mem);
    }
    /// Whether memory given back here is reused only by work queued later on the caller's
    /// stream (a caching allocator such as PyTorch's, which frees on the stream): then memory an
    /// engine copy still reads is handed back with the caller's stream ordered after the copy,
    /// without blocking the host. The default: no (the host waits for the copy first).
    fn stream_ordered(&self) -> bool {
        false
    }
    /// Whether this allocator can make tensors again ([`recompute`](Self::recompute)); an
    /// executor refuses a plan with recomputations when it cannot. The default: no.
    fn can_recompute(&self) -> bool {
        false
    }
    /// Make tensor `t` again in `mem` (memory from [`alloc`](Self::alloc) with
    /// [`AllocFor::Recompute`]) by running its producer (`teraio_scheduler::Producer`) once
    /// more, ordered on the caller's stream before the kernel about to run. Called once the
    /// producer's inputs are resident (the caller's stream already waits for their prefetches),
    /// inputs first when several tensors are remade before one kernel (by the kernel that made
    /// each: a producer's inputs were made before its result).
    fn recompute(&mut self, t: TensorId, mem: &mut TensorMem) -> Result<()> {
        let _ = mem;
        Err(Error::Unsupported(format!("this allocator cannot recompute tensor {t}")))
    }
}

/// A [`TensorAllocator`] over a [`MemoryTier`] (released memory is dropped, back to the tier).
pub struct TierAllocator(pub Arc<dyn MemoryTier>);

impl TensorAllocator for TierAllocator {
    fn alloc(&mut self, _t: TensorId, bytes: u64, _why: AllocFor) -> Result<TensorMem> {
        self.0.alloc(bytes)
    }
}

/// How to execute.
#[derive(Debug, Clone)]
pub struct ExecutorConfig {
    /// GPU memory the iteration's tensors may use, bytes.
    pub gpu_budget_bytes: u64,
    /// The executor allocates created tensors' memory (from its allocator) when their kernel is
    /// about to run. `false` (a trainer whose framework allocates): the budget is reserved and
    /// the caller attaches the memory after the kernel ran ([`Executor::attach`]).
    pub allocate_created: bool,
    /// The caller's CUDA stream (a `CUstream` as an integer; 0 is the legacy default stream),
    /// for device memory: an offload reads a tensor only after the work queued on the stream
    /// when it was issued, a prefetch writes memory only after the work queued when it was
    /// issued (a caching allocator's block may still be read by it), and a kernel's stream
    /// waits (without blocking the host) for its tensors' prefetches once `kernel_ready` /
    /// `before_kernel` says it can run. `None`: host memory, or a caller that synchronizes
    /// itself.
    pub stream: Option<u64>,
}

impl Default for ExecutorConfig {
    fn default() -> Self {
        Self { gpu_budget_bytes: 1 << 30, allocate_created: false, stream: None }
    }
}

/// Something the caller may want to know, from [`Executor::events`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Event {
    /// The tensor came back from a prefetch: [`Executor::resident`] has its memory.
    Arrived(TensorId),
    /// The executor released the tensor's memory (its copy is stored, or it died): the memory
    /// went back to the allocator; a caller holding its own reference can drop it.
    Released(TensorId),
}

/// Where an iteration left the plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Divergence {
    /// The kernel the caller was at (its own count).
    pub kernel: usize,
    /// What did not match.
    pub detail: String,
}

/// What one iteration did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct IterationReport {
    /// Iteration number (0-based).
    pub iteration: usize,
    /// Wall time from the first `before_kernel` to `end_iteration`, seconds.
    pub time_s: f64,
    /// Time spent waiting in `before_kernel` for tensors or memory, seconds.
    pub stall_s: f64,
    /// Of `stall_s`, the time a waiting allocation did not fit the budget (memory that offloads
    /// in flight free once stored); the rest waited for reads to arrive.
    pub stall_memory_s: f64,
    /// Bytes of offloaded tensors handed back before their copies completed, the caller's
    /// stream ordered after the copies (a waiting allocation that the host did not wait for).
    pub released_on_stream_bytes: u64,
    /// Tensors moved out by [`Executor::make_room`] (the caller's allocator ran out of memory
    /// within the budget); also counted in `evictions`.
    pub made_room: u64,
    /// Grants (a prefetch's, a recomputation's, a created tensor's memory) the caller's
    /// allocator refused with [`Error::NoSpace`] although the budget had room (a caching
    /// allocator's rounded, scattered blocks, memory the trace does not see): each waited at
    /// the queue's front while the executor made room ([`Executor::make_room`]), then ran.
    pub allocator_refusals: u64,
    /// Peak GPU bytes accounted.
    pub peak_bytes: u64,
    /// The budget.
    pub budget_bytes: u64,
    /// Offloads issued (writes).
    pub offloads: u64,
    /// Clean drops: memory released without writing, the store's copy being current.
    pub clean_drops: u64,
    /// Prefetches issued.
    pub prefetches: u64,
    /// Prefetches that found the offload still being written and kept the GPU copy.
    pub kept_copies: u64,
    /// Offloads whose write failed; the tensor stayed resident.
    pub failed_offloads: u64,
    /// Tensors dropped and made again by their producer (the plan's recomputations).
    pub recomputations: u64,
    /// Tensors the executor moved out on its own because a kernel waited for memory that
    /// nothing in flight would free (the caller ran faster than the plan's timing assumed: a
    /// prefetch met its offload still being written and kept the tensor).
    pub evictions: u64,
    /// Tensors a kernel needed that were off the GPU with no prefetch coming (evicted ones),
    /// read back on demand.
    pub demand_fetches: u64,
    /// The iteration left the plan (safe mode since).
    pub diverged: Option<Divergence>,
    /// Prefetches tried again after a failed read (an I/O error, a checksum mismatch).
    pub prefetch_retries: u64,
    /// Offloads whose SSD write failed and that were written to the host tier instead.
    pub host_retries: u64,
    /// SSD copies freed because their tensor died.
    pub copies_freed: u64,
    /// The tensor whose only copy could not be read back: the iteration stopped there
    /// ([`Executor::abort_iteration`] ended it).
    pub lost: Option<LostTensor>,
    /// The plan changed before this iteration ([`Executor::set_plan`]).
    pub replanned: bool,
    /// Kernels the caller ran without calling the executor (quiet ones, accounted at the next
    /// call; see [`Executor::quiet_until`]).
    pub quiet_kernels: u64,
    /// (seconds from the iteration's start, GPU bytes accounted) at every change.
    pub memory_timeline: Vec<(f64, u64)>,
    /// Store statistics over the iteration.
    pub store: StoreStats,
}

enum State {
    Absent,
    /// Budget granted to a created tensor whose memory the caller has not attached yet.
    Reserved,
    Resident(TensorMem),
    Offloading {
        handle: Handle<(OffloadOutcome, TensorMem)>,
        keep: bool,
    },
    Offloaded,
    QueuedPrefetch,
    Prefetching(Handle<TensorMem>),
    /// Dropped for recomputation: no memory, no copy needed (its producer makes it again).
    Dropped,
    /// Memory granted for a recomputation that has not run yet.
    Remaking(TensorMem),
}

impl State {
    fn is_resident(&self) -> bool {
        matches!(self, State::Reserved | State::Resident(_))
    }

    /// Whether the tensor counts against the GPU budget in this state: memory granted (or
    /// reserved for the caller's), or a migration in flight that still holds it.
    fn holds_budget(&self) -> bool {
        matches!(
            self,
            State::Reserved
                | State::Resident(_)
                | State::Offloading { .. }
                | State::Prefetching(_)
                | State::Remaking(_)
        )
    }
}

/// What the executor knows of one tensor of the trace: where it is and the flags the plan's
/// later instructions and the recovery paths consult.
struct Slot {
    /// Where the tensor is (its memory, or the migration in flight).
    state: State,
    /// Its last offload failed (it is still resident): the plan's prefetch of it is a no-op.
    stayed: bool,
    /// The executor evicted it on its own (see [`IterationReport::evictions`]): the plan's next
    /// offload of it is a no-op; a kernel that needs it reads it back on demand.
    evicted: bool,
    /// The store's copy equals its GPU memory (set when an offload is stored or a prefetch
    /// arrives; cleared when a kernel creates or writes it): only then is a drop clean.
    current: bool,
    /// Prefetch attempts since it last arrived.
    attempts: u8,
    /// Its failed SSD write went to the host tier (tried once per failure).
    host_retried: bool,
    /// `gather_globals` kept it or read it back (a global tensor): boundary 0 puts it back
    /// where the plan starts it.
    regather: bool,
    /// Its size as last attached (the trace's until then): what a prefetch or a recomputation
    /// allocates. Budgets account the trace's sizes.
    size: u64,
}

impl Slot {
    /// A tensor of `size` bytes the executor has not seen yet.
    fn new(size: u64) -> Self {
        Slot {
            state: State::Absent,
            stayed: false,
            evicted: false,
            current: false,
            attempts: 0,
            host_retried: false,
            regather: false,
            size,
        }
    }
}

#[derive(Clone, Copy)]
enum Alloc {
    Create(usize),
    Prefetch(usize, Priority),
    Remake(usize),
}

impl Alloc {
    fn tensor(&self) -> usize {
        match self {
            Alloc::Create(t) | Alloc::Prefetch(t, _) | Alloc::Remake(t) => *t,
        }
    }
}

#[derive(PartialEq, Eq, Clone, Copy)]
enum Phase {
    /// Before `start`: globals are attached.
    Setup,
    /// Between iterations.
    Idle,
    /// Inside an iteration; the next kernel expected.
    Running,
}

/// Executes one plan for one trace; see the module documentation.
pub struct Executor {
    trace: Trace,
    plan: Plan,
    store: Arc<TensorStore>,
    alloc: Box<dyn TensorAllocator>,
    cfg: ExecutorConfig,
    creations: Vec<Vec<usize>>,
    deaths: Vec<Vec<usize>>,
    accesses: Vec<Vec<usize>>,
    /// Per boundary: tensors the plan drops there for recomputation.
    drops: Vec<Vec<usize>>,
    /// Per kernel: tensors remade right before it, inputs first (by the kernel that made each).
    remakes: Vec<Vec<usize>>,
    /// Per kernel: the tensors it needs resident, its accesses and the inputs of the
    /// recomputations before it (equal to `accesses` where nothing is remade).
    needs: Vec<Vec<usize>>,
    /// One record per tensor of the trace, indexed by its trace index.
    slots: Vec<Slot>,
    allocs: VecDeque<Alloc>,
    /// The caller's allocator refused the grant at the front of `allocs` although the budget
    /// had room: the bytes it wanted and the allocator's words (cleared by the next grant).
    refused: Option<(u64, String)>,
    events: VecDeque<Event>,
    used: u64,
    /// `used` when the iteration began: a gather or a write that failed may leave more than the
    /// budget resident; allocations then wait until `used` is back within the budget, so no
    /// kernel of the iteration runs above the larger of the two (a debug assertion).
    used_at_start: u64,
    /// The tensors whose offload or prefetch is in flight (`Offloading` or `Prefetching`):
    /// what a poll looks at, instead of every tensor of the trace before every kernel.
    flying: Vec<usize>,
    phase: Phase,
    /// Next kernel expected in this iteration.
    next_kernel: usize,
    /// Kernels of this iteration whose `after_kernel` ran (the next one may be this or later).
    after_next: usize,
    /// Boundaries issued so far in this iteration (boundary `i` issued when `i < issued`).
    issued: usize,
    next_instr: usize,
    /// Safe mode since a divergence.
    safe: Option<Divergence>,
    iteration: usize,
    report: IterationReport,
    iteration_start: Instant,
    stats_before: StoreStats,
    /// The tensor lost in this iteration: the iteration stopped.
    failed: Option<LostTensor>,
    /// Frees of dead tensors' copies not known to be done.
    frees: Vec<Handle<()>>,
    /// The next iteration runs a plan given by `set_plan`.
    replanned: bool,
    /// The last failed write (for the message when memory runs out because of them).
    last_write_error: Option<String>,
    /// `gather_globals` is reading global tensors back: allocations may reach this many bytes
    /// (past the budget; `u64::MAX` for a full gather).
    gather_cap: Option<u64>,
    /// Which tensors the plan moves, which kernels need no call (the `quiet` module).
    quiet: quiet::Quiet,
    /// The trace's sizes are upper bounds ([`Executor::set_sizes_at_most`]).
    sizes_at_most: bool,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("policy", &self.plan.policy)
            .field("kernels", &self.trace.kernels.len())
            .field("budget", &self.cfg.gpu_budget_bytes)
            .field("used", &self.used)
            .field("iteration", &self.iteration)
            .field("safe_mode", &self.safe.is_some())
            .finish()
    }
}

/// Whether an offload left a copy equal to the memory (not one a later prefetch took over).
fn stored(outcome: OffloadOutcome) -> bool {
    matches!(outcome, OffloadOutcome::OnSsd | OffloadOutcome::InHost)
}

/// Trace tensor `t`'s key in the store (the executor's key space: see [`TensorKey`]).
fn key(t: usize) -> TensorKey {
    TensorKey::of_trace(TensorId(t as u32))
}

fn destination(tier: Tier) -> Destination {
    match tier {
        Tier::Ssd => Destination::Ssd,
        Tier::Host => Destination::Host,
    }
}

impl Executor {
    /// An executor of `plan` (validated against `trace`) over `store`, with memory from `alloc`.
    pub fn new(
        store: Arc<TensorStore>,
        alloc: Box<dyn TensorAllocator>,
        trace: Trace,
        plan: Plan,
        cfg: ExecutorConfig,
    ) -> Result<Self> {
        recover::check_plan(&trace, &plan)?;
        let n = trace.kernels.len();
        let mut creations = vec![Vec::new(); n];
        let mut deaths = vec![Vec::new(); n];
        for (i, t) in trace.tensors.iter().enumerate() {
            if !t.global {
                if let Some(c) = t.created_by {
                    creations[c].push(i);
                }
                if let Some(d) = t.dies_after {
                    deaths[d].push(i);
                }
            }
        }
        if !plan.recomputations.is_empty() && !alloc.can_recompute() {
            return Err(Error::Unsupported(format!(
                "the `{}` plan recomputes {} tensors and this executor's allocator cannot run \
                 producers (teraio.torch can; `teraio run` and the C ABI cannot yet): \
                 plan without recomputation (e.g. `--no-recompute`, or `--policy teraio`)",
                plan.policy,
                plan.recomputations.len()
            )));
        }
        let accesses: Vec<Vec<usize>> = trace
            .accesses_per_kernel()
            .into_iter()
            .map(|v| v.into_iter().map(|t| t.index()).collect())
            .collect();
        let mut drops = vec![Vec::new(); n + 1];
        let mut remakes = vec![Vec::new(); n];
        let mut needs = accesses.clone();
        for r in &plan.recomputations {
            drops[r.drop_at].push(r.tensor.index());
            remakes[r.before_kernel].push(r.tensor.index());
            if let Some(p) = &trace.tensors[r.tensor.index()].producer {
                needs[r.before_kernel].extend(p.inputs.iter().map(|t| t.index()));
            }
        }
        for v in &mut needs {
            v.sort_unstable();
            v.dedup();
        }
        // A kernel's recomputations run inputs first: a producer's inputs were made before its
        // result (a plan lists them by when they were dropped; a chain remade at one kernel
        // must not read its input's memory before that input is made again).
        for v in &mut remakes {
            v.sort_by_key(|&t| (trace.tensors[t].created_by, t));
        }
        let slots = trace.tensors.iter().map(|t| Slot::new(t.bytes)).collect();
        let stats_before = store.stats();
        let mut ex = Executor {
            trace,
            plan,
            store,
            alloc,
            report: IterationReport { budget_bytes: cfg.gpu_budget_bytes, ..Default::default() },
            cfg,
            creations,
            deaths,
            accesses,
            drops,
            remakes,
            needs,
            slots,
            allocs: VecDeque::new(),
            refused: None,
            events: VecDeque::new(),
            used: 0,
            used_at_start: 0,
            flying: Vec::new(),
            phase: Phase::Setup,
            next_kernel: 0,
            after_next: 0,
            issued: 0,
            next_instr: 0,
            safe: None,
            iteration: 0,
            iteration_start: Instant::now(),
            stats_before,
            failed: None,
            frees: Vec::new(),
            replanned: false,
            last_write_error: None,
            gather_cap: None,
            quiet: quiet::Quiet::none(),
            sizes_at_most: false,
        };
        ex.quiet = quiet::Quiet::new(&ex);
        Ok(ex)
    }

    /// The trace it executes.
    pub fn trace(&self) -> &Trace {
        &self.trace
    }

    /// The plan it executes.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// GPU bytes accounted now.
    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    /// Migrations in flight.
    pub fn in_flight(&self) -> usize {
        self.flying.len()
    }

    /// Where the iteration left the plan, once it has (safe mode since).
    pub fn diverged(&self) -> Option<&Divergence> {
        self.safe.as_ref()
    }

    /// The next kernel the plan expects.
    pub fn next_kernel(&self) -> usize {
        self.next_kernel
    }

    /// Arrivals and releases since the last call, oldest first.
    pub fn events(&mut self) -> Vec<Event> {
        self.events.drain(..).collect()
    }

    /// The memory of tensor `t` while resident with memory attached.
    pub fn resident(&self, t: TensorId) -> Option<&TensorMem> {
        match self.slots.get(t.index()).map(|s| &s.state) {
            Some(State::Resident(m)) => Some(m),
            _ => None,
        }
    }

    /// Mutable access to the memory of a resident tensor.
    pub fn resident_mut(&mut self, t: TensorId) -> Option<&mut TensorMem> {
        match self.slots.get_mut(t.index()).map(|s| &mut s.state) {
            Some(State::Resident(m)) => Some(m),
            _ => None,
        }
    }

    /// Switch the caller's CUDA stream (see [`ExecutorConfig::stream`]), e.g. before the first
    /// attach, or between iterations when the trainer moves to another stream.
    pub fn set_stream(&mut self, stream: Option<u64>) {
        self.cfg.stream = stream;
    }

    /// Take the trace's tensor sizes as upper bounds: memory attached to a tensor may be smaller
    /// than the trace says (not larger, not empty), and a prefetch or recomputation of it
    /// allocates the size attached. The budget still accounts the trace's sizes, so a plan made
    /// for a larger shape of the same iteration runs a smaller one within its budget (the
    /// teraio.torch runs a new input shape so while it profiles it). With
    /// `allocate_created`, created tensors get the trace's sizes.
    pub fn set_sizes_at_most(&mut self, at_most: bool) {
        self.sizes_at_most = at_most;
    }

    /// Whether tensor `t` is resident (memory granted).
    pub fn is_resident(&self, t: TensorId) -> bool {
        self.slots.get(t.index()).is_some_and(|s| s.state.is_resident())
    }

    fn bytes(&self, t: usize) -> u64 {
        self.trace.tensors[t].bytes
    }

    fn set_used(&mut self, used: u64) {
        self.used = used;
        self.report.peak_bytes = self.report.peak_bytes.max(used);
        let at = self.iteration_start.elapsed().as_secs_f64();
        self.report.memory_timeline.push((at, used));
    }

    fn tensor_index(&self, t: TensorId) -> Result<usize> {
        let i = t.index();
        if i < self.slots.len() {
            Ok(i)
        } else {
            Err(Error::InvalidArgument(format!(
                "tensor {t} is not in the trace ({} tensors)",
                self.slots.len()
            )))
        }
    }

    /// Enter safe mode: nothing more is offloaded, everything offloaded is read back. Returns
    /// the error the caller gets.
    fn diverge(&mut self, kernel: usize, detail: String) -> Error {
        let d = Divergence { kernel, detail };
        let err = Error::Diverged { kernel, detail: d.detail.clone() };
        if self.safe.is_none() {
            self.report.diverged = Some(d.clone());
            self.safe = Some(d);
            // Allocations queued are granted whatever the budget; tensors offloaded come back.
            for t in 0..self.slots.len() {
                match &mut self.slots[t].state {
                    State::Offloading { keep, .. } => *keep = true,
                    State::Offloaded => {
                        self.slots[t].state = State::QueuedPrefetch;
                        self.allocs.push_back(Alloc::Prefetch(t, Priority::Urgent));
                    }
                    // Dropped for recomputation: made again as soon as its inputs are back.
                    State::Dropped => self.allocs.push_back(Alloc::Remake(t)),
                    _ => {}
                }
            }
        }
        err
    }

    /// Hand tensor `t`'s memory to the executor: a global tensor before [`start`](Self::start),
    /// or a tensor its kernel created (after `before_kernel` of that kernel) when the executor
    /// does not allocate created tensors. The length must be the trace's.
    pub fn attach(&mut self, t: TensorId, mem: TensorMem) -> Result<()> {
        if self.safe.is_some() {
            // Nothing is planned any more: the caller keeps its memory.
            self.give_back(t, mem);
            return Ok(());
        }
        let i = self.tensor_index(t)?;
        let tensor = &self.trace.tensors[i];
        let fits = if self.sizes_at_most {
            !mem.is_empty() && mem.len() <= tensor.bytes
        } else {
            mem.len() == tensor.bytes
        };
        if !fits {
            let detail = format!(
                "tensor {t} ({}) has {} bytes, the trace {}{}",
                tensor.name,
                mem.len(),
                if self.sizes_at_most { "at most " } else { "" },
                tensor.bytes
            );
            self.give_back(t, mem);
            return Err(self.diverge(self.next_kernel, detail));
        }
        match (&self.slots[i].state, tensor.global) {
            (State::Absent, true) if self.phase == Phase::Setup => {
                self.used += tensor.bytes;
                self.slots[i].size = mem.len();
                self.slots[i].state = State::Resident(mem);
                if self.used > self.cfg.gpu_budget_bytes {
                    // The globals attached so far pass the budget: those the plan starts on a
                    // tier go there now, so a caller can attach globals that together never fit
                    // one at a time (each brought in, attached, and its memory given back).
                    self.settle_initial()?;
                }
                Ok(())
            }
            (State::Reserved, false) => {
                self.slots[i].size = mem.len();
                self.slots[i].state = State::Resident(mem);
                Ok(())
            }
            (State::Resident(_), _) => Err(Error::InvalidState {
                tensor: t.to_string(),
                detail: "it already has memory attached".into(),
            }),
            (_, true) => Err(Error::InvalidState {
                tensor: t.to_string(),
                detail: "global tensors are attached before start()".into(),
            }),
            (_, false) => Err(Error::InvalidState {
                tensor: t.to_string(),
                detail: format!(
                    "it is created by kernel {}: attach it after before_kernel({}) granted its memory",
                    tensor.alloc_kernel(),
                    tensor.alloc_kernel()
                ),
            }),
        }
    }

    /// Offload the global tensors the plan starts on a tier (waiting for the writes), check the
    /// rest fit the budget, and get ready for the first iteration.
    pub fn start(&mut self) -> Result<()> {
        if self.phase != Phase::Setup {
            return Err(Error::InvalidArgument("start() was called already".into()));
        }
        if let Some((i, t)) = self.trace.tensors.iter().enumerate().find(|(i, t)| {
            t.global && !matches!(self.slots[*i].state, State::Resident(_) | State::Offloaded)
        }) {
            return Err(Error::InvalidState {
                tensor: format!("t{i}"),
                detail: format!("global tensor {} has no memory attached before start()", t.name),
            });
        }
        self.settle_initial()?;
        if self.used > self.cfg.gpu_budget_bytes {
            let failed = self.slots.iter().filter(|s| s.stayed).count();
            return Err(Error::NoSpace(format!(
                "the resident global tensors need {} bytes, the GPU budget is {}{}",
                self.used,
                self.cfg.gpu_budget_bytes,
                if failed > 0 {
                    format!(
                        " ({failed} of them stayed because their first offload failed: see the store's errors)"
                    )
                } else {
                    String::new()
                }
            )));
        }
        self.debug_check_accounting();
        self.phase = Phase::Idle;
        Ok(())
    }

    /// Setup: offload the attached global tensors the plan starts on a tier (all issued, then
    /// waited for), their memory given back. One whose write fails stays resident (the plan's
    /// prefetch of it is then a no-op; `start` checks the budget).
    fn settle_initial(&mut self) -> Result<()> {
        let mut setup = Vec::new();
        for p in &self.plan.initially_offloaded {
            let t = p.tensor.index();
            if self.slots[t].stayed || !matches!(self.slots[t].state, State::Resident(_)) {
                continue; // (offloaded already, not attached yet, or its write failed before)
            }
            let State::Resident(mem) = std::mem::replace(&mut self.slots[t].state, State::Absent)
            else {
                unreachable!("matched as resident above")
            };
            let opts = OffloadOptions { destination: destination(p.tier), ..Default::default() };
            setup.push((t, self.offload_keep(t, mem, opts)?));
        }
        for (t, h) in setup {
            match h.wait() {
                Ok((outcome, mem)) => {
                    self.slots[t].current = stored(outcome);
                    self.give_back(TensorId(t as u32), mem);
                    self.used -= self.bytes(t);
                    self.slots[t].state = State::Offloaded;
                }
                // The write failed: the tensor stays (the plan's prefetch of it is a no-op);
                // the budget check below says whether memory allows it.
                Err(e) => {
                    let mem = self.store.take_held(key(t)).ok_or_else(|| Error::InvalidState {
                        tensor: format!("t{t}"),
                        detail: format!(
                            "its first offload failed ({e}) and the store did not hand its memory back"
                        ),
                    })?;
                    self.last_write_error = Some(e.to_string());
                    self.report.failed_offloads += 1;
                    self.slots[t].stayed = true;
                    self.slots[t].state = State::Resident(mem);
                }
            }
        }
        Ok(())
    }

    /// Debug builds: `used` is the sum of the trace sizes of the tensors that hold budget
    /// (memory granted, attached or reserved, or a migration in flight). O(tensors): checked
    /// once per iteration.
    fn debug_check_accounting(&self) {
        if cfg!(debug_assertions) {
            let held: u64 = self
                .slots
                .iter()
                .zip(&self.trace.tensors)
                .filter(|(s, _)| s.state.holds_budget())
                .map(|(_, t)| t.bytes)
                .sum();
            debug_assert_eq!(self.used, held, "GPU bytes accounted vs the tensors holding them");
        }
    }

    /// Debug builds: kernel `k` is about to run under the plan, so its tensors (accessed,
    /// created, inputs of its recomputations) are resident, and the memory accounted is within
    /// the budget (or within what the iteration started with, when a gather or a failed write
    /// left more: allocations wait for the budget, so that only shrinks).
    fn debug_check_kernel_runs(&self, k: usize) {
        if cfg!(debug_assertions) && self.safe.is_none() {
            for &t in self.needs[k].iter().chain(&self.creations[k]) {
                debug_assert!(
                    self.slots[t].state.is_resident(),
                    "kernel {k} runs without tensor {t} resident"
                );
            }
            let limit = self.cfg.gpu_budget_bytes.max(self.used_at_start);
            debug_assert!(
                self.used <= limit,
                "kernel {k} runs with {} GPU bytes accounted, over {limit}",
                self.used
            );
        }
    }

    fn begin_iteration(&mut self) {
        self.phase = Phase::Running;
        self.next_kernel = 0;
        self.after_next = 0;
        self.issued = 0;
        self.next_instr = 0;
        self.iteration_start = Instant::now();
        self.stats_before = self.store.stats();
        self.used_at_start = self.used;
        self.report = IterationReport {
            iteration: self.iteration,
            budget_bytes: self.cfg.gpu_budget_bytes,
            peak_bytes: self.used,
            memory_timeline: vec![(0.0, self.used)],
            diverged: self.safe.clone(),
            replanned: std::mem::take(&mut self.replanned),
            // Writes that failed in start() count in the first iteration.
            failed_offloads: if self.iteration == 0 { self.report.failed_offloads } else { 0 },
            ..Default::default()
        };
    }

    /// Check that the caller is at kernel `k` of the plan (starting an iteration at 0).
    fn at_kernel(&mut self, k: usize) -> Result<()> {
        if self.phase == Phase::Running && self.safe.is_none() && k >= self.next_kernel {
            self.end_left_out_kernels(self.next_kernel)?;
        }
        match self.phase {
            Phase::Setup => {
                Err(Error::InvalidArgument("call start() before the first kernel".into()))
            }
            Phase::Idle if k == 0 => {
                self.begin_iteration();
                Ok(())
            }
            _ if self.safe.is_some() => {
                if self.phase == Phase::Idle {
                    self.begin_iteration();
                }
                self.next_kernel = k;
                Ok(())
            }
            Phase::Idle => Err(self.diverge(
                k,
                format!("an iteration starts at kernel 0, the caller is at kernel {k}"),
            )),
            Phase::Running if k >= self.trace.kernels.len() => Err(self.diverge(
                k,
                format!(
                    "the trace has {} kernels, the caller is at kernel {k}",
                    self.trace.kernels.len()
                ),
            )),
            // The caller ran quiet kernels without calling: account them.
            Phase::Running if self.may_skip_to(k) => self.catch_up(k),
            Phase::Running if k + 1 < self.next_kernel || k > self.next_kernel => Err(self
                .diverge(
                    k,
                    format!(
                        "kernel {} was expected next, the caller is at kernel {k}",
                        self.next_kernel
                    ),
                )),
            Phase::Running => Ok(()),
        }
    }

    /// Issue the plan's instructions up to boundary `k` (kernel `k` about to run) and queue the
    /// memory of the tensors kernel `k` creates. Calling it again for the same `k` does nothing.
    pub fn boundary(&mut self, k: usize) -> Result<()> {
        self.at_kernel(k)?;
        if self.safe.is_some() {
            return Ok(());
        }
        if self.issued == 0 {
            self.scatter_gathered()?;
        }
        while self.issued <= k {
            let b = self.issued;
            self.issue(b)?;
            // Recomputed tensors get their memory first (inputs first), then the creations.
            for &t in &self.remakes[b] {
                if matches!(self.slots[t].state, State::Dropped) {
                    self.allocs.push_back(Alloc::Remake(t));
                }
            }
            for &t in &self.creations[b] {
                self.allocs.push_back(Alloc::Create(t));
            }
            self.issued += 1;
        }
        Ok(())
    }

    /// The plan's drops for recomputation at boundary `b` (after its instructions): the memory
    /// goes back at once, no copy is made (the producer makes the tensor again).
    fn drop_for_recompute(&mut self, b: usize) {
        for i in 0..self.drops[b].len() {
            let t = self.drops[b][i];
            // Only a resident tensor is dropped (an evicted one is already off the GPU; its
            // read-back makes it resident for the kernel that needs it).
            if !matches!(self.slots[t].state, State::Resident(_)) {
                continue;
            }
            let State::Resident(mem) = std::mem::replace(&mut self.slots[t].state, State::Dropped)
            else {
                unreachable!("checked above")
            };
            self.hand_back(t, mem);
        }
    }

    /// Run the recomputations due before kernel `k` (every pending one, inputs first, in safe
    /// mode): the allocator runs each producer on the caller's stream.
    fn remake(&mut self, k: usize) -> Result<()> {
        let list: Vec<usize> = if self.safe.is_some() {
            let mut v: Vec<usize> = (0..self.slots.len())
                .filter(|&t| matches!(self.slots[t].state, State::Remaking(_)))
                .collect();
            v.sort_by_key(|&t| self.trace.tensors[t].created_by);
            v
        } else {
            self.remakes[k].clone()
        };
        for t in list {
            if let State::Remaking(mut mem) =
                std::mem::replace(&mut self.slots[t].state, State::Absent)
            {
                if let Err(e) = self.alloc.recompute(TensorId(t as u32), &mut mem) {
                    return Err(self.recompute_failed(t, mem, e));
                }
                self.slots[t].state = State::Resident(mem);
                self.report.recomputations += 1;
            }
        }
        Ok(())
    }

    /// The caller left the plan at kernel `k` for a reason of its own (`detail`: an operator the
    /// trace does not have, a tensor of another size): safe mode from now on, as when
    /// [`boundary_named`](Self::boundary_named) finds another kernel name (nothing more is
    /// offloaded, everything offloaded comes back; [`diverged`](Self::diverged) and the
    /// iteration's report say where and why). After `start`; a second call keeps the first
    /// divergence.
    pub fn leave_plan(&mut self, k: usize, detail: &str) -> Result<()> {
        if self.phase == Phase::Setup {
            return Err(Error::InvalidArgument(format!(
                "leave_plan({k}) before start: there is no plan to leave yet"
            )));
        }
        if self.safe.is_none() {
            let _ = self.diverge(k, format!("the caller left the plan: {detail}"));
        }
        Ok(())
    }

    /// Like [`boundary`](Self::boundary), checking the caller's kernel name against the trace's.
    pub fn boundary_named(&mut self, k: usize, name: &str) -> Result<()> {
        if self.safe.is_none()
            && let Some(kernel) = self.trace.kernels.get(k)
            && kernel.name != name
        {
            let detail =
                format!("kernel {k} is `{}` in the trace, the caller runs `{name}`", kernel.name);
            return Err(self.diverge(k, detail));
        }
        self.boundary(k)
    }

    fn issue(&mut self, boundary: usize) -> Result<()> {
        while self.next_instr < self.plan.instructions.len()
            && self.plan.instructions[self.next_instr].issue_before_kernel == boundary
        {
            let ins = self.plan.instructions[self.next_instr];
            self.next_instr += 1;
            let t = ins.tensor.index();
            let priority = if ins.urgent { Priority::Urgent } else { Priority::Normal };
            match ins.op {
                Move::Offload { dest } => {
                    let clean = ins.is_clean_drop() && self.is_clean_in(t, dest);
                    if std::mem::take(&mut self.slots[t].evicted)
                        && !matches!(self.slots[t].state, State::Resident(_) | State::Reserved)
                    {
                        // The executor moved it out already.
                        continue;
                    }
                    match std::mem::replace(&mut self.slots[t].state, State::Absent) {
                        State::Resident(mem) => {
                            self.offload_or_drop(t, mem, dest, priority, clean)?
                        }
                        State::Reserved => {
                            self.slots[t].state = State::Reserved;
                            return Err(Error::InvalidState {
                                tensor: ins.tensor.to_string(),
                                detail: format!(
                                    "the plan offloads it at boundary {boundary}, but its memory was never attached"
                                ),
                            });
                        }
                        other => {
                            self.slots[t].state = other;
                            return Err(Error::InvalidArgument(format!(
                                "plan offloads tensor {t} at boundary {boundary} while it is not resident"
                            )));
                        }
                    }
                }
                Move::Prefetch => {
                    self.report.prefetches += 1;
                    let slot = &mut self.slots[t];
                    match &mut slot.state {
                        State::Offloading { keep, .. } => {
                            *keep = true;
                            self.report.kept_copies += 1;
                        }
                        State::Offloaded => {
                            slot.evicted = false;
                            slot.state = State::QueuedPrefetch;
                            self.allocs.push_back(Alloc::Prefetch(t, priority));
                        }
                        // Read back on demand already, after an eviction.
                        State::QueuedPrefetch | State::Prefetching(_) | State::Resident(_)
                            if slot.evicted =>
                        {
                            slot.evicted = false;
                        }
                        // Its offload failed earlier: it never left.
                        State::Resident(_) if slot.stayed => slot.stayed = false,
                        _ => {
                            return Err(Error::InvalidArgument(format!(
                                "plan prefetches tensor {t} at boundary {boundary} while it is not offloaded"
                            )));
                        }
                    }
                }
            }
        }
        self.drop_for_recompute(boundary);
        Ok(())
    }

    /// A migration of tensor `t` finished: take its result (a landed offload lets the memory go
    /// or keeps it, a landed prefetch makes the tensor resident; failures go to the recovery
    /// paths).
    fn collect(&mut self, t: usize) -> Result<()> {
        let id = TensorId(t as u32);
        match std::mem::replace(&mut self.slots[t].state, State::Absent) {
            State::Offloading { handle, keep } => match handle.wait() {
                Ok((outcome, mem)) if keep => {
                    self.slots[t].host_retried = false;
                    self.slots[t].current = stored(outcome);
                    self.slots[t].state = State::Resident(mem);
                }
                Ok((outcome, mem)) => {
                    self.slots[t].host_retried = false;
                    self.slots[t].current = stored(outcome);
                    self.let_go(t, mem);
                }
                Err(e) => {
                    // The write failed: the store holds the memory; the tensor stays.
                    let Some(mem) = self.store.take_held(key(t)) else {
                        return Err(Error::InvalidState {
                            tensor: id.to_string(),
                            detail: format!(
                                "its offload failed ({e}) and the store did not hand its memory back"
                            ),
                        });
                    };
                    self.offload_failed(t, keep, mem, &e)?;
                }
            },
            State::Prefetching(h) => match h.wait() {
                Ok(mem) => {
                    self.slots[t].attempts = 0;
                    self.slots[t].state = State::Resident(mem);
                    self.events.push_back(Event::Arrived(id));
                    // Read from the SSD array: that copy is current (a host-tier copy is
                    // not kept).
                    self.slots[t].current = self.has_copy(t);
                }
                Err(e) => self.prefetch_failed(t, e)?,
            },
            _ => unreachable!("poll collects only landed migrations"),
        }
        Ok(())
    }

    /// Collect finished migrations and grant waiting allocations, without blocking. Returns
    /// whether anything changed.
    pub fn poll(&mut self) -> Result<bool> {
        let mut changed = false;
        self.frees.retain(|h| !h.is_done());
        // In tensor order (the order `Arrived` events come in); a migration started while
        // collecting (an offload's retry) joins the ones still in flight.
        let mut flying = std::mem::take(&mut self.flying);
        flying.sort_unstable();
        let (landed, still): (Vec<usize>, Vec<usize>) =
            flying.into_iter().partition(|&t| match &self.slots[t].state {
                // An offload whose copy is queued on the device is done when the copy is.
                State::Offloading { handle, .. } => handle.is_done() && !handle.peek(copy_pending),
                State::Prefetching(h) => h.is_done(),
                _ => false,
            });
        self.flying = still;
        for (i, &t) in landed.iter().enumerate() {
            changed = true;
            if let Err(e) = self.collect(t) {
                // The ones not collected yet stay in flight for the next poll.
                self.flying.extend_from_slice(&landed[i + 1..]);
                return Err(e);
            }
        }
        while let Some(a) = self.allocs.front() {
            let t = a.tensor();
            let cap = self
                .gather_cap
                .map_or(self.cfg.gpu_budget_bytes, |c| c.max(self.cfg.gpu_budget_bytes));
            if self.safe.is_none() && self.used.saturating_add(self.bytes(t)) > cap {
                break;
            }
            let a = self.allocs.pop_front().expect("front exists");
            if matches!(a, Alloc::Create(_)) {
                self.slots[t].current = false;
            }
            match a {
                Alloc::Create(_) if self.cfg.allocate_created => {
                    let Some(mem) = self.try_alloc(a, self.bytes(t), AllocFor::Create)? else {
                        break;
                    };
                    self.slots[t].state = State::Resident(mem);
                }
                Alloc::Create(_) => self.slots[t].state = State::Reserved,
                Alloc::Remake(_) => {
                    let Some(mem) = self.try_alloc(a, self.slots[t].size, AllocFor::Recompute)?
                    else {
                        break;
                    };
                    self.slots[t].state = State::Remaking(mem);
                }
                Alloc::Prefetch(_, priority) => {
                    let Some(mem) = self.try_alloc(a, self.slots[t].size, AllocFor::Prefetch)?
                    else {
                        break;
                    };
                    let h = match (self.cfg.stream, mem.device().is_some()) {
                        (Some(stream), true) => {
                            self.store.prefetch_after_stream(key(t), mem, priority, stream)?
                        }
                        _ => self.store.prefetch(key(t), mem, priority)?,
                    };
                    self.flying.push(t);
                    self.slots[t].state = State::Prefetching(h);
                }
            }
            changed = true;
            self.set_used(self.used + self.bytes(t));
        }
        Ok(changed)
    }

    /// Memory from the caller's allocator for grant `a` (just taken from the queue's front).
    /// None where the allocator refuses it although the budget has room ([`Error::NoSpace`]
    /// outside safe mode): the grant goes back to the front and waits until memory goes back
    /// (`before_kernel` makes room).
    fn try_alloc(&mut self, a: Alloc, bytes: u64, why: AllocFor) -> Result<Option<TensorMem>> {
        match self.alloc.alloc(TensorId(a.tensor() as u32), bytes, why) {
            Ok(mem) => {
                self.refused = None;
                Ok(Some(mem))
            }
            Err(Error::NoSpace(words)) if self.safe.is_none() => {
                if self.refused.is_none() {
                    self.report.allocator_refusals += 1;
                }
                self.refused = Some((bytes, words));
                self.allocs.push_front(a);
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    fn ready(&self, k: usize) -> bool {
        if self.safe.is_some() {
            return self.allocs.is_empty()
                && !self.slots.iter().any(|s| {
                    matches!(
                        s.state,
                        State::Prefetching(_) | State::QueuedPrefetch | State::Offloading { .. }
                    )
                });
        }
        // A tensor remade before `k` counts once its memory is granted: `remake` runs its
        // producer (after the inputs, remade earlier in the list or resident).
        let ok = |t: usize| match &self.slots[t].state {
            State::Remaking(_) => self.remakes[k].contains(&t),
            s => s.is_resident(),
        };
        self.creations[k].iter().all(|&t| self.slots[t].state.is_resident())
            && self.needs[k].iter().all(|&t| ok(t))
            && self.remakes[k].iter().all(|&t| ok(t))
    }

    /// Non-blocking: issue boundary `k` if not yet, collect what finished, and say whether
    /// kernel `k` can run (its tensors resident, its new tensors' memory granted).
    pub fn kernel_ready(&mut self, k: usize) -> Result<bool> {
        if let Some(l) = &self.failed {
            if k != 0 {
                return Err(l.error());
            }
            // The caller starts the next iteration without ending the stopped one: end it here
            // (its report is dropped; `abort_iteration` returns it).
            self.abort_iteration()?;
        }
        self.boundary(k)?;
        if self.safe.is_none() {
            for i in 0..self.needs[k].len() {
                let t = self.needs[k][i];
                if matches!(self.slots[t].state, State::Offloaded) && self.slots[t].evicted {
                    self.report.demand_fetches += 1;
                    self.slots[t].state = State::QueuedPrefetch;
                    self.allocs.push_front(Alloc::Prefetch(t, Priority::Urgent));
                }
            }
        }
        self.poll()?;
        let ready = self.ready(k);
        if ready {
            self.order_caller_stream(k)?;
            self.remake(k)?;
            self.debug_check_kernel_runs(k);
        }
        if ready && self.safe.is_none() {
            self.next_kernel = k + 1;
        }
        Ok(ready)
    }

    /// Kernel `k` can run: make the caller's stream wait for the prefetches that brought its
    /// tensors (every resident tensor in safe mode), without blocking the host. A fence is
    /// waited on once, then cleared: later work on the stream is ordered after it.
    fn order_caller_stream(&mut self, k: usize) -> Result<()> {
        let Some(stream) = self.cfg.stream else { return Ok(()) };
        let all: Vec<usize>;
        let tensors: &[usize] = if self.safe.is_some() {
            all = (0..self.slots.len()).collect();
            &all
        } else {
            &self.needs[k]
        };
        for &t in tensors {
            if let State::Resident(TensorMem::Device(m)) = &mut self.slots[t].state
                && let Some(f) = m.ready()
            {
                f.wait_on_stream(stream)?;
                m.set_ready(None);
            }
        }
        Ok(())
    }

    /// Offload (keeping the memory) after the caller's stream's queued work, for device memory.
    fn offload_keep(
        &self,
        t: usize,
        mem: TensorMem,
        opts: OffloadOptions,
    ) -> Result<Handle<(OffloadOutcome, TensorMem)>> {
        match (self.cfg.stream, mem.device().is_some()) {
            (Some(stream), true) => {
                // A stream-ordered allocator takes memory back with its copies still queued:
                // then the copies to the host tier are queued on the device, no worker waits.
                let on_device = self.alloc.stream_ordered();
                self.store.offload_keep_after_stream(key(t), mem, opts, stream, on_device)
            }
            _ => self.store.offload_keep(key(t), mem, opts),
        }
    }

    /// Issue boundary `k` and wait until kernel `k` can run. Returns the time waited (the
    /// stall), also added to the iteration's report.
    pub fn before_kernel(&mut self, k: usize) -> Result<Duration> {
        let start = Instant::now();
        loop {
            if self.kernel_ready(k)? {
                break;
            }
            if let Some((need, _)) = &self.refused
                && self.allocs.front().is_some()
            {
                // The caller's allocator refused a grant the budget allows: what kernel `k`
                // does not use leaves (and comes back before its next use), then the grant is
                // tried again; with nothing left to move out and nothing in flight to free
                // memory, kernel `k` cannot start.
                let need = *need;
                if self.make_room(k, need)? > 0 {
                    continue;
                }
                if self.flying.is_empty() {
                    let (need, words) = self.refused.take().expect("refused");
                    return Err(Error::NoSpace(format!(
                        "GPU memory: kernel {k} ({}) cannot start: the caller's allocator refused \
                         {need} bytes ({words}) with {} of the budget's {} bytes accounted and \
                         nothing left to move out; the allocator needs more room beside the \
                         plan than the budget leaves (a smaller budget for the plan, or less \
                         memory held outside it)",
                        self.trace.kernels[k].name, self.used, self.cfg.gpu_budget_bytes,
                    )));
                }
            }
            if self.flying.is_empty() && self.allocs.is_empty() {
                // Nothing can change: only an earlier prefetch error or a plan the budget does
                // not allow would get here.
                let waiting: Vec<usize> = self.accesses[k]
                    .iter()
                    .chain(&self.creations[k])
                    .copied()
                    .filter(|&t| !self.slots[t].state.is_resident())
                    .collect();
                return Err(Error::InvalidState {
                    tensor: format!("{waiting:?}"),
                    detail: format!(
                        "kernel {k} waits for these tensors and nothing is in flight to bring them"
                    ),
                });
            }
            if self.flying.is_empty() && self.evict(k)? {
                continue;
            }
            if self.flying.is_empty() {
                let need = self.allocs.front().map_or(0, |a| self.bytes(a.tensor()));
                return Err(Error::NoSpace(format!(
                    "GPU budget: kernel {k} ({}) cannot start: {need} bytes wanted, {} of {} in use and nothing in flight to free any{}",
                    self.trace.kernels[k].name,
                    self.used,
                    self.cfg.gpu_budget_bytes,
                    self.stayed_note()
                )));
            }
            let need = self.allocs.front().map(|a| self.bytes(a.tensor()));
            let for_memory = need.is_some_and(|n| self.used + n > self.cfg.gpu_budget_bytes);
            if for_memory && self.release_queued_offloads(need.unwrap_or(0))? {
                continue;
            }
            let t = Instant::now();
            std::thread::sleep(Duration::from_micros(50));
            if for_memory {
                self.report.stall_memory_s += t.elapsed().as_secs_f64();
            }
        }
        let waited = start.elapsed();
        self.report.stall_s += waited.as_secs_f64();
        Ok(waited)
    }

    /// Whether tensor `t` can leave the GPU without a write: the store's SSD copy is current.
    fn is_clean(&self, t: usize) -> bool {
        self.is_clean_in(t, Tier::Ssd) || self.is_clean_in(t, Tier::Host)
    }

    /// Whether tensor `t` can leave the GPU without a write, its current copy being in `tier`.
    fn is_clean_in(&self, t: usize, tier: Tier) -> bool {
        self.slots[t].current && self.store.has_current_copy_in(key(t), destination(tier))
    }

    /// Tensor `t`'s copy is stored: its memory goes back to the allocator and it is offloaded.
    fn let_go(&mut self, t: usize, mem: TensorMem) {
        self.hand_back(t, mem);
        self.slots[t].state = State::Offloaded;
    }

    /// Memory goes back to the allocator once no engine copy uses it any more: device memory
    /// whose ready fence is pending (a prefetch still writing it, an offload's copy still
    /// reading it) first has the caller's stream ordered after that fence (a stream-ordered
    /// allocator) or the host waits for it.
    fn give_back(&mut self, t: TensorId, mut mem: TensorMem) {
        self.settle(&mut mem);
        self.alloc.release(t, mem);
    }

    /// No engine copy uses `mem` after this, in the order the allocator reuses memory: its
    /// pending ready fence is waited for on the caller's stream (a stream-ordered allocator) or
    /// on the host, then cleared.
    fn settle(&self, mem: &mut TensorMem) {
        if let TensorMem::Device(d) = mem {
            if let Some(f) = d.ready()
                && !f.is_done()
            {
                let on_stream = match self.cfg.stream {
                    Some(s) if self.alloc.stream_ordered() => f.wait_on_stream(s).is_ok(),
                    _ => false,
                };
                if !on_stream && let Err(e) = f.wait() {
                    crate::notice::error(format!(
                        "waiting for a copy before memory goes back failed: {e}"
                    ));
                }
            }
            d.set_ready(None);
        }
    }

    /// Offloads whose copies are queued on the device (their handles done, the copies maybe
    /// not) hand their memory back now, in tensor order until `need` more bytes fit the budget,
    /// the caller's stream ordered after each copy: the host goes on instead of waiting for the
    /// GPU to reach the copies. Only with a caller stream and a stream-ordered allocator.
    /// Returns whether any did.
    fn release_queued_offloads(&mut self, need: u64) -> Result<bool> {
        if self.cfg.stream.is_none() || !self.alloc.stream_ordered() {
            return Ok(false);
        }
        let mut freed = 0;
        // Offloads are in flight: only those tensors, in tensor order.
        let mut flying = self.flying.clone();
        flying.sort_unstable();
        for t in flying {
            if self.used - freed + need <= self.cfg.gpu_budget_bytes {
                break;
            }
            if !matches!(&self.slots[t].state, State::Offloading { handle, keep: false } if handle.is_done())
            {
                continue;
            }
            if self.settle_offload(t) {
                freed += self.bytes(t);
            }
        }
        if freed > 0 {
            self.report.released_on_stream_bytes += freed;
            self.poll()?;
        }
        Ok(freed > 0)
    }

    /// Tensor `t`'s memory goes back to the allocator (`Released`), off the budget.
    fn hand_back(&mut self, t: usize, mem: TensorMem) {
        let id = TensorId(t as u32);
        self.give_back(id, mem);
        self.events.push_back(Event::Released(id));
        self.set_used(self.used - self.bytes(t));
    }

    /// Move resident tensor `t` (its memory `mem`) to `tier`: dropped at once when `clean` (the
    /// store's copy there is current), else written, its memory released when stored.
    fn offload_or_drop(
        &mut self,
        t: usize,
        mem: TensorMem,
        tier: Tier,
        priority: Priority,
        clean: bool,
    ) -> Result<()> {
        if clean {
            self.let_go(t, mem);
            self.report.clean_drops += 1;
            return Ok(());
        }
        let opts = OffloadOptions { destination: destination(tier), priority, name: None };
        let handle = self.offload_keep(t, mem, opts)?;
        self.flying.push(t);
        self.report.offloads += 1;
        self.slots[t].state = State::Offloading { handle, keep: false };
        Ok(())
    }

    /// Whether the store holds a current copy of `t` (SSD, or a host-tier copy a retaining
    /// store keeps after a prefetch).
    fn has_copy(&self, t: usize) -> bool {
        self.store.has_current_copy_in(key(t), Destination::Ssd)
            || self.store.has_current_copy_in(key(t), Destination::Host)
    }

    /// Nothing in flight will free the memory the first waiting allocation needs: move out the
    /// resident tensor kernel `k` does not use whose next use is furthest (without writing when
    /// the store's copy is current), and read it back after. Returns whether it did.
    fn evict(&mut self, k: usize) -> Result<bool> {
        let Some(t) = self.victim(k) else { return Ok(false) };
        self.evict_tensor(t, Destination::default())?;
        Ok(true)
    }

    /// Evict resident tensor `t`: let go at once when the store's copy is current, else
    /// offloaded urgently to `destination` (the tensor comes back on demand before its next
    /// use). Returns whether an offload started.
    fn evict_tensor(&mut self, t: usize, destination: Destination) -> Result<bool> {
        let State::Resident(mem) = std::mem::replace(&mut self.slots[t].state, State::Absent)
        else {
            unreachable!("an evicted tensor is resident")
        };
        self.report.evictions += 1;
        self.slots[t].evicted = true;
        if self.is_clean(t) {
            self.let_go(t, mem);
            return Ok(false);
        }
        let opts = OffloadOptions { destination, priority: Priority::Urgent, name: None };
        let handle = self.offload_keep(t, mem, opts)?;
        self.flying.push(t);
        self.slots[t].state = State::Offloading { handle, keep: false };
        Ok(true)
    }

    /// The caller's allocator ran out of memory running kernel `k` although the budget says its
    /// tensors fit (a caching allocator's rounding and scattered blocks, memory the trace does not
    /// see): move resident tensors kernel `k` does not use out of GPU memory, the furthest next
    /// use first, until at least `bytes` went back to the allocator or none is left. They go to
    /// the host tier when the store has one (else the SSD array) and come back on demand before
    /// their next use, as the executor's own evictions do. Returns the bytes handed back (0 in
    /// safe mode or before the first kernel: nothing is planned to move).
    pub fn make_room(&mut self, k: usize, bytes: u64) -> Result<u64> {
        if self.safe.is_some() || self.phase != Phase::Running || k >= self.trace.kernels.len() {
            return Ok(0);
        }
        let before = self.used;
        let mut moving = Vec::new();
        let mut freed = 0;
        let destination =
            if self.store.has_host_tier() { Destination::Host } else { Destination::Ssd };
        while freed < bytes {
            let Some(t) = self.victim(k) else { break };
            self.report.made_room += 1;
            freed += self.bytes(t);
            if self.evict_tensor(t, destination)? {
                moving.push(t);
            }
        }
        // The memory goes back now: once each offload is queued (or written; `settle_offload`
        // waits for its handle), the caller's stream ordered after its copy, or the host
        // waiting for it.
        for t in moving {
            self.settle_offload(t);
        }
        self.poll()?;
        Ok(before.saturating_sub(self.used))
    }

    /// Tensor `t`'s offload, its handle done: the memory it hands back no longer waits for its
    /// copy ([`settle`](Self::settle)), so the next poll lets it go. Returns whether the offload
    /// stored the tensor (a failed one keeps it, as a poll then says).
    fn settle_offload(&mut self, t: usize) -> bool {
        let State::Offloading { handle, keep } =
            std::mem::replace(&mut self.slots[t].state, State::Absent)
        else {
            unreachable!("an offload is settled while it is in flight")
        };
        let mut r = handle.wait();
        if let Ok((_, mem)) = &mut r {
            self.settle(mem);
        }
        let stored = r.is_ok();
        self.slots[t].state = State::Offloading { handle: Handle::ready(r), keep };
        stored
    }

    /// The resident tensor kernel `k` does not use whose next use is furthest (not one whose
    /// write just failed: it would fail again, and again).
    fn victim(&self, k: usize) -> Option<usize> {
        let n = self.trace.kernels.len();
        let needed = |t: usize| self.accesses[k].contains(&t) || self.creations[k].contains(&t);
        let next_use = |t: usize| {
            let acc = &self.trace.tensors[t].accesses;
            match acc.iter().find(|&&a| a > k) {
                Some(&a) => a - k,
                None => acc.first().map_or(n, |&a| a + n - k),
            }
        };
        (0..self.slots.len())
            .filter(|&t| {
                matches!(self.slots[t].state, State::Resident(_))
                    && !needed(t)
                    && !self.slots[t].stayed
            })
            .max_by_key(|&t| next_use(t))
    }

    /// Kernel `k` ran: the tensors whose last use it was die (their memory goes back to the
    /// allocator). `k` is the kernel `before_kernel`/`kernel_ready` last said could run, once:
    /// a kernel outside the trace, one that was not readied, or one already ended is
    /// [`Error::InvalidArgument`] (in safe mode only the range is checked). A caller may leave
    /// it out: the kernel then ends when the next one is readied or the iteration ends.
    pub fn after_kernel(&mut self, k: usize) -> Result<()> {
        let n = self.deaths.len();
        if k >= n {
            return Err(Error::InvalidArgument(format!(
                "after_kernel({k}): the trace has {n} kernels (0 to {})",
                n.saturating_sub(1)
            )));
        }
        if self.safe.is_some() {
            return Ok(());
        }
        if self.phase != Phase::Running || k + 1 != self.next_kernel || k < self.after_next {
            let expected = match self.next_kernel.checked_sub(1) {
                Some(last) if self.phase == Phase::Running && last >= self.after_next => {
                    format!("kernel {last}, the one before_kernel/kernel_ready last readied")
                }
                _ => "none: call before_kernel (or kernel_ready) for the next kernel first"
                    .to_string(),
            };
            return Err(Error::InvalidArgument(format!(
                "after_kernel({k}) out of order: expected {expected}"
            )));
        }
        self.kernel_ended(k)
    }

    /// Kernel `k` ran (checked by the caller): its writes make the store's copies stale, the
    /// tensors whose last use it was die.
    fn kernel_ended(&mut self, k: usize) -> Result<()> {
        self.after_next = k + 1;
        for &t in &self.accesses[k] {
            if self.trace.tensors[t].writes_at(k) {
                self.slots[t].current = false;
            }
        }
        for i in 0..self.deaths[k].len() {
            let t = self.deaths[k][i];
            self.release(t)?;
        }
        Ok(())
    }

    /// The kernels readied before `upto` whose `after_kernel` the caller left out ran (the
    /// caller is past them: at a later kernel, or at the iteration's end): they end now, so
    /// that what died in them is released before their tensors are made again.
    fn end_left_out_kernels(&mut self, upto: usize) -> Result<()> {
        for j in self.after_next..upto.min(self.next_kernel) {
            self.kernel_ended(j)?;
        }
        Ok(())
    }

    fn release(&mut self, t: usize) -> Result<()> {
        let id = TensorId(t as u32);
        match std::mem::replace(&mut self.slots[t].state, State::Absent) {
            State::Resident(mem) => self.hand_back(t, mem),
            State::Reserved => self.set_used(self.used - self.bytes(t)),
            State::Remaking(mem) => {
                self.give_back(id, mem);
                self.set_used(self.used - self.bytes(t));
            }
            State::Absent | State::Offloaded => {}
            // Dropped for recomputation (a remake may be queued, in safe mode): nothing to make.
            State::Dropped => self.allocs.retain(|a| a.tensor() != t),
            // Off the GPU at its death (evicted by the executor): nothing comes back.
            State::QueuedPrefetch => {
                self.allocs.retain(|a| a.tensor() != t);
            }
            State::Offloading { handle, .. } => {
                self.flying.retain(|&x| x != t);
                if let Ok((_, mem)) = handle.wait() {
                    self.give_back(id, mem);
                }
                self.events.push_back(Event::Released(id));
                self.set_used(self.used - self.bytes(t));
            }
            State::Prefetching(h) => {
                self.flying.retain(|&x| x != t);
                if let Ok(mem) = h.wait() {
                    self.give_back(id, mem);
                }
                self.set_used(self.used - self.bytes(t));
            }
        }
        self.slots[t].evicted = false;
        if !self.trace.tensors[t].global {
            self.free_copy(t);
        }
        Ok(())
    }

    /// Tensor `t` was freed by the caller before the trace says it dies: release it now.
    pub fn free(&mut self, t: TensorId) -> Result<()> {
        let i = self.tensor_index(t)?;
        if self.safe.is_some() {
            return Ok(());
        }
        self.release(i)
    }

    /// The iteration ended: issue the end-of-iteration instructions and return its report.
    pub fn end_iteration(&mut self) -> Result<IterationReport> {
        let n = self.trace.kernels.len();
        if self.phase != Phase::Running {
            return Err(Error::InvalidArgument(
                "end_iteration() without an iteration (call before_kernel(0) first)".into(),
            ));
        }
        if let Some(l) = &self.failed {
            return Err(l.error());
        }
        if self.safe.is_none() {
            self.end_left_out_kernels(self.next_kernel)?;
        }
        if self.safe.is_none() && self.may_skip_to(n) {
            self.catch_up(n)?;
        }
        if self.safe.is_none() && self.next_kernel != n {
            let detail = format!(
                "the iteration ended after {} kernels, the trace has {n}",
                self.next_kernel
            );
            let err = self.diverge(self.next_kernel, detail);
            self.finish_iteration();
            return Err(err);
        }
        if self.safe.is_none() {
            while self.issued < n {
                let b = self.issued;
                self.issue(b)?;
                self.issued += 1;
            }
            self.issue(n)?;
        }
        self.poll()?;
        self.debug_check_accounting();
        Ok(self.finish_iteration())
    }

    fn finish_iteration(&mut self) -> IterationReport {
        self.phase = Phase::Idle;
        self.iteration += 1;
        let mut report = std::mem::take(&mut self.report);
        report.time_s = self.iteration_start.elapsed().as_secs_f64();
        report.diverged = self.safe.clone();
        report.store = diff_stats(&self.stats_before, &self.store.stats());
        report
    }

    /// Wait for the migrations in flight, then free every copy the store holds of the trace's
    /// tensors. Resident tensors' memory goes back to the allocator.
    pub fn finish(mut self) -> Result<()> {
        while !self.flying.is_empty() || !self.allocs.is_empty() {
            let before = (self.flying.len(), self.allocs.len());
            match self.poll() {
                // A copy that cannot be read is freed below like every other.
                Err(Error::TensorLost { .. }) => {}
                r => {
                    r?;
                }
            }
            if self.flying.is_empty() && (self.flying.len(), self.allocs.len()) == before {
                break;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        for h in std::mem::take(&mut self.frees) {
            h.wait()?;
        }
        for t in 0..self.slots.len() {
            if let State::Resident(mem) | State::Remaking(mem) =
                std::mem::replace(&mut self.slots[t].state, State::Absent)
            {
                self.give_back(TensorId(t as u32), mem);
            }
            if self.store.info(key(t)).is_some()
                && let Ok(h) = self.store.free(key(t))
            {
                h.wait()?;
            }
        }
        Ok(())
    }
}

/// Whether an offload's result is memory that an engine copy queued on the device still reads.
fn copy_pending(r: Option<&Result<(OffloadOutcome, TensorMem)>>) -> bool {
    match r {
        Some(Ok((_, TensorMem::Device(d)))) => d.ready().is_some_and(|f| !f.is_done()),
        _ => false,
    }
}
