//! CUDA device memory as a memory tier, and GPUDirect Storage (cuFile), over cudarc's `sys`
//! bindings (loaded at run time: a machine without CUDA builds and runs, and every entry point
//! returns [`Error::Unsupported`] naming the missing library instead of cudarc's panic).
//!
//! - [`CudaDevice`]: one GPU (its primary context, shared with PyTorch): copy queues (streams),
//!   fences (events), page-locking host memory, the crc32c kernel ([`crate::gpucrc`], compiled
//!   with NVRTC on first use), and direct storage ([`GdsIo`]). Implements
//!   [`GpuDevice`].
//! - [`CudaTier`]: a [`MemoryTier`] over cuMemAlloc with a byte budget. Freed allocations are
//!   cached by size and reused (cuMemFree synchronizes the device: freeing per tensor made
//!   replays twice slower than their simulation).
//! - [`CudaMem`]: one allocation, from the tier or handed in by a trainer
//!   ([`CudaMem::wrap_foreign`]: checked to be device memory of this GPU, aligned, in bounds).
//! - [`GdsIo`]: a thin layer over `cudarc::cufile::sys` (not its `safe` module): one cuFile
//!   handle per array device, direct reads and writes, buffers registered once.

mod gds;

use std::any::Any;
use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock, Weak};

use cudarc::driver::sys as cu;
use parking_lot::Mutex;

pub use gds::GdsIo;

use crate::tier::{
    CopyQueue, CopyWay, DeviceFence, DeviceMemory, DirectStorage, GpuDevice, MemoryTier, TensorMem,
};
use crate::{Error, Result};

/// A driver call's status as a `Result`.
fn check(r: cu::CUresult, what: &str) -> Result<()> {
    if r == cu::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda(format!("{what} failed: {r:?}")))
    }
}

/// Whether a library cudarc would load is present, without letting its loader panic.
fn library_present(probe: fn() -> bool) -> bool {
    std::panic::catch_unwind(probe).unwrap_or(false)
}

fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library by name.
    library_present(|| unsafe { cu::is_culib_present() })
}

pub(crate) fn nvrtc_present() -> bool {
    // SAFETY: as above.
    library_present(|| unsafe { cudarc::nvrtc::sys::is_culib_present() })
}

pub(crate) fn cufile_present() -> bool {
    // SAFETY: as above.
    library_present(|| unsafe { cudarc::cufile::sys::is_culib_present() })
}

/// Load the driver and initialize it once: `Unsupported` (naming what is missing) on a machine
/// without an NVIDIA driver or GPU.
pub fn driver() -> Result<()> {
    static INIT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    INIT.get_or_init(|| {
        if !driver_present() {
            return Err("the CUDA driver library (libcuda.so.1) is not installed or not on the \
                        loader path: no NVIDIA driver on this machine"
                .into());
        }
        // SAFETY: the library is present; cuInit has no preconditions.
        match std::panic::catch_unwind(|| unsafe { cu::cuInit(0) }) {
            Ok(cu::CUresult::CUDA_SUCCESS) => Ok(()),
            Ok(r) => Err(format!("cuInit failed: {r:?} (no usable NVIDIA GPU)")),
            Err(_) => Err("the CUDA driver library lacks cuInit".into()),
        }
    })
    .clone()
    .map_err(Error::Unsupported)
}

/// Number of CUDA devices (0 where there is no driver).
pub fn device_count() -> u32 {
    if driver().is_err() {
        return 0;
    }
    let mut n = 0;
    // SAFETY: driver initialized; `n` is a valid out pointer.
    let r = unsafe { cu::cuDeviceGetCount(&mut n) };
    if r == cu::CUresult::CUDA_SUCCESS { n.max(0) as u32 } else { 0 }
}

struct CrcKernel {
    _module: cu::CUmodule,
    function: cu::CUfunction,
}

// SAFETY: module and function handles are plain driver handles usable from any thread with the
// context current.
unsafe impl Send for CrcKernel {}
// SAFETY: as above.
unsafe impl Sync for CrcKernel {}

