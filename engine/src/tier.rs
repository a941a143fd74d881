//! Memory tiers: where a tensor lives when it is not on SSD.
//!
//! A tier hands out [`TensorMem`], the memory that holds one tensor. Host memory (from the
//! huge-page [`BufferPool`]) is the default tier and also what `teraio run` uses to emulate GPU
//! memory; a CUDA tier arrives through the same trait. The store moves host memory to and from
//! the SSD array directly (zero copy); memory the kernel cannot address directly (CUDA device
//! memory without GPUDirect Storage) implements [`StagedMemory`] and is moved through pinned host
//! staging buffers. Device memory ([`TensorMem::Device`], CUDA or its host emulation) moves
//! through the store's GPU data paths (`store::gpu`): a pipelined pinned bounce or GPUDirect
//! Storage.

pub(crate) mod device;
mod host_device;

use std::sync::Arc;

pub use device::{
    CopyQueue, CopyWay, DeviceFence, DeviceMemory, DirectMode, DirectStorage, GpuDevice, GpuPinner,
};
pub use host_device::{HostDevice, HostDeviceTier};

use crate::pool::{BufferPool, IoBuf, PoolConfig};
use crate::{Error, Result};

/// Memory that cannot be handed to the I/O backend directly; the store copies it through host
/// staging buffers.
pub trait StagedMemory: Send {
    /// Bytes of the tensor this memory holds.
    fn len(&self) -> u64;
    /// Whether the memory is empty (no bytes).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copy `dst.len()` bytes starting at `offset` out of this memory into `dst`.
    fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<()>;
    /// Copy `src` into this memory at `offset`.
    fn copy_in(&mut self, offset: u64, src: &[u8]) -> Result<()>;
}

/// Host memory a caller owns at a raw address (a Python buffer export, a C caller's pointer),
/// moved through staging buffers: the one raw-memory type both bindings use, built only by the
/// unsafe [`TensorMem::caller`].
struct CallerMemory {
    addr: usize,
    len: usize,
    /// What keeps the memory alive, if the caller's contract alone does not (a buffer export).
    _keep: Option<Box<dyn Send>>,
}

impl CallerMemory {
    /// `offset`'s index when `n` bytes from it lie inside the memory.
    fn range(&self, offset: u64, n: usize) -> Result<usize> {
        match usize::try_from(offset).ok().and_then(|o| o.checked_add(n).map(|end| (o, end))) {
            Some((o, end)) if end <= self.len => Ok(o),
            _ => Err(Error::InvalidArgument(format!(
                "range {offset}+{n} is outside a buffer of {} bytes",
                self.len
            ))),
        }
    }
}

impl StagedMemory for CallerMemory {
    fn len(&self) -> u64 {
        self.len as u64
    }

    fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let o = self.range(offset, dst.len())?;
        // SAFETY: `TensorMem::caller`'s contract: [addr, addr + len) is live, readable memory
        // while this object lives; the range was checked; `dst` is engine memory, so the two do
        // not overlap.
        let src = unsafe { std::slice::from_raw_parts((self.addr + o) as *const u8, dst.len()) };
        dst.copy_from_slice(src);
        Ok(())
    }

    fn copy_in(&mut self, offset: u64, src: &[u8]) -> Result<()> {
        let o = self.range(offset, src.len())?;
        // SAFETY: as in copy_out; the memory is writable by the same contract.
        let dst = unsafe { std::slice::from_raw_parts_mut((self.addr + o) as *mut u8, src.len()) };
        dst.copy_from_slice(src);
        Ok(())
    }
}

/// The memory holding one tensor in some tier. Dropping it returns the memory to its tier.
pub enum TensorMem {
    /// Host memory from a buffer pool: the I/O backends read and write it directly.
    Host(IoBuf),
    /// Memory moved through host staging buffers by synchronous copies.
    Staged(Box<dyn StagedMemory>),
    /// Device (GPU) memory: moved by the store's pipelined bounce or GPUDirect Storage.
    Device(Box<dyn DeviceMemory>),
}

impl std::fmt::Debug for TensorMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TensorMem::Host(b) => write!(f, "TensorMem::Host({} bytes)", b.len()),
            TensorMem::Staged(m) => write!(f, "TensorMem::Staged({} bytes)", m.len()),
            TensorMem::Device(m) => write!(
                f,
                "TensorMem::Device({} bytes at {:#x} on {})",
                m.len(),
                m.device_ptr(),
                m.gpu().name()
            ),
        }
    }
}

