//! Device memory (GPU memory) behind traits, so the store's GPU data paths (the pinned-bounce
//! pipeline and GPUDirect Storage, `store::gpu`) are written once and tested on any machine:
//!
//! - [`DeviceMemory`]: one tensor's device allocation (pointer, length, its device).
//! - [`GpuDevice`]: what the data paths need from a device: in-order copy queues between
//!   device and pinned host memory ([`CopyQueue`], a CUDA stream), fences ([`DeviceFence`], a
//!   CUDA event), page-locking host memory, crc32c computed on the device, and direct storage
//!   ([`DirectStorage`], cuFile).
//!
//! Two implementations: CUDA (`crate::cuda`, behind the `cuda` feature) and [`HostDevice`](super::HostDevice) (`tier/host_device.rs`), an
//! emulated device whose "device memory" is host memory. The emulation runs the very same
//! pipeline code (chunking, double buffering, checksums, tail handling, stripe segments) so CI
//! tests it without a GPU; its crc32c runs the CPU mirror of the GPU kernel's algorithm
//! ([`crate::gpucrc`]), and its direct storage does pread/pwrite on the array's files.

use std::any::Any;
use std::path::PathBuf;
use std::sync::Arc;

use crate::{Error, Result};

/// A point in a device queue: the work queued before it (copies, kernels) has finished once the
/// fence completes. A CUDA event.
pub trait DeviceFence: Send + Sync {
    /// Block the calling thread until the work before the fence has finished.
    fn wait(&self) -> Result<()>;
    /// Whether the work before the fence has finished (never blocks).
    fn is_done(&self) -> bool;
    /// Make work queued later on `stream` (a `CUstream` handle as an integer; 0 is the legacy
    /// default stream) wait for the fence, without blocking the host.
    fn wait_on_stream(&self, stream: u64) -> Result<()>;
}

/// An in-order queue of copies between device memory and host memory (a CUDA stream). Copies
/// are asynchronous: the memory they touch must stay valid until a later fence completes.
pub trait CopyQueue: Send {
    /// Queue a copy of `len` bytes from device address `src` to host memory `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes until a fence queued after this call has
    /// completed, and `[src, src + len)` must lie in one live device allocation.
    unsafe fn device_to_host(&mut self, src: u64, dst: *mut u8, len: usize) -> Result<()>;
    /// Queue a copy of `len` bytes from host memory `src` to device address `dst`.
    ///
    /// # Safety
    /// `src` must be valid for reads of `len` bytes until a fence queued after this call has
    /// completed, and `[dst, dst + len)` must lie in one live device allocation.
    unsafe fn host_to_device(&mut self, src: *const u8, dst: u64, len: usize) -> Result<()>;
    /// A fence after everything queued so far.
    fn fence(&mut self) -> Result<Box<dyn DeviceFence>>;
    /// Make copies queued later on this queue wait until `fence` completes, without blocking
    /// the host (CUDA: cuStreamWaitEvent on the queue's stream).
    fn wait_for(&mut self, fence: &dyn DeviceFence) -> Result<()>;
    /// Wait on the host until everything queued so far has run (CUDA: cuStreamSynchronize):
    /// the way out when a copy is queued and no fence of it can be made.
    fn drain(&mut self) -> Result<()>;
}

/// Which way the copies of a queue go ([`GpuDevice::copy_queue_toward`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyWay {
    /// Host memory to device memory (prefetches).
    ToDevice,
    /// Device memory to host memory (offloads).
    ToHost,
}

/// How direct storage reaches the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DirectMode {
    /// Peer to peer: the disk's DMA reaches GPU memory (cuFile with nvidia-fs).
    P2p,
    /// cuFile's compatibility mode: the real cuFile API, POSIX I/O through cuFile's own host
    /// bounce buffers underneath (nvidia-fs is not loaded).
    Compat,
    /// The host-memory emulation (tests): pread/pwrite on the files.
    Emulated,
}