/// One GPU, through its primary context (the one PyTorch uses too). Thread-safe; every method
/// makes the context current on the calling thread first.
pub struct CudaDevice {
    ordinal: u32,
    device: cu::CUdevice,
    ctx: cu::CUcontext,
    name: String,
    compute_capability: (i32, i32),
    crc: OnceLock<std::result::Result<CrcKernel, String>>,
    /// Idle copy streams: any copies, copies to the device, copies to the host.
    streams: [Mutex<Vec<usize>>; 3],
    /// Device buffers registered with cuFile: base address -> length.
    registered: Mutex<HashMap<u64, usize>>,
    this: Weak<CudaDevice>,
}

// SAFETY: the context and device handles are driver handles meant to be shared between threads.
unsafe impl Send for CudaDevice {}
// SAFETY: as above; mutable state is behind mutexes.
unsafe impl Sync for CudaDevice {}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaDevice({})", self.describe())
    }
}

impl CudaDevice {
    /// Open GPU `ordinal`: `Unsupported` without a driver or GPU, `InvalidArgument` for an
    /// ordinal that does not exist.
    pub fn open(ordinal: u32) -> Result<Arc<CudaDevice>> {
        driver()?;
        let count = device_count();
        if ordinal >= count {
            return Err(Error::InvalidArgument(format!(
                "GPU {ordinal} does not exist: this machine has {count} CUDA device{}",
                if count == 1 { "" } else { "s" }
            )));
        }
        let mut device = 0;
        // SAFETY: driver initialized; valid out pointer; ordinal checked.
        check(unsafe { cu::cuDeviceGet(&mut device, ordinal as i32) }, "cuDeviceGet")?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: a valid device; the primary context is released in Drop.
        let r = unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, device) };
        check(r, "cuDevicePrimaryCtxRetain")?;
        let name = cudarc::driver::result::device::get_name(device)
            .unwrap_or_else(|_| "unknown GPU".into());
        let attr = |a| {
            let mut v = 0;
            // SAFETY: valid device and out pointer.
            unsafe { cu::cuDeviceGetAttribute(&mut v, a, device) };
            v
        };
        let compute_capability = (
            attr(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            attr(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        );
        Ok(Arc::new_cyclic(|this| CudaDevice {
            ordinal,
            device,
            ctx,
            name,
            compute_capability,
            crc: OnceLock::new(),
            streams: Default::default(),
            registered: Mutex::new(HashMap::new()),
            this: this.clone(),
        }))
    }

    /// This device as a `GpuDevice`.
    pub fn gpu(&self) -> Arc<dyn GpuDevice> {
        self.this.upgrade().expect("a CudaDevice lives in an Arc")
    }

    fn arc(&self) -> Arc<CudaDevice> {
        self.this.upgrade().expect("a CudaDevice lives in an Arc")
    }

    /// Make the device's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: the context is retained for the device's lifetime.
        check(unsafe { cu::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    /// "cuda:0 (NVIDIA H200, sm_90)".
    pub fn describe(&self) -> String {
        format!(
            "cuda:{} ({}, sm_{}{})",
            self.ordinal, self.name, self.compute_capability.0, self.compute_capability.1
        )
    }

    /// The device's model name ("NVIDIA H200").
    pub fn model_name(&self) -> &str {
        &self.name
    }

    /// The device's UUID as `nvidia-smi -L` prints it ("GPU-1a2b3c4d-..."), when the driver
    /// gives one: what tells two GPUs of the same model apart, across processes and reboots.
    pub fn uuid(&self) -> Option<String> {
        let id = cudarc::driver::result::device::get_uuid(self.device).ok()?;
        let b: Vec<u8> = id.bytes.iter().map(|&c| c as u8).collect();
        let hex =
            |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
        Some(format!(
            "GPU-{}-{}-{}-{}-{}",
            hex(0..4),
            hex(4..6),
            hex(6..8),
            hex(8..10),
            hex(10..16)
        ))
    }

    /// (free, total) device memory bytes.
    pub fn memory_info(&self) -> Result<(u64, u64)> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out pointers, context current.
        check(unsafe { cu::cuMemGetInfo_v2(&mut free, &mut total) }, "cuMemGetInfo")?;
        Ok((free as u64, total as u64))
    }

    /// A stream of pool `pool` (0: any copies, 1: to the device, 2: to the host), made when the
    /// pool is empty.
    fn take_stream(&self, pool: usize) -> Result<cu::CUstream> {
        if let Some(s) = self.streams[pool].lock().pop() {
            return Ok(s as cu::CUstream);
        }
        let mut s = std::ptr::null_mut();
        // SAFETY: context current (callers bind first); valid out pointer.
        let r = unsafe {
            cu::cuStreamCreate(&mut s, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        };
        check(r, "cuStreamCreate")?;
        Ok(s)
    }

    fn give_stream(&self, pool: usize, s: cu::CUstream) {
        self.streams[pool].lock().push(s as usize);
    }

    fn crc_kernel(&self) -> Result<&CrcKernel> {
        self.crc
            .get_or_init(|| self.compile_crc().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| Error::Unsupported(format!("the GPU crc32c kernel: {e}")))
    }

    fn compile_crc(&self) -> Result<CrcKernel> {
        use cudarc::nvrtc::result as nvrtc;
        if !nvrtc_present() {
            return Err(Error::Unsupported(
                "NVRTC (libnvrtc.so) is not installed or not on the loader path".into(),
            ));
        }
        let src = CString::new(crate::gpucrc::KERNEL_SOURCE).expect("no NUL in the source");
        let prog = nvrtc::create_program(&src, Some(c"teraio_crc.cu"))
            .map_err(|e| Error::Cuda(format!("nvrtcCreateProgram: {e:?}")))?;
        let arch = format!(
            "--gpu-architecture=compute_{}{}",
            self.compute_capability.0, self.compute_capability.1
        );
        // SAFETY: `prog` was just created and is destroyed once below.
        let compiled = unsafe { nvrtc::compile_program(prog, &[arch.as_str()]) };
        // SAFETY: as above.
        let ptx = compiled.and_then(|()| unsafe { nvrtc::get_ptx(prog) });
        let ptx = match ptx {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: as above.
                let log = unsafe { nvrtc::get_program_log(prog) }
                    .map(|l| l.iter().map(|&c| c as u8 as char).collect::<String>())
                    .unwrap_or_default();
                // SAFETY: as above.
                let _ = unsafe { nvrtc::destroy_program(prog) };
                return Err(Error::Cuda(format!(
                    "NVRTC could not compile the crc kernel: {e:?}: {log}"
                )));
            }
        };
        // SAFETY: as above.
        let _ = unsafe { nvrtc::destroy_program(prog) };
        self.bind()?;
        let mut module = std::ptr::null_mut();
        // SAFETY: `ptx` is a NUL-terminated PTX image (nvrtcGetPTX includes the NUL).
        let r = unsafe { cu::cuModuleLoadData(&mut module, ptx.as_ptr().cast()) };
        check(r, "cuModuleLoadData")?;
        let mut function = std::ptr::null_mut();
        let name = CString::new(crate::gpucrc::KERNEL_NAME).expect("no NUL");
        // SAFETY: a loaded module and a NUL-terminated name.
        let r = unsafe { cu::cuModuleGetFunction(&mut function, module, name.as_ptr()) };
        check(r, "cuModuleGetFunction")?;
        Ok(CrcKernel { _module: module, function })
    }

    /// Register `[base, base + len)` with cuFile once (no-op if it is).
    pub(crate) fn cufile_register(&self, base: u64, len: usize) {
        let mut reg = self.registered.lock();
        if reg.contains_key(&base) {
            return;
        }
        // SAFETY: device memory of `len` bytes at `base`, live (the caller holds it); the
        // registration is undone before the memory is freed (`cufile_deregister`).
        let r = unsafe { cudarc::cufile::sys::cuFileBufRegister(base as *const c_void, len, 0) };
        if r.err == cudarc::cufile::sys::CUfileOpError::CU_FILE_SUCCESS {
            reg.insert(base, len);
        }
    }

    /// Undo [`cufile_register`](Self::cufile_register) before the memory is freed or given back.
    pub(crate) fn cufile_deregister(&self, base: u64) {
        if self.registered.lock().remove(&base).is_some() {
            // SAFETY: registered above and not yet freed.
            let _ = unsafe { cudarc::cufile::sys::cuFileBufDeregister(base as *const c_void) };
        }
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if self.bind().is_ok() {
            for pool in &self.streams {
                for s in pool.lock().drain(..) {
                    // SAFETY: streams created by this device and no longer used.
                    unsafe { cu::cuStreamDestroy_v2(s as cu::CUstream) };
                }
            }
        }
        // SAFETY: retained in `open`, released once.
        unsafe { cu::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

/// A CUDA event as a fence.
struct CudaFence {
    device: Arc<CudaDevice>,
    event: cu::CUevent,
}

// SAFETY: an event handle may be used from any thread with the context current.
unsafe impl Send for CudaFence {}
// SAFETY: as above.
unsafe impl Sync for CudaFence {}

impl CudaFence {
    fn record(device: &Arc<CudaDevice>, stream: cu::CUstream) -> Result<CudaFence> {
        device.bind()?;
        let mut event = std::ptr::null_mut();
        // SAFETY: context current; valid out pointer.
        let r = unsafe {
            cu::cuEventCreate(&mut event, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        };
        check(r, "cuEventCreate")?;
        let fence = CudaFence { device: device.clone(), event };
        // SAFETY: a live event and a stream of this context (or the caller's stream handle).
        check(unsafe { cu::cuEventRecord(event, stream) }, "cuEventRecord")?;
        Ok(fence)
    }
}

impl DeviceFence for CudaFence {
    /// Polls the event (sleeping 20 us between polls after a few yields) instead of
    /// cuEventSynchronize, which spins a core per waiting worker under the primary context's
    /// default scheduling (and teraio does not change the flags of a context it shares).
    fn wait(&self) -> Result<()> {
        self.device.bind()?;
        let mut polls = 0u32;
        loop {
            // SAFETY: a live, recorded event.
            let r = unsafe { cu::cuEventQuery(self.event) };
            match r {
                cu::CUresult::CUDA_SUCCESS => return Ok(()),
                cu::CUresult::CUDA_ERROR_NOT_READY => {}
                r => return check(r, "cuEventQuery"),
            }
            polls += 1;
            if polls < 16 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(20));
            }
        }
    }

    fn is_done(&self) -> bool {
        if self.device.bind().is_err() {
            return false;
        }
        // SAFETY: a live event.
        unsafe { cu::cuEventQuery(self.event) == cu::CUresult::CUDA_SUCCESS }
    }

    fn wait_on_stream(&self, stream: u64) -> Result<()> {
        self.device.bind()?;
        // SAFETY: a live event; `stream` is the caller's stream handle of this context.
        let r = unsafe { cu::cuStreamWaitEvent(stream as cu::CUstream, self.event, 0) };
        check(r, "cuStreamWaitEvent")
    }
}

impl Drop for CudaFence {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: created in `record`, destroyed once (pending work is unaffected).
            unsafe { cu::cuEventDestroy_v2(self.event) };
        }
    }
}

/// A stream of its own as a copy queue.
struct CudaQueue {
    device: Arc<CudaDevice>,
    stream: cu::CUstream,
    /// The pool the stream goes back to.
    pool: usize,
}

// SAFETY: a stream handle may be used from any thread with the context current.
unsafe impl Send for CudaQueue {}

impl CopyQueue for CudaQueue {
    unsafe fn device_to_host(&mut self, src: u64, dst: *mut u8, len: usize) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the caller guarantees both ranges (trait contract).
        let r = unsafe { cu::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.stream) };
        check(r, "cuMemcpyDtoHAsync")
    }

    unsafe fn host_to_device(&mut self, src: *const u8, dst: u64, len: usize) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the caller guarantees both ranges (trait contract).
        let r = unsafe { cu::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.stream) };
        check(r, "cuMemcpyHtoDAsync")
    }

    fn fence(&mut self) -> Result<Box<dyn DeviceFence>> {
        Ok(Box::new(CudaFence::record(&self.device, self.stream)?))
    }

    fn wait_for(&mut self, fence: &dyn DeviceFence) -> Result<()> {
        fence.wait_on_stream(self.stream as u64)
    }

    fn drain(&mut self) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the queue's own live stream.
        let r = unsafe { cu::cuStreamSynchronize(self.stream) };
        check(r, "cuStreamSynchronize")
    }
}