impl TensorMem {
    /// Host memory of the caller's, `len` bytes at `addr`, moved through staging buffers;
    /// `keep` (dropped with it) holds what keeps it alive, when the caller's contract alone does
    /// not (a Python buffer export).
    ///
    /// # Safety
    /// `[addr, addr + len)` is memory valid for reads and writes, and nothing else uses it, from
    /// now until the returned value is dropped (the executor gives it back).
    pub unsafe fn caller(addr: usize, len: usize, keep: Option<Box<dyn Send>>) -> TensorMem {
        TensorMem::Staged(Box::new(CallerMemory { addr, len, _keep: keep }))
    }

    /// Bytes of the tensor.
    pub fn len(&self) -> u64 {
        match self {
            TensorMem::Host(b) => b.len() as u64,
            TensorMem::Staged(m) => m.len(),
            TensorMem::Device(m) => m.len(),
        }
    }

    /// The device memory, when it is device memory.
    pub fn device(&self) -> Option<&dyn DeviceMemory> {
        match self {
            TensorMem::Device(m) => Some(m.as_ref()),
            _ => None,
        }
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes, when the memory is host memory.
    pub fn host(&self) -> Option<&[u8]> {
        match self {
            TensorMem::Host(b) => Some(&b[..]),
            TensorMem::Staged(_) | TensorMem::Device(_) => None,
        }
    }

    /// The bytes, mutable, when the memory is host memory.
    pub fn host_mut(&mut self) -> Option<&mut [u8]> {
        match self {
            TensorMem::Host(b) => Some(&mut b[..]),
            TensorMem::Staged(_) | TensorMem::Device(_) => None,
        }
    }

    /// Copy `dst.len()` bytes at `offset` out of this memory.
    pub fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        check_range(offset, dst.len(), self.len())?;
        match self {
            TensorMem::Host(b) => {
                let o = offset as usize;
                dst.copy_from_slice(&b[o..o + dst.len()]);
                Ok(())
            }
            TensorMem::Staged(m) => m.copy_out(offset, dst),
            TensorMem::Device(m) => device::copy_out(m.as_ref(), offset, dst),
        }
    }

    /// Copy `src` into this memory at `offset`.
    pub fn copy_in(&mut self, offset: u64, src: &[u8]) -> Result<()> {
        check_range(offset, src.len(), self.len())?;
        match self {
            TensorMem::Host(b) => {
                let o = offset as usize;
                b[o..o + src.len()].copy_from_slice(src);
                Ok(())
            }
            TensorMem::Staged(m) => m.copy_in(offset, src),
            TensorMem::Device(m) => device::copy_in(m.as_mut(), offset, src),
        }
    }

    /// Fill the whole tensor from `src` (exactly its length) in one copy: one DMA for device
    /// memory, instead of many small [`copy_in`](Self::copy_in) calls.
    pub fn fill_from_host(&mut self, src: &[u8]) -> Result<()> {
        if src.len() as u64 != self.len() {
            return Err(Error::InvalidArgument(format!(
                "filling a tensor of {} bytes from {} bytes",
                self.len(),
                src.len()
            )));
        }
        self.copy_in(0, src)
    }

    /// Read the whole tensor into `dst` (exactly its length) in one copy.
    pub fn read_to_host(&self, dst: &mut [u8]) -> Result<()> {
        if dst.len() as u64 != self.len() {
            return Err(Error::InvalidArgument(format!(
                "reading a tensor of {} bytes into {} bytes",
                self.len(),
                dst.len()
            )));
        }
        self.copy_out(0, dst)
    }

    /// Set every byte of the tensor to `value` (a device memset for GPU memory: no host copy).
    pub fn fill_byte(&mut self, value: u8) -> Result<()> {
        match self {
            TensorMem::Host(b) => {
                b.fill(value);
                Ok(())
            }
            TensorMem::Device(m) => {
                if let Some(f) = m.ready() {
                    f.wait()?;
                }
                m.set_ready(None);
                // SAFETY: the tensor's own live device memory, exclusively borrowed.
                unsafe { m.gpu().memset(m.device_ptr(), m.len(), value) }
            }
            TensorMem::Staged(_) => {
                let v = vec![value; self.len() as usize];
                self.copy_in(0, &v)
            }
        }
    }

    /// Make work queued later on the caller's CUDA `stream` wait until the last prefetch into
    /// this memory is complete, without blocking the host (no-op for host memory or when
    /// nothing is pending).
    pub fn wait_ready_on_stream(&self, stream: u64) -> Result<()> {
        match self {
            TensorMem::Device(m) => m.ready().map_or(Ok(()), |f| f.wait_on_stream(stream)),
            _ => Ok(()),
        }
    }

