//! teraio's scheduler (pure): traces, lifetime analysis, planners and the simulator.
//!
//! Traces in, plans and reports out; no I/O. The pieces:
//! - [`Trace`]: one training iteration (kernels = the clock, tensors with their accesses);
//!   JSON schema in `docs/TRACE.md`. [`model::generate`] makes synthetic transformer traces.
//! - [`analysis`]: active/inactive intervals and the paper's characterization.
//! - [`planner::plan`]: policies `auto` (the default: the fastest of several `teraio`
//!   variants, with recomputation, writing the fewest SSD bytes within 1% of the fastest),
//!   `teraio` (the paper's Algorithm 1), `teraio-hybrid`, `g10`, `zero-infinity`, `lru`,
//!   `ideal`, `none`, all producing a [`Plan`]; [`plan_checked`] refuses a plan that cannot
//!   run (GPU memory below the largest working set, out of memory, tiers too small).
//! - [`select::choose`]: plan selection, the one entry point of the front ends (CLI, C ABI,
//!   teraio.torch): the budget and its allowance, working-set checks, the policy's checked
//!   plan, the second plan for slower transfers, and the pager's schedule as a fallback.
//! - [`checkpoint::choose_layers`]: which layers to checkpoint (their forward run again in
//!   backward) so that the selected plan of the rest simulates fastest; [`checkpoint::rewrite`]
//!   makes the trace checkpointing those layers gives.
//! - [`bound::lower_bound`]: no plan's iteration is faster than this.
//! - [`sim::simulate`]: discrete-event replay of a plan on a [`Hardware`] model.
//! - [`optimizer::place`]: which parameters' optimizer updates run on the host CPU instead
//!   of the GPU, by simulated cost.
//! - [`advise`]: the fewest SSDs / least host memory that reach a target % of ideal.
//! - [`fsdp`]: FSDP2 over N ranks, one SSD array each: one rank's iteration under teraio
//!   against the ideal and FSDP2's `CPUOffloadPolicy`.
//!
//! ```
//! use teraio_scheduler::{Hardware, ModelConfig, Policy, SimOptions, generate, plan, simulate};
//! let mut cfg = ModelConfig::preset("gpt2-small").unwrap();
//! cfg.micro_batch = 2;
//! let trace = generate(&cfg).unwrap();
//! let mut hw = Hardware::paper();
//! hw.gpu_memory_bytes = 2_500_000_000; // squeeze it so the planner has work to do
//! let p = plan(&trace, &hw, Policy::Teraio).unwrap();
//! p.validate(&trace).unwrap();
//! let report = simulate(&trace, &p, &hw, &SimOptions::default()).unwrap();
//! assert!(report.peak_gpu_bytes <= hw.gpu_memory_bytes);
//! assert!(report.percent_of_ideal > 0.0);
//! ```
#![forbid(unsafe_code)]

pub mod advise;
pub mod analysis;
pub mod bound;
pub mod checkpoint;
mod error;
pub mod fsdp;
pub mod hardware;
pub mod model;
pub mod optimizer;
pub mod plan;
pub mod planner;
pub mod select;
pub mod sim;
pub mod trace;

pub use bound::{Bound, BoundWindow, lower_bound, lower_bound_for, lower_bound_windows};
pub use error::{Error, Result};
pub use hardware::{Hardware, Resource, Tier};
pub use model::{Dtype, FsdpCpuOffload, Gpu, ModelConfig, generate};
pub use plan::{
    HostKernel, HostUpdate, InitialPlacement, Instruction, Move, Plan, PlanStats, Recompute,
};
pub use planner::{Checked, PlanOptions, Policy, plan, plan_checked, plan_with};
pub use select::{Allowance, Budget, Budgets, Choice, SelectOptions, Selection, choose};
pub use sim::{Outcome, SimOptions, SimReport, simulate};
pub use trace::{
    Kernel, Producer, TRACE_TEXT_BYTES_MAX, TRACE_TEXT_BYTES_MAX_ENV, Tensor, TensorId, TensorKind,
    Trace, trace_text_bytes_max,
};