impl DirectMode {
    /// "P2P (nvidia-fs)", "compatibility mode (no nvidia-fs: POSIX under cuFile)", "emulated".
    pub fn describe(self) -> &'static str {
        match self {
            DirectMode::P2p => "P2P (nvidia-fs)",
            DirectMode::Compat => "compatibility mode (no nvidia-fs: POSIX I/O under cuFile)",
            DirectMode::Emulated => "emulated (host memory, pread/pwrite)",
        }
    }
}

/// Direct I/O between device memory and the array's files (GPUDirect Storage, cuFile). Calls
/// are blocking and thread-safe; the store runs many at once from its own threads.
pub trait DirectStorage: Send + Sync {
    /// How it reaches the disk.
    fn mode(&self) -> DirectMode;
    /// Prepare the calling thread (CUDA: make the device's context current).
    fn bind_thread(&self) -> Result<()>;
    /// Register device memory for direct I/O once (cuFileBufRegister; a no-op where it does not
    /// matter). Failure is not an error: I/O works on unregistered memory, slower.
    fn prepare(&self, mem: &dyn DeviceMemory);
    /// Write `len` bytes at `buf_offset` of the device buffer starting at `base` (the tensor's
    /// memory; registered memory must be named by its base) to array device `file` at byte
    /// `offset`.
    ///
    /// # Safety
    /// `[base + buf_offset, + len)` must lie in live device memory not written while the call
    /// runs.
    unsafe fn write(
        &self,
        file: u32,
        base: u64,
        buf_offset: u64,
        len: usize,
        offset: u64,
    ) -> Result<()>;
    /// Read `len` bytes of array device `file` at byte `offset` into the device buffer at
    /// `base`, `buf_offset` bytes in.
    ///
    /// # Safety
    /// `[base + buf_offset, + len)` must lie in live device memory nobody else uses while the
    /// call runs.
    unsafe fn read(
        &self,
        file: u32,
        base: u64,
        buf_offset: u64,
        len: usize,
        offset: u64,
    ) -> Result<()>;
}

/// A device (a GPU, or the host emulation): copies, fences, pinning, crc32c, direct storage.
pub trait GpuDevice: Send + Sync {
    /// "cuda:0 (NVIDIA H200)", "emulated-gpu:0".
    fn name(&self) -> String;
    /// Device ordinal.
    fn ordinal(&self) -> u32;
    /// A new copy queue (CUDA: a non-blocking stream of its own).
    fn copy_queue(&self) -> Result<Box<dyn CopyQueue>>;
    /// A copy queue for copies of one direction only, apart from the other direction's (CUDA:
    /// a stream of a pool of that direction): an offload's copy to the host and a prefetch's
    /// copy to the device then run at once, neither waits in the other's stream. Nothing orders
    /// the two directions but fences.
    fn copy_queue_toward(&self, way: CopyWay) -> Result<Box<dyn CopyQueue>> {
        let _ = way;
        self.copy_queue()
    }
    /// Page-lock host memory so copies from and to it are asynchronous DMA
    /// (cuMemHostRegister).
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be mapped and stay mapped until [`unpin_host`](Self::unpin_host).
    unsafe fn pin_host(&self, ptr: *mut u8, len: usize) -> Result<()>;
    /// Undo [`pin_host`](Self::pin_host).
    ///
    /// # Safety
    /// `ptr` must have been pinned by this device and no copy may use it any more.
    unsafe fn unpin_host(&self, ptr: *mut u8) -> Result<()>;
    /// crc32c of every `unit`-sized piece of the `len` device bytes at `ptr` (the last piece may
    /// be shorter), computed on the device; the same values as the CPU's `crc32c` of each piece.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must lie in live device memory not written while the call runs.
    unsafe fn crc32c_units(&self, ptr: u64, len: u64, unit: u64) -> Result<Vec<u32>>;
    /// Set `len` device bytes at `ptr` to `value` (cuMemsetD8), synchronously.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must lie in live device memory nobody else uses during the call.
    unsafe fn memset(&self, ptr: u64, len: u64, value: u8) -> Result<()>;
    /// Direct storage to these files (the array's devices, in order). `Unsupported` where there
    /// is none (no cuFile, simulated disks).
    fn direct_storage(&self, paths: &[PathBuf]) -> Result<Arc<dyn DirectStorage>>;
    /// A fence recorded now on the caller's `stream` (a `CUstream` as an integer): an offload
    /// waits on it before it reads the tensor, so it starts after the caller's queued work.
    fn record_on_stream(&self, stream: u64) -> Result<Box<dyn DeviceFence>>;
}