impl Drop for CudaQueue {
    fn drop(&mut self) {
        // Streams are pooled: work still queued stays ordered before any later use.
        self.device.give_stream(self.pool, self.stream);
    }
}

impl GpuDevice for CudaDevice {
    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    fn ordinal(&self) -> u32 {
        self.ordinal
    }

    fn copy_queue(&self) -> Result<Box<dyn CopyQueue>> {
        self.bind()?;
        Ok(Box::new(CudaQueue { device: self.arc(), stream: self.take_stream(0)?, pool: 0 }))
    }

    fn copy_queue_toward(&self, way: CopyWay) -> Result<Box<dyn CopyQueue>> {
        self.bind()?;
        let pool = match way {
            CopyWay::ToDevice => 1,
            CopyWay::ToHost => 2,
        };
        Ok(Box::new(CudaQueue { device: self.arc(), stream: self.take_stream(pool)?, pool }))
    }

    unsafe fn pin_host(&self, ptr: *mut u8, len: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller keeps the range mapped until unpin_host (trait contract).
        let r =
            unsafe { cu::cuMemHostRegister_v2(ptr.cast(), len, cu::CU_MEMHOSTREGISTER_PORTABLE) };
        check(r, "cuMemHostRegister")
    }

    unsafe fn unpin_host(&self, ptr: *mut u8) -> Result<()> {
        self.bind()?;
        // SAFETY: pinned by `pin_host` (trait contract).
        check(unsafe { cu::cuMemHostUnregister(ptr.cast()) }, "cuMemHostUnregister")
    }

