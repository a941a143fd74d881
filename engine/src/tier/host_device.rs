//! The host-memory emulation of a device ([`HostDevice`], [`HostDeviceTier`]): "device
//! memory" that is host memory, behind the traits of `tier::device`, so the store's GPU data
//! paths run the very same code in CI without a GPU (see `tier::device`).

use std::any::Any;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::device::{
    CopyQueue, CopyWay, DeviceFence, DeviceMemory, DirectMode, DirectStorage, GpuDevice,
};
use super::{MemoryTier, TensorMem};
use crate::{Error, Result};

/// A fence that is complete when it is made (the emulation copies synchronously).
struct DoneFence;

impl DeviceFence for DoneFence {
    fn wait(&self) -> Result<()> {
        Ok(())
    }
    fn is_done(&self) -> bool {
        true
    }
    fn wait_on_stream(&self, _stream: u64) -> Result<()> {
        Ok(())
    }
}

/// Copies of the emulation: done at once, in the calling thread.
struct HostQueue {
    device: Arc<HostDeviceState>,
    /// The FIFO of a deferred device its copies go to ([`Deferred::lanes`]).
    lane: usize,
}

impl CopyQueue for HostQueue {
    unsafe fn device_to_host(&mut self, src: u64, dst: *mut u8, len: usize) -> Result<()> {
        self.device.check_live(src, len)?;
        self.device.copies.fetch_add(1, Ordering::Relaxed);
        if let Some(d) = &self.device.deferred {
            d.lock().push(
                self.lane,
                PendingCopy { src: src as usize, dst: dst as usize, len, to_device: false },
            );
            return Ok(());
        }
        // SAFETY: the caller guarantees `dst` valid for `len` bytes; `src` is a live emulated
        // allocation (checked above), i.e. host memory of at least `len` bytes.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst, len) };
        Ok(())
    }

    unsafe fn host_to_device(&mut self, src: *const u8, dst: u64, len: usize) -> Result<()> {
        self.device.check_live(dst, len)?;
        self.device.copies.fetch_add(1, Ordering::Relaxed);
        if let Some(d) = &self.device.deferred {
            d.lock().push(
                self.lane,
                PendingCopy { src: src as usize, dst: dst as usize, len, to_device: true },
            );
            return Ok(());
        }
        // SAFETY: as above, in the other direction.
        unsafe { std::ptr::copy_nonoverlapping(src, dst as *mut u8, len) };
        Ok(())
    }

    fn fence(&mut self) -> Result<Box<dyn DeviceFence>> {
        match &self.device.deferred {
            Some(d) => {
                let mut d = d.lock();
                if d.failing_fences > 0 {
                    d.failing_fences -= 1;
                    return Err(Error::Cuda("emulated: no fence can be made".into()));
                }
                let (lane, seq) = (self.lane, d.lanes[self.lane].queued);
                Ok(Box::new(DeferredFence { device: self.device.clone(), lane, seq }))
            }
            None => Ok(Box::new(DoneFence)),
        }
    }

    fn drain(&mut self) -> Result<()> {
        self.device.run_deferred(self.lane, u64::MAX, false);
        Ok(())
    }

    fn wait_for(&mut self, fence: &dyn DeviceFence) -> Result<()> {
        // Deferred or not: the device catches up with `fence` now, so a copy queued next on
        // this queue runs after it (stricter than waiting on the device, never looser; the
        // emulation's lanes are not ordered otherwise).
        fence.wait()
    }
}

/// A copy of a device with deferred copies, not run yet.
struct PendingCopy {
    src: usize,
    dst: usize,
    len: usize,
    to_device: bool,
}

/// The copies a device with deferred copies has queued: a FIFO per kind of queue, as CUDA
/// orders a stream's copies and nothing between streams but events: queues of any copies
/// ([`GpuDevice::copy_queue`]) share lane 0, queues toward the device lane 1, toward the
/// host lane 2 ([`GpuDevice::copy_queue_toward`]); stricter than CUDA's per-stream order
/// within a lane, as loose between lanes.
#[derive(Default)]
struct Deferred {
    lanes: [Lane; 3],
    /// Copies that found their device memory freed when they ran (a use after free on a GPU).
    faults: Vec<String>,
    /// Polls of a pending fence so far, and how many polls run one copy.
    polls: u64,
    polls_per_copy: u64,
    /// The next this many fences fail to be made ([`HostDeviceTier::fail_next_fences`]).
    failing_fences: u64,
}