/// A GPU page-locking a buffer pool's mappings (the host tier of an engine with a
/// GPU: tensors offloaded to host memory move by DMA at the bus's speed).
pub struct GpuPinner(pub Arc<dyn GpuDevice>);

impl crate::pool::HostPinner for GpuPinner {
    unsafe fn pin(&self, ptr: *mut u8, len: usize) -> Result<()> {
        // SAFETY: forwarded contract (mapped until unpin).
        unsafe { self.0.pin_host(ptr, len) }
    }

    unsafe fn unpin(&self, ptr: *mut u8) {
        // SAFETY: forwarded contract (pinned by `pin`, unused now).
        if let Err(e) = unsafe { self.0.unpin_host(ptr) } {
            crate::notice::warning(format!("unpinning a host-tier buffer failed: {e}"));
        }
    }
}

/// One tensor's device memory. Dropping it returns the memory to its tier (or, for memory a
/// trainer owns, forgets it).
pub trait DeviceMemory: Send + Sync {
    /// Bytes of the tensor.
    fn len(&self) -> u64;
    /// Whether it holds no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Device address of the first byte.
    fn device_ptr(&self) -> u64;
    /// The device it lives on.
    fn gpu(&self) -> &Arc<dyn GpuDevice>;
    /// The fence after which the content written by the last prefetch is complete, if any.
    fn ready(&self) -> Option<&dyn DeviceFence>;
    /// Set (or clear) the fence of [`ready`](Self::ready).
    fn set_ready(&mut self, fence: Option<Box<dyn DeviceFence>>);
    /// For implementation-specific access (the CUDA backend registers its own memory).
    fn as_any(&self) -> &dyn Any;
}

/// Copy `dst.len()` bytes at `offset` of device memory into host memory, synchronously (after
/// the last prefetch into it completed).
pub(crate) fn copy_out(mem: &dyn DeviceMemory, offset: u64, dst: &mut [u8]) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    if let Some(f) = mem.ready() {
        f.wait()?;
    }
    let mut q = mem.gpu().copy_queue()?;
    // SAFETY: `dst` is borrowed mutably until the fence below completed; the range was checked
    // against the tensor's length by the caller (TensorMem::copy_out).
    unsafe { q.device_to_host(mem.device_ptr() + offset, dst.as_mut_ptr(), dst.len())? };
    q.fence()?.wait()
}

/// Copy `src` into device memory at `offset`, synchronously.
pub(crate) fn copy_in(mem: &mut dyn DeviceMemory, offset: u64, src: &[u8]) -> Result<()> {
    if src.is_empty() {
        return Ok(());
    }
    if let Some(f) = mem.ready() {
        f.wait()?;
    }
    mem.set_ready(None);
    let mut q = mem.gpu().copy_queue()?;
    // SAFETY: `src` is borrowed until the fence below completed; range checked by the caller.
    unsafe { q.host_to_device(src.as_ptr(), mem.device_ptr() + offset, src.len())? };
    q.fence()?.wait()
}