    unsafe fn crc32c_units(&self, ptr: u64, len: u64, unit: u64) -> Result<Vec<u32>> {
        if len == 0 {
            return Ok(Vec::new());
        }
        if unit == 0 {
            return Err(Error::InvalidArgument("crc32c units of 0 bytes".into()));
        }
        let kernel = self.crc_kernel()?;
        self.bind()?;
        let (part, parts_per_unit) = crate::gpucrc::parts_of(unit);
        let units = len.div_ceil(unit);
        let n = units * parts_per_unit;
        let blocks = u32::try_from(n)
            .map_err(|_| Error::InvalidArgument(format!("{n} crc32c parts in one call")))?;
        let ppu = parts_per_unit as u32;
        let stream = self.take_stream(0)?;
        let result = (|| {
            let mut out: cu::CUdeviceptr = 0;
            // SAFETY: context current; valid out pointer; freed below on the same stream.
            let r = unsafe { cu::cuMemAllocAsync(&mut out, n as usize * 4, stream) };
            check(r, "cuMemAllocAsync")?;
            let (mut a0, mut a1, mut a2, mut a3, mut a4, mut a5) = (ptr, len, unit, part, ppu, out);
            let mut params: [*mut c_void; 6] = [
                (&raw mut a0).cast(),
                (&raw mut a1).cast(),
                (&raw mut a2).cast(),
                (&raw mut a3).cast(),
                (&raw mut a4).cast(),
                (&raw mut a5).cast(),
            ];
            let mut host = vec![0u32; n as usize];
            // SAFETY: the kernel reads `[ptr, ptr + len)` (live device memory, caller's
            // contract) and writes `n` u32 into `out`; the parameters match its signature
            // (const uchar*, u64, u64, u64, uint, uint*) and outlive the launch call.
            let r = unsafe {
                cu::cuLaunchKernel(
                    kernel.function,
                    blocks,
                    1,
                    1,
                    crate::gpucrc::THREADS as u32,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            let launched = check(r, "cuLaunchKernel(crc32c)").and_then(|()| {
                // SAFETY: `host` holds `n` u32 and is read only after the synchronize below.
                let r = unsafe {
                    cu::cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), out, n as usize * 4, stream)
                };
                check(r, "cuMemcpyDtoHAsync(crc32c)")
            });
            // SAFETY: allocated above on this stream.
            unsafe { cu::cuMemFreeAsync(out, stream) };
            // SAFETY: a stream of this context.
            let synced = check(unsafe { cu::cuStreamSynchronize(stream) }, "cuStreamSynchronize");
            launched?;
            synced?;
            Ok(crate::gpucrc::combine_parts(&host, len, unit))
        })();
        self.give_stream(0, stream);
        result
    }

