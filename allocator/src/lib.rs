//! teraio's extent allocator (pure). See `ExtentAllocator` and `ArrayAllocator`.
#![forbid(unsafe_code)]

mod error;
pub use error::{Error, Result};