    /// Copy the whole content of `self` into `dst` (same length), through a bounce buffer
    /// when neither side is host memory.
    pub fn copy_into(&self, dst: &mut TensorMem) -> Result<()> {
        if self.len() != dst.len() {
            return Err(Error::InvalidArgument(format!(
                "copy between tensors of {} and {} bytes",
                self.len(),
                dst.len()
            )));
        }
        if let Some(src) = self.host() {
            return dst.copy_in(0, src);
        }
        if let Some(d) = dst.host_mut() {
            return self.copy_out(0, d);
        }
        const CHUNK: usize = 8 << 20;
        let mut bounce = vec![0u8; CHUNK.min(self.len() as usize)];
        let mut off = 0u64;
        while off < self.len() {
            let n = ((self.len() - off) as usize).min(CHUNK);
            self.copy_out(off, &mut bounce[..n])?;
            dst.copy_in(off, &bounce[..n])?;
            off += n as u64;
        }
        Ok(())
    }
}

fn check_range(offset: u64, len: usize, size: u64) -> Result<()> {
    match offset.checked_add(len as u64) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::InvalidArgument(format!(
            "range {offset}+{len} is outside a tensor of {size} bytes"
        ))),
    }
}

/// A kind of memory that holds tensors: host memory, emulated GPU memory, CUDA memory.
pub trait MemoryTier: Send + Sync {
    /// A short name for reports ("host", "emulated-gpu", "cuda:0").
    fn name(&self) -> &str;
    /// Allocate memory for a tensor of `bytes` bytes. `NoSpace` when the tier is full; never
    /// blocks.
    fn alloc(&self, bytes: u64) -> Result<TensorMem>;
    /// The tier's byte cap.
    fn capacity_bytes(&self) -> u64;
    /// Bytes allocated now.
    fn used_bytes(&self) -> u64;
}

/// Host memory with a byte cap, from its own huge-page buffer pool.
pub struct HostTier {
    name: String,
    pool: Arc<BufferPool>,
}

impl HostTier {
    /// A host tier named `name` holding at most `capacity_bytes`.
    pub fn new(name: impl Into<String>, capacity_bytes: u64) -> Result<Arc<Self>> {
        let pool = BufferPool::new(PoolConfig { capacity_bytes, ..PoolConfig::default() })?;
        Ok(Arc::new(Self { name: name.into(), pool }))
    }

    /// The pool behind the tier (for registering its memory with io_uring or CUDA).
    pub fn pool(&self) -> &Arc<BufferPool> {
        &self.pool
    }
}

impl MemoryTier for HostTier {
    fn name(&self) -> &str {
        &self.name
    }

    fn alloc(&self, bytes: u64) -> Result<TensorMem> {
        let len = usize::try_from(bytes)
            .map_err(|_| Error::InvalidArgument(format!("{bytes} bytes do not fit in memory")))?;
        match self.pool.alloc(len) {
            Ok(b) => Ok(TensorMem::Host(b)),
            Err(Error::NoSpace(why)) => Err(Error::NoSpace(format!("tier {}: {why}", self.name))),
            Err(e) => Err(e),
        }
    }

    fn capacity_bytes(&self) -> u64 {
        self.pool.capacity_bytes()
    }

    fn used_bytes(&self) -> u64 {
        self.pool.used_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caller_memory_copies_inside_its_range_and_refuses_outside() {
        let mut backing = vec![0u8; 100];
        // SAFETY: `backing` outlives `mem` and nothing else touches it meanwhile.
        let mut mem = unsafe { TensorMem::caller(backing.as_mut_ptr() as usize, 100, None) };
        assert_eq!(mem.len(), 100);
        let TensorMem::Staged(m) = &mut mem else { panic!("caller memory is staged") };
        m.copy_in(10, &[7; 20]).unwrap();
        let mut out = [0u8; 30];
        m.copy_out(0, &mut out).unwrap();
        assert_eq!(&out[10..30], &[7; 20]);
        assert_eq!(&out[..10], &[0; 10]);
        for (offset, n) in [(90, 11), (100, 1), (u64::MAX, 1), (u64::MAX - 5, 10)] {
            let e = m.copy_in(offset, &vec![1; n]).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
            assert!(m.copy_out(offset, &mut vec![0; n]).is_err());
        }
        drop(mem);
        assert_eq!(backing.iter().filter(|&&b| b == 7).count(), 20, "nothing written outside");
    }
}