    unsafe fn memset(&self, ptr: u64, len: u64, value: u8) -> Result<()> {
        self.bind()?;
        let stream = self.take_stream(0)?;
        // SAFETY: the caller guarantees the device range (trait contract).
        let r = unsafe { cu::cuMemsetD8Async(ptr, value, len as usize, stream) };
        // SAFETY: a stream of this context.
        let synced = unsafe { cu::cuStreamSynchronize(stream) };
        self.give_stream(0, stream);
        check(r, "cuMemsetD8Async")?;
        check(synced, "cuStreamSynchronize")
    }

    fn direct_storage(&self, paths: &[PathBuf]) -> Result<Arc<dyn DirectStorage>> {
        Ok(Arc::new(GdsIo::open(self.arc(), paths)?))
    }

    fn record_on_stream(&self, stream: u64) -> Result<Box<dyn DeviceFence>> {
        Ok(Box::new(CudaFence::record(&self.arc(), stream as cu::CUstream)?))
    }
}

// ---------------------------------------------------------------------------------------------

struct TierState {
    used_bytes: u64,
    cached_bytes: u64,
    /// Freed allocations by size, kept for reuse.
    free: HashMap<u64, Vec<u64>>,
}

struct TierInner {
    device: Arc<CudaDevice>,
    gpu: Arc<dyn GpuDevice>,
    name: String,
    capacity_bytes: u64,
    state: Mutex<TierState>,
    /// Allocations made (cuMemAlloc) and freed (cuMemFree) so far.
    allocs: std::sync::atomic::AtomicU64,
    frees: std::sync::atomic::AtomicU64,
}