/// Queue a copy of `src` into the whole of device memory `mem` without blocking the host: the
/// copy waits on the device for `mem`'s ready fence (the caller's queued work on that memory),
/// and `mem`'s ready fence becomes the copy's; with `src_written`, also for that fence (a copy
/// into `src` still queued on the device). Returns a second fence of the copy: `src` must stay
/// valid and unchanged until it completes.
///
/// # Safety
/// `src` must stay valid for reads, and must not be written, until the returned fence has
/// completed (drop it only after [`DeviceFence::is_done`] or [`DeviceFence::wait`]).
pub(crate) unsafe fn copy_in_async(
    mem: &mut dyn DeviceMemory,
    src: &[u8],
    src_written: Option<&dyn DeviceFence>,
) -> Result<Box<dyn DeviceFence>> {
    if src.len() as u64 != mem.len() {
        return Err(Error::InvalidArgument(format!(
            "copy of {} bytes into a tensor of {} bytes",
            src.len(),
            mem.len()
        )));
    }
    let mut q = queue_behind(mem, src_written, CopyWay::ToDevice)?;
    // SAFETY: `src` outlives the copy (this function's contract); the destination is the
    // tensor's own live allocation, of `src.len()` bytes (checked above).
    unsafe { q.host_to_device(src.as_ptr(), mem.device_ptr(), src.len())? };
    fence_both(q.as_mut(), mem)
}

/// A copy queue of `mem`'s device for copies going `way`, whose next copy waits on the device
/// for `mem`'s ready fence and for `other`.
fn queue_behind(
    mem: &dyn DeviceMemory,
    other: Option<&dyn DeviceFence>,
    way: CopyWay,
) -> Result<Box<dyn CopyQueue>> {
    let mut q = mem.gpu().copy_queue_toward(way)?;
    for f in mem.ready().into_iter().chain(other) {
        q.wait_for(f)?;
    }
    Ok(q)
}

/// After a copy queued on `q`: `mem`'s ready fence becomes the copy's, and a second fence of it
/// is returned (for whoever holds the host side). When a fence cannot be made the copy is still
/// queued, and the caller gives both sides back on the error: wait for the copy first.
fn fence_both(q: &mut dyn CopyQueue, mem: &mut dyn DeviceMemory) -> Result<Box<dyn DeviceFence>> {
    match q.fence().and_then(|ready| Ok((ready, q.fence()?))) {
        Ok((ready, other)) => {
            mem.set_ready(Some(ready));
            Ok(other)
        }
        Err(e) => match q.drain() {
            Ok(()) => Err(e),
            // A device that can neither record an event nor synchronize a stream has failed
            // as a whole (CUDA's sticky errors): its queued work does not run any more.
            Err(d) => Err(Error::Cuda(format!(
                "{e}; waiting for the copy already queued failed too: {d}"
            ))),
        },
    }
}

/// Queue a copy of the whole of device memory `mem` into host memory `dst` without blocking the
/// host: the copy waits on the device for `after` (the caller's queued work on the tensor) and
/// for `mem`'s ready fence, and `mem`'s ready fence becomes the copy's: whoever reuses `mem`
/// (writes it, frees it to a caching allocator) orders that work after it. Returns a second
/// fence of the copy: `dst` holds the bytes once it completes.
///
/// # Safety
/// `dst` must stay valid for writes, and must be neither read nor written by anyone else, until
/// the returned fence has completed; `mem` must stay allocated until its ready fence completes.
pub(crate) unsafe fn copy_out_async(
    mem: &mut dyn DeviceMemory,
    dst: &mut [u8],
    after: Option<&dyn DeviceFence>,
) -> Result<Box<dyn DeviceFence>> {
    if dst.len() as u64 != mem.len() {
        return Err(Error::InvalidArgument(format!(
            "copy of a tensor of {} bytes into {} bytes",
            mem.len(),
            dst.len()
        )));
    }
    let mut q = queue_behind(mem, after, CopyWay::ToHost)?;
    // SAFETY: `dst` outlives the copy and nobody else touches it meanwhile (this function's
    // contract); the source is the tensor's own live allocation, of `dst.len()` bytes.
    unsafe { q.device_to_host(mem.device_ptr(), dst.as_mut_ptr(), dst.len())? };
    fence_both(q.as_mut(), mem)
}
