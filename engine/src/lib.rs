//! teraio's engine: everything that touches bytes.
//!
//! Front ends open an [`Engine`] from an [`EngineConfig`] (code, TOML or JSON): the array, the
//! tensor store, the host tier and host buffers in one call. Below it:
//!
//! - [`backend`]: how I/O is submitted and completed (io_uring, psync, sim). Backends only
//!   submit and complete; they do not know tensors.
//! - [`device`] and [`array`]: where bytes live: opening targets, block sizes, the overwrite
//!   guard, and striped tensor reads/writes over the layout's stripe map.
//! - [`pool`]: huge-page backed, aligned host buffers that I/O can use directly.
//! - [`tier`]: memory tiers behind one trait: host memory, device memory (CUDA, or its host
//!   emulation for tests) with the traits the GPU data paths need.
//! - `cuda` (feature `cuda`, on by default; libraries loaded at run time): the CUDA tier, the
//!   GPU crc32c kernel and GPUDirect Storage (cuFile).
//! - [`store`]: the tensor store (location table, checksums, persistent metadata) and its
//!   migration engine (the worker threads that run each tensor's queued requests:
//!   `store::Inner::run_one`).
//! - [`queue`]: what the store's workers are fed by and hand back: priorities, the priority
//!   queues, the in-flight byte budget, completion [`queue::Handle`]s, statistics types.
//! - [`executor`]: executes a scheduler plan for a trainer that drives it (any front end).
//! - [`optim`]: host-side optimizer steps (AdamW, Adam, SGD) over float32 buffers, with
//!   PyTorch's semantics, SIMD and multi-threaded.
//! - [`probe`]: measures the machine under an engine (array, host copies, GPU copies) into the
//!   scheduler's hardware model, cached per machine and array.
//! - [`replay`]: replays a training iteration under a scheduler plan on the real engine.

pub mod array;
pub mod backend;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
mod engine;
mod error;
pub mod executor;
pub mod gpucrc;
pub mod notice;
pub mod optim;
pub mod pool;
pub mod probe;
pub mod queue;
pub mod replay;
pub mod store;
pub mod tier;
pub mod units;

pub use engine::{BackendName, Engine, EngineConfig, GpuConfig, Overwrite, parse_size};
pub use error::{Error, Result};
pub use executor::{Executor, ExecutorConfig};