impl TierInner {
    fn free_now(&self, ptr: u64) {
        self.device.cufile_deregister(ptr);
        self.frees.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: allocated by cuMemAlloc in `alloc`, no longer handed out.
        unsafe { cu::cuMemFree_v2(ptr) };
    }

    fn release(&self, ptr: u64, bytes: u64) {
        let mut st = self.state.lock();
        st.used_bytes -= bytes;
        st.cached_bytes += bytes;
        st.free.entry(bytes).or_default().push(ptr);
    }

    /// Free cached allocations until `need` more bytes fit next to the live and cached ones.
    fn evict(&self, st: &mut TierState, need: u64, all: bool) {
        let mut victims = Vec::new();
        while st.cached_bytes > 0
            && (all || st.used_bytes + st.cached_bytes + need > self.capacity_bytes)
        {
            let Some(&key) = st.free.keys().next() else { break };
            let list = st.free.get_mut(&key).expect("listed");
            if let Some(p) = list.pop() {
                st.cached_bytes -= key;
                victims.push(p);
            }
            if list.is_empty() {
                st.free.remove(&key);
            }
        }
        if !victims.is_empty() && self.device.bind().is_ok() {
            victims.into_iter().for_each(|p| self.free_now(p));
        }
    }
}

impl Drop for TierInner {
    fn drop(&mut self) {
        let mut st = std::mem::replace(
            &mut *self.state.lock(),
            TierState { used_bytes: 0, cached_bytes: 0, free: HashMap::new() },
        );
        st.cached_bytes = 1; // evict everything
        if self.device.bind().is_ok() {
            for (_, list) in st.free.drain() {
                list.into_iter().for_each(|p| self.free_now(p));
            }
        }
    }
}