/// One FIFO of deferred copies.
#[derive(Default)]
struct Lane {
    copies: std::collections::VecDeque<PendingCopy>,
    /// Copies queued so far (the sequence number of the last).
    queued: u64,
    /// Copies run so far.
    ran: u64,
}

impl Deferred {
    fn push(&mut self, lane: usize, c: PendingCopy) {
        let l = &mut self.lanes[lane];
        l.copies.push_back(c);
        l.queued += 1;
    }
}

impl HostDeviceState {
    /// Run the deferred copies of `lane` up to sequence number `seq` (all with `u64::MAX`), or
    /// just the oldest one with `one`.
    fn run_deferred(&self, lane: usize, seq: u64, one: bool) {
        let Some(d) = &self.deferred else { return };
        let mut d = d.lock();
        while d.lanes[lane].ran < seq {
            let l = &mut d.lanes[lane];
            let Some(c) = l.copies.pop_front() else { break };
            l.ran += 1;
            let n = l.ran;
            let dev = if c.to_device { c.dst } else { c.src } as u64;
            if let Err(e) = self.check_live(dev, c.len) {
                d.faults.push(format!("copy #{n} of lane {lane}: {e}"));
            } else {
                // SAFETY: the device side is a live emulated allocation (checked just now); the
                // host side is valid until the copy's fence completes (CopyQueue's contract),
                // and it has not completed: this is the copy running.
                unsafe {
                    std::ptr::copy_nonoverlapping(c.src as *const u8, c.dst as *mut u8, c.len)
                };
            }
            if one {
                break;
            }
        }
    }
}

/// A fence of a device with deferred copies: done once the copies before it ran. Asking whether
/// it is done runs the oldest pending copy every so many polls (the device makes progress as the
/// host polls, slower than the host);
/// waiting on it, on the host or on the caller's stream (in the emulation the caller's "kernels"
/// are host code that runs at once), runs every copy before it.
struct DeferredFence {
    device: Arc<HostDeviceState>,
    lane: usize,
    seq: u64,
}

impl DeferredFence {
    fn ran(&self) -> bool {
        self.device.deferred.as_ref().is_none_or(|d| d.lock().lanes[self.lane].ran >= self.seq)
    }
}

impl DeviceFence for DeferredFence {
    fn wait(&self) -> Result<()> {
        self.device.run_deferred(self.lane, self.seq, false);
        Ok(())
    }
    fn is_done(&self) -> bool {
        if self.ran() {
            return true;
        }
        let progress = self.device.deferred.as_ref().is_some_and(|d| {
            let mut d = d.lock();
            d.polls += 1;
            d.polls.is_multiple_of(d.polls_per_copy.max(1))
        });
        if progress {
            self.device.run_deferred(self.lane, self.seq, true);
        }
        self.ran()
    }
    fn wait_on_stream(&self, _stream: u64) -> Result<()> {
        self.wait()
    }
}

struct HostDeviceState {
    ordinal: u32,
    /// Copies deferred until a fence is polled or waited for ([`HostDeviceTier::deferred`]).
    deferred: Option<Mutex<Deferred>>,
    /// Live allocations: (start, len).
    live: Mutex<Vec<(u64, u64)>>,
    pinned: Mutex<Vec<usize>>,
    copies: AtomicU64,
    crc_calls: AtomicU64,
}

impl HostDeviceState {
    /// An emulated "device access" outside every live allocation is a bug in the data path:
    /// on a GPU it would be an illegal address.
    fn check_live(&self, addr: u64, len: usize) -> Result<()> {
        let ok = self.live.lock().iter().any(|&(s, l)| addr >= s && addr + len as u64 <= s + l);
        if ok {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "emulated device access of {len} bytes at {addr:#x} is outside every allocation"
            )))
        }
    }
}

