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
//! - [`tier`]: memory tiers (host now, CUDA behind a feature later) behind one trait.
//! - [`store`]: the tensor store (location table, checksums, persistent metadata).
//! - [`migrate`]: the asynchronous migration engine executing offloads and prefetches.
//! - [`runtime`]: replays a training iteration under a scheduler plan on the real engine.

pub mod array;
pub mod backend;
pub mod device;
mod engine;
mod error;
pub mod gpucrc;
pub mod migrate;
pub mod pool;
pub mod runtime;
pub mod store;
pub mod tier;
pub mod units;

pub use engine::{BackendName, Engine, EngineConfig, Overwrite, parse_size};
pub use error::{Error, Result};