/// CUDA device memory as a memory tier with a byte budget. Freed allocations are cached by
/// size and reused; the cache is trimmed when a new size would not fit.
pub struct CudaTier {
    inner: Arc<TierInner>,
}

impl CudaTier {
    /// A tier of at most `capacity_bytes` on `device`; 0 means 90% of the memory free now.
    pub fn new(device: Arc<CudaDevice>, capacity_bytes: u64) -> Result<Arc<CudaTier>> {
        let capacity_bytes = match capacity_bytes {
            0 => device.memory_info()?.0 / 10 * 9,
            n => n,
        };
        Ok(Arc::new(CudaTier {
            inner: Arc::new(TierInner {
                gpu: device.gpu(),
                name: device.name(),
                device,
                capacity_bytes,
                state: Mutex::new(TierState {
                    used_bytes: 0,
                    cached_bytes: 0,
                    free: HashMap::new(),
                }),
                allocs: Default::default(),
                frees: Default::default(),
            }),
        }))
    }

    /// The GPU.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.inner.device
    }

    /// Bytes of freed allocations kept for reuse.
    pub fn cached_bytes(&self) -> u64 {
        self.inner.state.lock().cached_bytes
    }

    /// cuMemAlloc and cuMemFree calls so far.
    pub fn driver_calls(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.inner.allocs.load(Relaxed), self.inner.frees.load(Relaxed))
    }

    /// Free every cached allocation.
    pub fn trim(&self) {
        let mut st = self.inner.state.lock();
        self.inner.evict(&mut st, 0, true);
    }
}

/// Allocation granularity of the tier (sizes are rounded up to it, so similar sizes share
/// cached allocations and O_DIRECT-sized tails stay inside the allocation).
const TIER_GRANULE: u64 = 4096;

impl MemoryTier for CudaTier {
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn alloc(&self, bytes: u64) -> Result<TensorMem> {
        if bytes == 0 {
            return Err(Error::InvalidArgument("a GPU tensor of 0 bytes".into()));
        }
        let key = bytes.next_multiple_of(TIER_GRANULE);
        let inner = &self.inner;
        let mut st = inner.state.lock();
        if st.used_bytes + key > inner.capacity_bytes {
            return Err(Error::NoSpace(format!(
                "tier {}: {key} bytes requested, {} of {} in use",
                inner.name, st.used_bytes, inner.capacity_bytes
            )));
        }
        let ptr = match st.free.get_mut(&key).and_then(Vec::pop) {
            Some(p) => {
                st.cached_bytes -= key;
                p
            }
            None => {
                inner.evict(&mut st, key, false);
                inner.device.bind()?;
                let mut p: cu::CUdeviceptr = 0;
                // SAFETY: context current; valid out pointer.
                let mut r = unsafe { cu::cuMemAlloc_v2(&mut p, key as usize) };
                if r == cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                    inner.evict(&mut st, key, true);
                    // SAFETY: as above.
                    r = unsafe { cu::cuMemAlloc_v2(&mut p, key as usize) };
                }
                if r == cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                    return Err(Error::NoSpace(format!(
                        "tier {}: cuMemAlloc of {key} bytes: out of GPU memory",
                        inner.name
                    )));
                }
                check(r, "cuMemAlloc")?;
                inner.allocs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                p
            }
        };
        st.used_bytes += key;
        drop(st);
        Ok(TensorMem::Device(Box::new(CudaMem {
            device: inner.device.clone(),
            gpu: inner.gpu.clone(),
            ptr,
            len: bytes,
            owner: Owner::Tier { tier: inner.clone(), bytes: key },
            ready: None,
        })))
    }

    fn capacity_bytes(&self) -> u64 {
        self.inner.capacity_bytes
    }

    fn used_bytes(&self) -> u64 {
        self.inner.state.lock().used_bytes
    }
}

enum Owner {
    Tier { tier: Arc<TierInner>, bytes: u64 },
    Foreign,
}