/// A device emulated in host memory: the same traits as CUDA, for tests and CPU-only machines.
/// Its copies are synchronous memcpys, its crc32c is the CPU mirror of the GPU kernel, and its
/// direct storage does pread/pwrite on the array's files.
#[derive(Clone)]
pub struct HostDevice {
    state: Arc<HostDeviceState>,
}

impl HostDevice {
    /// An emulated device with this ordinal, as a `GpuDevice`.
    pub fn gpu(ordinal: u32) -> Arc<dyn GpuDevice> {
        Arc::new(Self::new_concrete(ordinal, false))
    }

    fn new_concrete(ordinal: u32, deferred: bool) -> Self {
        HostDevice {
            state: Arc::new(HostDeviceState {
                ordinal,
                deferred: deferred.then(Mutex::default),
                live: Mutex::new(Vec::new()),
                pinned: Mutex::new(Vec::new()),
                copies: AtomicU64::new(0),
                crc_calls: AtomicU64::new(0),
            }),
        }
    }
}

impl GpuDevice for HostDevice {
    fn name(&self) -> String {
        format!("emulated-gpu:{}", self.state.ordinal)
    }

    fn ordinal(&self) -> u32 {
        self.state.ordinal
    }

    fn copy_queue(&self) -> Result<Box<dyn CopyQueue>> {
        Ok(Box::new(HostQueue { device: self.state.clone(), lane: 0 }))
    }

    fn copy_queue_toward(&self, way: CopyWay) -> Result<Box<dyn CopyQueue>> {
        let lane = match way {
            CopyWay::ToDevice => 1,
            CopyWay::ToHost => 2,
        };
        Ok(Box::new(HostQueue { device: self.state.clone(), lane }))
    }

    unsafe fn pin_host(&self, ptr: *mut u8, _len: usize) -> Result<()> {
        let mut p = self.state.pinned.lock();
        if p.contains(&(ptr as usize)) {
            return Err(Error::InvalidArgument(format!("{ptr:?} is pinned twice")));
        }
        p.push(ptr as usize);
        Ok(())
    }

    unsafe fn unpin_host(&self, ptr: *mut u8) -> Result<()> {
        let mut p = self.state.pinned.lock();
        let i = p
            .iter()
            .position(|&x| x == ptr as usize)
            .ok_or_else(|| Error::InvalidArgument(format!("{ptr:?} was not pinned")))?;
        p.swap_remove(i);
        Ok(())
    }

    unsafe fn crc32c_units(&self, ptr: u64, len: u64, unit: u64) -> Result<Vec<u32>> {
        self.state.check_live(ptr, len as usize)?;
        self.state.crc_calls.fetch_add(1, Ordering::Relaxed);
        // SAFETY: a live emulated allocation of at least `len` bytes (checked above).
        let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, len as usize) };
        Ok(bytes.chunks(unit as usize).map(crate::gpucrc::crc32c_like_kernel).collect())
    }

    unsafe fn memset(&self, ptr: u64, len: u64, value: u8) -> Result<()> {
        self.state.check_live(ptr, len as usize)?;
        // SAFETY: a live emulated allocation of at least `len` bytes (checked above).
        unsafe { std::ptr::write_bytes(ptr as *mut u8, value, len as usize) };
        Ok(())
    }

    fn direct_storage(&self, paths: &[PathBuf]) -> Result<Arc<dyn DirectStorage>> {
        let files = paths
            .iter()
            .map(|p| {
                std::fs::OpenOptions::new().read(true).write(true).open(p).map_err(|e| Error::Os {
                    context: format!("opening {} for direct I/O", p.display()),
                    source: e,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(HostDirect { device: self.state.clone(), files }))
    }

    fn record_on_stream(&self, _stream: u64) -> Result<Box<dyn DeviceFence>> {
        Ok(Box::new(DoneFence))
    }
}

/// pread/pwrite between emulated device memory and the array's files.
struct HostDirect {
    device: Arc<HostDeviceState>,
    files: Vec<std::fs::File>,
}

impl HostDirect {
    fn file(&self, file: u32) -> Result<&std::fs::File> {
        self.files.get(file as usize).ok_or_else(|| {
            Error::InvalidArgument(format!("file {file} of {} for direct I/O", self.files.len()))
        })
    }
}

impl DirectStorage for HostDirect {
    fn mode(&self) -> DirectMode {
        DirectMode::Emulated
    }

    fn bind_thread(&self) -> Result<()> {
        Ok(())
    }

    fn prepare(&self, _mem: &dyn DeviceMemory) {}

    unsafe fn write(
        &self,
        file: u32,
        base: u64,
        buf_offset: u64,
        len: usize,
        offset: u64,
    ) -> Result<()> {
        let src = base + buf_offset;
        self.device.check_live(src, len)?;
        // SAFETY: live emulated device memory (host memory) of `len` bytes, checked above.
        let bytes = unsafe { std::slice::from_raw_parts(src as *const u8, len) };
        self.file(file)?
            .write_all_at(bytes, offset)
            .map_err(|e| Error::Os { context: format!("direct write to file {file}"), source: e })
    }

    unsafe fn read(
        &self,
        file: u32,
        base: u64,
        buf_offset: u64,
        len: usize,
        offset: u64,
    ) -> Result<()> {
        let dst = base + buf_offset;
        self.device.check_live(dst, len)?;
        // SAFETY: as in `write`; the caller guarantees nobody else uses the range.
        let bytes = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) };
        self.file(file)?
            .read_exact_at(bytes, offset)
            .map_err(|e| Error::Os { context: format!("direct read of file {file}"), source: e })
    }
}

