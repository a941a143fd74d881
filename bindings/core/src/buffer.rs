//! Engine host memory that foreign callers hold pointers into.
//!
//! The store takes memory by value ([`TensorMem`]) and may keep it (a failed offload leaves it
//! held) or drop it (a failed prefetch, a consumed held copy). A Python array or a C pointer
//! into that memory must never see it handed to someone else. So every [`HostBuffer`] gets a
//! [`BufferPool`] of its own, sized for exactly one buffer: whatever the store does with the
//! [`IoBuf`], the memory goes back to this private pool, stays mapped while the `HostBuffer`
//! lives, and is the only thing the pool can hand out again. Taking the buffer back is then
//! "allocate from the private pool": it succeeds exactly when the store no longer holds the
//! memory, and returns the same address.

use std::sync::Arc;

use parking_lot::Mutex;
use teraio_engine::pool::{BufferPool, HUGE_PAGE_BYTES, IoBuf, PoolConfig};
use teraio_engine::tier::TensorMem;

use crate::{Error, Result};

/// An aligned host buffer (4 KiB, 2 MiB from 2 MiB up) with a stable address, which the
/// engine's store reads and writes directly. `Send + Sync`; share it as `Arc<HostBuffer>`.
pub struct HostBuffer {
    pool: Arc<BufferPool>,
    len: usize,
    addr: usize,
    state: Mutex<State>,
}

enum State {
    /// The buffer owns its memory.
    Home(IoBuf),
    /// The store has it (an operation in flight, or it kept it after a failure).
    Lent,
    /// Given back by [`HostBuffer::release`].
    Released,
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer").field("len", &self.len).field("addr", &self.addr).finish()
    }
}

impl HostBuffer {
    /// A buffer of `len` bytes (contents undefined: a fresh mapping reads as zeros).
    pub fn new(len: u64) -> Result<Arc<HostBuffer>> {
        if len == 0 {
            return Err(Error::InvalidArgument("a host buffer of 0 bytes".into()));
        }
        let len = usize::try_from(len)
            .map_err(|_| Error::InvalidArgument(format!("{len} bytes do not fit in memory")))?;
        let capacity = BufferPool::capacity_for(len);
        let pool = BufferPool::new(PoolConfig {
            capacity_bytes: capacity as u64,
            // Huge pages only matter from 2 MiB up (and asking prints a notice when absent).
            prefer_huge_pages: capacity >= HUGE_PAGE_BYTES,
        })?;
        let mut buf = pool.alloc(len)?;
        let addr = buf.as_mut_ptr() as usize;
        Ok(Arc::new(HostBuffer { pool, len, addr, state: Mutex::new(State::Home(buf)) }))
    }

    /// Bytes of the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes (never: a buffer has at least one).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Address of the first byte. Valid for [`len`](Self::len) bytes until this `HostBuffer`
    /// is dropped (also after [`release`](Self::release): the mapping lives as long as the
    /// object; only its use for I/O ends).
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Whether the store has the memory now (an operation in flight or a failure it kept).
    /// Tries to take it back first.
    pub fn is_busy(&self) -> bool {
        let mut st = self.state.lock();
        self.reclaim(&mut st);
        matches!(*st, State::Lent)
    }

    /// Whether [`release`](Self::release) was called.
    pub fn is_released(&self) -> bool {
        matches!(*self.state.lock(), State::Released)
    }

    /// Hand the memory to the store for an operation on tensor `tensor`. Errors when the
    /// buffer is busy (an operation in flight, or the store kept it after a failure) or
    /// released.
    pub fn lend(&self, tensor: u64) -> Result<TensorMem> {
        let mut st = self.state.lock();
        self.reclaim(&mut st);
        match std::mem::replace(&mut *st, State::Lent) {
            State::Home(b) => Ok(TensorMem::Host(b)),
            State::Lent => Err(Error::InvalidState(format!(
                "tensor {tensor}: the engine buffer at {:#x} is busy with another operation \
                 (wait for it first)",
                self.addr
            ))),
            State::Released => {
                *st = State::Released;
                Err(Error::InvalidArgument(format!(
                    "tensor {tensor}: the engine buffer at {:#x} was released",
                    self.addr
                )))
            }
        }
    }

    /// Take the memory back from a finished operation. Memory that is not this buffer's (never
    /// the case for memory lent by [`lend`](Self::lend)) is dropped.
    pub fn restore(&self, mem: TensorMem) {
        let TensorMem::Host(mut b) = mem else { return };
        if b.as_mut_ptr() as usize != self.addr {
            debug_assert!(false, "memory of another buffer handed back");
            return;
        }
        b.set_len(self.len);
        let mut st = self.state.lock();
        if matches!(*st, State::Lent) {
            *st = State::Home(b);
        }
    }

    /// Stop using the buffer for I/O and give its memory back (the mapping itself goes when
    /// the object is dropped). Errors while the store has the memory.
    pub fn release(&self) -> Result<()> {
        let mut st = self.state.lock();
        self.reclaim(&mut st);
        match &*st {
            State::Lent => Err(Error::InvalidState(format!(
                "the engine buffer at {:#x} is busy with an operation; wait for it before \
                 releasing it",
                self.addr
            ))),
            _ => {
                *st = State::Released;
                Ok(())
            }
        }
    }

    /// When the store dropped the memory (a failed prefetch, a consumed held copy), it went
    /// back to the private pool: allocate it again, same address.
    fn reclaim(&self, st: &mut State) {
        if !matches!(st, State::Lent) {
            return;
        }
        if let Ok(mut b) = self.pool.alloc(self.len) {
            assert_eq!(
                b.as_mut_ptr() as usize,
                self.addr,
                "a private buffer pool handed out another address"
            );
            *st = State::Home(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lent_memory_dropped_by_the_store_comes_back_at_the_same_address_with_its_bytes() {
        for len in [1u64, 4097, 3 << 20] {
            let buf = HostBuffer::new(len).unwrap();
            let mut mem = buf.lend(1).unwrap();
            mem.host_mut().unwrap().fill(0x5a);
            assert!(buf.lend(2).is_err(), "busy while lent");
            assert!(buf.is_busy());
            assert!(buf.release().is_err(), "no release while lent");
            drop(mem); // what the store does on a failed prefetch
            assert!(!buf.is_busy());
            let mem = buf.lend(3).unwrap();
            assert_eq!(mem.host().unwrap().as_ptr() as usize, buf.addr());
            assert!(mem.host().unwrap().iter().all(|&b| b == 0x5a));
            assert_eq!(mem.len(), len);
            buf.restore(mem);
            buf.release().unwrap();
            assert!(buf.is_released());
            let e = buf.lend(4).unwrap_err();
            assert!(e.to_string().contains("released"), "{e}");
        }
        assert!(HostBuffer::new(0).is_err());
    }
}
