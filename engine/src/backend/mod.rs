//! How I/O is submitted and completed: io_uring ([`uring`]), pread/pwrite on a thread pool
//! ([`psync`]), an in-memory simulated device ([`sim`]) and, with the `spdk` feature, SPDK's
//! userspace NVMe driver and bdevs (`spdk`; its target syntax and options in [`spdk_config`]).
//!
//! A backend knows devices only by index and knows nothing of tensors or stripes: the device
//! array ([`crate::array`]) turns tensor ranges into [`IoRequest`]s. Every backend honours the
//! same contract, checked by one conformance suite (`tests/io_conformance.rs`):
//!
//! - [`Backend::submit`] never blocks for long; the request runs asynchronously.
//! - The request's completion is called exactly once, from a backend thread, after the kernel
//!   (or the simulator) has finished with the request's memory, with `Ok(())` only when every
//!   byte moved. Short transfers are resumed; a transfer that moves zero bytes fails with
//!   [`IoFailure::Short`].
//! - The memory named by the iovecs stays valid until the completion has run (the owner of the
//!   memory travels inside the completion; see [`IoRequest::new`]).
//! - Dropping a backend waits for every request in flight and completes every queued one.

pub mod psync;
pub mod sim;
#[cfg(feature = "spdk")]
pub mod spdk;
pub mod spdk_config;
pub mod uring;

use std::fmt;

use crate::pool::Registration;

/// Direction of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IoDirection {
    /// Device to memory.
    Read,
    /// Memory to device.
    Write,
}

impl IoDirection {
    /// "read" or "write".
    pub fn name(self) -> &'static str {
        match self {
            IoDirection::Read => "read",
            IoDirection::Write => "write",
        }
    }
}

/// Why a request failed.
#[derive(Debug)]
pub enum IoFailure {
    /// The system call (or the simulator) returned an error.
    Os(std::io::Error),
    /// The device moved `done` bytes of `len` and then no more (end of device).
    Short {
        /// Bytes moved.
        done: u64,
        /// Bytes asked.
        len: u64,
    },
}

impl fmt::Display for IoFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IoFailure::Os(e) => write!(f, "{e}"),
            IoFailure::Short { done, len } => write!(f, "short transfer: {done} of {len} bytes"),
        }
    }
}

/// The callback that ends a request. Called exactly once, on a backend thread; it must not
/// block for long (it runs on the I/O thread).
pub type Completion = Box<dyn FnOnce(Result<(), IoFailure>) + Send>;

/// One piece of memory of a request.
#[derive(Debug, Clone, Copy)]
pub struct IoVec {
    /// Start of the piece.
    pub ptr: *mut u8,
    /// Length in bytes.
    pub len: usize,
}

/// One device-contiguous transfer gathered from (or scattered to) memory pieces.
pub struct IoRequest {
    kind: IoDirection,
    device: usize,
    offset: u64,
    iovecs: Vec<IoVec>,
    completion: Completion,
    registration: Option<Registration>,
}

// SAFETY: the raw pointers name memory whose owner is kept alive by `completion` (contract of
// `IoRequest::new`); that memory is not touched by anyone else while the request is in flight.
unsafe impl Send for IoRequest {}

impl fmt::Debug for IoRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoRequest")
            .field("kind", &self.kind)
            .field("device", &self.device)
            .field("offset", &self.offset)
            .field("len", &self.len())
            .field("pieces", &self.iovecs.len())
            .finish()
    }
}

impl IoRequest {
    /// Build a request.
    ///
    /// # Safety
    /// Every iovec must name memory that stays valid, and that nobody else reads or writes
    /// (writes: nobody else writes), until `completion` has been called or dropped. The usual
    /// way: `completion` owns the buffer (directly or through an `Arc`).
    pub unsafe fn new(
        kind: IoDirection,
        device: usize,
        offset: u64,
        iovecs: Vec<IoVec>,
        completion: Completion,
    ) -> Self {
        Self { kind, device, offset, iovecs, completion, registration: None }
    }

    /// Name the registered mapping every iovec lies in (lets io_uring use fixed buffers).
    ///
    /// # Safety
    /// Every iovec must lie inside `[registration.base, registration.base + registration.len)`,
    /// a mapping that stays valid as long as the iovecs' memory (contract of [`Self::new`]).
    pub unsafe fn set_registration(&mut self, registration: Option<Registration>) {
        self.registration = registration;
    }

    /// The registered mapping the iovecs lie in, if known.
    pub fn registration(&self) -> Option<Registration> {
        self.registration
    }

    /// Direction.
    pub fn kind(&self) -> IoDirection {
        self.kind
    }

    /// Device index within the backend.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Device offset of the first byte.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Total bytes.
    pub fn len(&self) -> u64 {
        self.iovecs.iter().map(|v| v.len as u64).sum()
    }

    /// Whether the request moves no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The memory pieces.
    pub fn iovecs(&self) -> &[IoVec] {
        &self.iovecs
    }

    /// End the request.
    pub fn complete(self, result: Result<(), IoFailure>) {
        (self.completion)(result)
    }
}

/// Submits and completes I/O on a fixed set of devices.
pub trait Backend: Send + Sync {
    /// Short name ("uring", "psync", "sim", "spdk").
    fn name(&self) -> &'static str;
    /// Start a request. Requests for a device index the backend does not have complete with an
    /// error. The completion may run before this returns.
    fn submit(&self, request: IoRequest);
    /// Durability barrier for one device: every write whose completion has run is durable when
    /// this returns `Ok` (fdatasync; the simulator's flush).
    fn flush(&self, device: usize) -> std::io::Result<()>;
    /// Requests so far that used a registered (fixed) buffer; 0 for backends without them.
    fn fixed_buffer_ops(&self) -> u64 {
        0
    }
    /// Buffer-table entries (over all rings) that hold a mapping now; 0 for backends without
    /// registered buffers. An entry pins its memory in the kernel.
    fn registered_buffers(&self) -> u64 {
        0
    }
}

/// Skip `done` bytes of a list of iovecs (for resuming short transfers).
pub(crate) fn advance_iovecs(iovecs: &mut Vec<IoVec>, mut done: usize) {
    let mut drop_count = 0;
    for v in iovecs.iter_mut() {
        if done == 0 {
            break;
        }
        if done >= v.len {
            done -= v.len;
            drop_count += 1;
        } else {
            // SAFETY: `done < v.len`, so the new pointer stays inside the same piece.
            v.ptr = unsafe { v.ptr.add(done) };
            v.len -= done;
            done = 0;
        }
    }
    iovecs.drain(..drop_count);
}

/// A simple device-count check shared by the backends.
pub(crate) fn bad_device(device: usize, count: usize) -> IoFailure {
    IoFailure::Os(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("device index {device} out of range (backend has {count})"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advance_skips_whole_and_partial_pieces() {
        let mut mem = [0u8; 64];
        let base = mem.as_mut_ptr();
        let mut v =
            vec![IoVec { ptr: base, len: 16 }, IoVec { ptr: base.wrapping_add(32), len: 32 }];
        advance_iovecs(&mut v, 20);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].ptr, base.wrapping_add(36));
        assert_eq!(v[0].len, 28);
        advance_iovecs(&mut v, 28);
        assert!(v.is_empty());
    }
}