/// One tensor's CUDA memory: from a [`CudaTier`] (returned to it on drop) or owned by a
/// trainer ([`wrap_foreign`](Self::wrap_foreign); only forgotten on drop).
pub struct CudaMem {
    device: Arc<CudaDevice>,
    gpu: Arc<dyn GpuDevice>,
    ptr: u64,
    len: u64,
    owner: Owner,
    ready: Option<Box<dyn DeviceFence>>,
}

/// Device pointers handed in must be aligned to this (cudaMalloc gives 256).
pub const FOREIGN_ALIGN_BYTES: u64 = 16;

impl CudaMem {
    /// Memory a trainer owns (a PyTorch tensor's storage): `len` bytes at device address `ptr`
    /// on `device`. Checked: device memory of this GPU (not host or managed memory), aligned to
    /// [`FOREIGN_ALIGN_BYTES`], inside one allocation. The trainer keeps it alive while the
    /// store uses it (until the operation's handle completes).
    pub fn wrap_foreign(device: &Arc<CudaDevice>, ptr: u64, len: u64) -> Result<TensorMem> {
        if len == 0 {
            return Err(Error::InvalidArgument("a GPU tensor of 0 bytes".into()));
        }
        if !ptr.is_multiple_of(FOREIGN_ALIGN_BYTES) {
            return Err(Error::Misaligned {
                what: "device pointer",
                value: ptr,
                align: FOREIGN_ALIGN_BYTES,
            });
        }
        device.bind()?;
        // One driver call for the four attributes (a trainer wraps thousands of tensors a step).
        let (mut mem_type, mut ordinal, mut start, mut size): (u32, i32, u64, u64) = (0, -1, 0, 0);
        let mut attrs = [
            cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        ];
        let mut data: [*mut c_void; 4] = [
            (&raw mut mem_type).cast(),
            (&raw mut ordinal).cast(),
            (&raw mut start).cast(),
            (&raw mut size).cast(),
        ];
        // SAFETY: `attrs` and `data` have 4 entries each; each data pointer points to storage of
        // its attribute's type (u32, i32, u64, u64), alive for the call.
        let r =
            unsafe { cu::cuPointerGetAttributes(4, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr) };
        if r != cu::CUresult::CUDA_SUCCESS
            || mem_type != cu::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32
        {
            return Err(Error::InvalidArgument(format!(
                "{ptr:#x} is not CUDA device memory (cuPointerGetAttributes: {r:?}, memory type {mem_type})"
            )));
        }
        if ordinal != device.ordinal as i32 {
            return Err(Error::InvalidArgument(format!(
                "{ptr:#x} is memory of GPU {ordinal}, not of GPU {}",
                device.ordinal
            )));
        }
        if ptr.checked_add(len).is_none_or(|end| end > start + size) {
            return Err(Error::InvalidArgument(format!(
                "{len} bytes at {ptr:#x} run past their allocation ({size} bytes at {start:#x})"
            )));
        }
        Ok(TensorMem::Device(Box::new(CudaMem {
            device: device.clone(),
            gpu: device.gpu(),
            ptr,
            len,
            owner: Owner::Foreign,
            ready: None,
        })))
    }

    /// The registration length for cuFile: the whole allocation of tier memory.
    fn registered_len(&self) -> usize {
        match &self.owner {
            Owner::Tier { bytes, .. } => *bytes as usize,
            Owner::Foreign => self.len as usize,
        }
    }
}

impl DeviceMemory for CudaMem {
    fn len(&self) -> u64 {
        self.len
    }
    fn device_ptr(&self) -> u64 {
        self.ptr
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

impl Drop for CudaMem {
    fn drop(&mut self) {
        // Work still writing into the memory (a prefetch's last copy) finishes first.
        if let Some(f) = self.ready.take() {
            let _ = f.wait();
        }
        match &self.owner {
            Owner::Tier { tier, bytes } => tier.release(self.ptr, *bytes),
            Owner::Foreign => self.device.cufile_deregister(self.ptr),
        }
    }
}

#[cfg(test)]
mod tests;
