//! teraio's scheduler (pure): traces, lifetime analysis, planners and the simulator.
#![forbid(unsafe_code)]

mod error;

pub use error::{Error, Result};