/// Emulated device memory: a 256-byte aligned host allocation (as cudaMalloc aligns).
struct HostDeviceMem {
    gpu: Arc<dyn GpuDevice>,
    device: Arc<HostDeviceState>,
    ptr: *mut u8,
    len: u64,
    /// `None`: memory the caller owns ([`HostDeviceTier::wrap_foreign`]), never freed here.
    layout: Option<std::alloc::Layout>,
    tier: Option<Arc<HostDeviceTierState>>,
    ready: Option<Box<dyn DeviceFence>>,
}

// SAFETY: the allocation is exclusively owned; access goes through the traits' methods.
unsafe impl Send for HostDeviceMem {}
// SAFETY: &HostDeviceMem only reads plain fields.
unsafe impl Sync for HostDeviceMem {}

impl DeviceMemory for HostDeviceMem {
    fn len(&self) -> u64 {
        self.len
    }
    fn device_ptr(&self) -> u64 {
        self.ptr as u64
    }
    fn gpu(&self) -> &Arc<dyn GpuDevice> {
        &self.gpu
    }
    fn ready(&self) -> Option<&dyn DeviceFence> {
        self.ready.as_deref()
    }
    fn set_ready(&mut self, fence: Option<Box<dyn DeviceFence>>) {
        self.ready = fence;
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for HostDeviceMem {
    fn drop(&mut self) {
        let a = self.ptr as u64;
        self.device.live.lock().retain(|&(s, _)| s != a);
        if let Some(t) = &self.tier {
            t.used.fetch_sub(self.len, Ordering::Relaxed);
        }
        if let Some(layout) = self.layout {
            // SAFETY: allocated in `HostDeviceTier::alloc` with exactly this layout, freed once.
            unsafe { std::alloc::dealloc(self.ptr, layout) };
        }
    }
}

struct HostDeviceTierState {
    used: AtomicU64,
}

/// A [`MemoryTier`] of emulated device memory ([`TensorMem::Device`] on a [`HostDevice`]): what
/// CPU tests use in place of the CUDA tier.
pub struct HostDeviceTier {
    gpu: Arc<dyn GpuDevice>,
    device: Arc<HostDeviceState>,
    capacity_bytes: u64,
    state: Arc<HostDeviceTierState>,
    name: String,
}

impl HostDeviceTier {
    /// A tier of at most `capacity_bytes` on a new emulated device.
    pub fn new(ordinal: u32, capacity_bytes: u64) -> Arc<Self> {
        Self::with_device(HostDevice::new_concrete(ordinal, false), capacity_bytes)
    }

    /// A tier on an emulated device whose copies are deferred, as a GPU's are: a copy runs when
    /// a fence after it is waited for (on the host or on the caller's stream) or, one at a time,
    /// when fences are polled. Tests of stream ordering use it: work that forgets to wait for a
    /// fence sees bytes not copied yet, and a copy whose device memory was freed before it ran
    /// is recorded in [`faults`](Self::faults). Every `polls_per_copy`-th poll of a pending
    /// fence runs one copy: the larger, the further the device lags behind the host.
    pub fn deferred(ordinal: u32, capacity_bytes: u64, polls_per_copy: u64) -> Arc<Self> {
        let dev = HostDevice::new_concrete(ordinal, true);
        if let Some(d) = &dev.state.deferred {
            d.lock().polls_per_copy = polls_per_copy;
        }
        Self::with_device(dev, capacity_bytes)
    }

    /// The next `n` fences of this deferred device cannot be made (a device out of events):
    /// what a copy already queued does then.
    pub fn fail_next_fences(&self, n: u64) {
        if let Some(d) = &self.device.deferred {
            d.lock().failing_fences = n;
        }
    }

    /// Copies queued and not run yet (a deferred device; 0 otherwise).
    pub fn pending_copies(&self) -> usize {
        self.device
            .deferred
            .as_ref()
            .map_or(0, |d| d.lock().lanes.iter().map(|l| l.copies.len()).sum())
    }

    /// Run every deferred copy now (the device catches up).
    pub fn complete_copies(&self) {
        for lane in 0..3 {
            self.device.run_deferred(lane, u64::MAX, false);
        }
    }

    /// Deferred copies that ran after their device memory was freed (each a use after free on
    /// a GPU).
    pub fn faults(&self) -> Vec<String> {
        self.device.deferred.as_ref().map_or_else(Vec::new, |d| d.lock().faults.clone())
    }

    /// What a kernel on the caller's stream does to `mem` (memory of this device): write `src`
    /// at `offset` now, without waiting for the engine's copies (on a GPU the caller's stream
    /// waits for them only where the engine ordered it to).
    pub fn kernel_write(&self, mem: &TensorMem, offset: u64, src: &[u8]) -> Result<()> {
        let p = self.kernel_range(mem, offset, src.len())?;
        // SAFETY: a live allocation of this emulated device covering the range (checked by
        // `kernel_range`), i.e. host memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), p as *mut u8, src.len()) };
        Ok(())
    }

    /// What a kernel on the caller's stream reads from `mem` now (see
    /// [`kernel_write`](Self::kernel_write)).
    pub fn kernel_read(&self, mem: &TensorMem, offset: u64, dst: &mut [u8]) -> Result<()> {
        let p = self.kernel_range(mem, offset, dst.len())?;
        // SAFETY: as in `kernel_write`.
        unsafe { std::ptr::copy_nonoverlapping(p as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn kernel_range(&self, mem: &TensorMem, offset: u64, len: usize) -> Result<u64> {
        let Some(d) = mem.device() else {
            return Err(Error::InvalidArgument(format!("{mem:?} is not device memory")));
        };
        let p = d.device_ptr() + offset;
        if offset + len as u64 > d.len() || d.gpu().name() != self.name {
            return Err(Error::InvalidArgument(format!(
                "{len} bytes at {offset} of {mem:?} on {}",
                self.name
            )));
        }
        self.device.check_live(p, len)?;
        Ok(p)
    }

    fn with_device(dev: HostDevice, capacity_bytes: u64) -> Arc<Self> {
        let device = dev.state.clone();
        let gpu: Arc<dyn GpuDevice> = Arc::new(dev);
        Arc::new(HostDeviceTier {
            name: gpu.name(),
            gpu,
            device,
            capacity_bytes,
            state: Arc::new(HostDeviceTierState { used: AtomicU64::new(0) }),
        })
    }

    /// The emulated device.
    pub fn gpu(&self) -> &Arc<dyn GpuDevice> {
        &self.gpu
    }

    /// Copies made so far (each a "DMA" between host and emulated device memory).
    pub fn copies(&self) -> u64 {
        self.device.copies.load(Ordering::Relaxed)
    }

    /// crc32c computations on the emulated device so far.
    pub fn crc_calls(&self) -> u64 {
        self.device.crc_calls.load(Ordering::Relaxed)
    }

    /// Memory a caller owns (`len` bytes of host memory at `ptr`) as this emulated device's
    /// memory: what a trainer's device pointer is on a real GPU. Not counted against the tier's
    /// capacity; forgotten (not freed) on drop. Aligned like the CUDA tier's foreign pointers.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be valid for reads and writes, and not used by anyone else while
    /// the engine may use it, until the returned memory is dropped.
    pub unsafe fn wrap_foreign(&self, ptr: u64, len: u64) -> Result<TensorMem> {
        if len == 0 {
            return Err(Error::InvalidArgument("a device tensor of 0 bytes".into()));
        }
        if ptr == 0 || !ptr.is_multiple_of(16) {
            return Err(Error::Misaligned { what: "device pointer", value: ptr, align: 16 });
        }
        self.device.live.lock().push((ptr, len));
        Ok(TensorMem::Device(Box::new(HostDeviceMem {
            gpu: self.gpu.clone(),
            device: self.device.clone(),
            ptr: ptr as *mut u8,
            len,
            layout: None,
            tier: None,
            ready: None,
        })))
    }
}

impl MemoryTier for HostDeviceTier {
    fn name(&self) -> &str {
        &self.name
    }

    fn alloc(&self, bytes: u64) -> Result<TensorMem> {
        if bytes == 0 {
            return Err(Error::InvalidArgument("device memory of 0 bytes".into()));
        }
        let used = self.state.used.fetch_add(bytes, Ordering::Relaxed);
        if used + bytes > self.capacity_bytes {
            self.state.used.fetch_sub(bytes, Ordering::Relaxed);
            return Err(Error::NoSpace(format!(
                "tier {}: {bytes} bytes requested, {used} of {} in use",
                self.name, self.capacity_bytes
            )));
        }
        let layout = std::alloc::Layout::from_size_align(bytes as usize, 256)
            .map_err(|e| Error::InvalidArgument(format!("{bytes} bytes: {e}")))?;
        // SAFETY: a non-zero size (checked above).
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            self.state.used.fetch_sub(bytes, Ordering::Relaxed);
            return Err(Error::NoSpace(format!("host allocation of {bytes} bytes failed")));
        }
        self.device.live.lock().push((ptr as u64, bytes));
        Ok(TensorMem::Device(Box::new(HostDeviceMem {
            gpu: self.gpu.clone(),
            device: self.device.clone(),
            ptr,
            len: bytes,
            layout: Some(layout),
            tier: Some(self.state.clone()),
            ready: None,
        })))
    }

    fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    fn used_bytes(&self) -> u64 {
        self.state.used.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::device::{copy_in_async, copy_out_async};

    #[test]
    fn emulated_device_memory_round_trips_and_is_accounted() {
        let tier = HostDeviceTier::new(0, 1 << 20);
        let mut m = tier.alloc(1000).unwrap();
        assert!(matches!(m, TensorMem::Device(_)));
        assert_eq!(tier.used_bytes(), 1000);
        let src: Vec<u8> = (0..1000).map(|i| (i * 7) as u8).collect();
        m.copy_in(0, &src).unwrap();
        let mut back = vec![0u8; 1000];
        m.copy_out(0, &mut back).unwrap();
        assert_eq!(back, src);
        assert!(m.copy_in(999, &[1, 2]).is_err(), "a range past the end is refused");
        assert!(matches!(tier.alloc(1 << 20), Err(Error::NoSpace(_))));
        drop(m);
        assert_eq!(tier.used_bytes(), 0);
        assert!(tier.alloc(0).is_err());
    }

    #[test]
    fn a_copy_queued_without_a_fence_has_run_when_its_error_comes_back() {
        // The copies only run when the test says so (a slow device), and fences fail to be
        // made after the copy is queued: the caller gives both sides back on the error, so the
        // copy must have run by then.
        let tier = HostDeviceTier::deferred(0, 1 << 20, u64::MAX);
        let mut m = tier.alloc(4096).unwrap();
        let data: Vec<u8> = (0..4096).map(|i| (i * 13 + 5) as u8).collect();
        tier.kernel_write(&m, 0, &data).unwrap();
        let TensorMem::Device(d) = &mut m else { unreachable!() };
        let mut out = vec![0u8; 4096];
        tier.fail_next_fences(1);
        // SAFETY: `out` outlives the call and the copy (drained before the error returns).
        let r = unsafe { copy_out_async(d.as_mut(), &mut out, None) };
        assert!(matches!(r, Err(Error::Cuda(_))), "{:?}", r.err());
        assert_eq!(tier.pending_copies(), 0, "the queued copy ran before the error came back");
        assert_eq!(out, data);
        // The other direction, the second of the two fences failing.
        let back: Vec<u8> = data.iter().map(|b| !b).collect();
        tier.fail_next_fences(2);
        // SAFETY: as above.
        let r = unsafe { copy_in_async(d.as_mut(), &back, None) };
        assert!(r.is_err());
        assert_eq!(tier.pending_copies(), 0);
        let mut now = vec![0u8; 4096];
        tier.kernel_read(&m, 0, &mut now).unwrap();
        assert_eq!(now, back);
        assert!(tier.faults().is_empty(), "{:?}", tier.faults());
    }

    #[test]
    fn a_prefetch_does_not_wait_behind_an_offload_unless_it_reads_its_copy() {
        // Copies toward the host and toward the device go to queues of their own (CUDA: streams
        // of two pools): an offload queued first does not hold up a later prefetch of other
        // bytes; a prefetch of the offload's own host copy waits for it through its fence.
        let tier = HostDeviceTier::deferred(0, 1 << 20, u64::MAX);
        let (mut a, mut b) = (tier.alloc(4096).unwrap(), tier.alloc(4096).unwrap());
        let data: Vec<u8> = (0..4096).map(|i| (i * 7 + 1) as u8).collect();
        tier.kernel_write(&a, 0, &data).unwrap();
        let mut copy = vec![0u8; 4096];
        let other: Vec<u8> = (0..4096).map(|i| (i * 3) as u8).collect();
        let (TensorMem::Device(da), TensorMem::Device(db)) = (&mut a, &mut b) else {
            unreachable!()
        };
        // SAFETY: `copy` and `other` outlive every copy (all run before the test ends: the
        // fences below are waited for, and complete_copies runs the rest).
        let written = unsafe { copy_out_async(da.as_mut(), &mut copy, None) }.unwrap();
        // SAFETY: as above.
        let loaded = unsafe { copy_in_async(db.as_mut(), &other, None) }.unwrap();
        loaded.wait().unwrap();
        assert_eq!(tier.pending_copies(), 1, "the offload is still queued: the prefetch ran first");
        let mut now = vec![0u8; 4096];
        tier.kernel_read(&b, 0, &mut now).unwrap();
        assert_eq!(now, other);
        // The prefetch of the offload's host copy waits for it.
        let TensorMem::Device(db) = &mut b else { unreachable!() };
        // SAFETY: as above.
        let back = unsafe { copy_in_async(db.as_mut(), &copy, Some(written.as_ref())) }.unwrap();
        back.wait().unwrap();
        tier.kernel_read(&b, 0, &mut now).unwrap();
        assert_eq!(now, data);
        tier.complete_copies();
        assert!(tier.faults().is_empty(), "{:?}", tier.faults());
    }

    #[test]
    fn emulated_accesses_outside_allocations_are_errors() {
        let tier = HostDeviceTier::new(0, 1 << 20);
        let m = tier.alloc(4096).unwrap();
        let TensorMem::Device(d) = &m else { unreachable!() };
        let mut q = d.gpu().copy_queue().unwrap();
        let mut buf = vec![0u8; 8192];
        // SAFETY: `buf` outlives the call; the device range is deliberately too long.
        let r = unsafe { q.device_to_host(d.device_ptr(), buf.as_mut_ptr(), 8192) };
        assert!(r.is_err());
    }
}
