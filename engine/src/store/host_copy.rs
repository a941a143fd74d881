//! The host tier's copies of tensors ([`HostCopy`]) and the memory of those dropped while
//! asynchronous copies to the GPU still read it ([`Graveyard`]).

use std::sync::Arc;

use parking_lot::Mutex;

use crate::Result;
use crate::tier::{DeviceFence, TensorMem};

/// A tensor's copy in the host tier. A prefetch into device memory copies it asynchronously
/// (the worker does not wait for the GPU): the copy's fences are kept here, and a copy dropped
/// while one is still reading it goes to the store's [`Graveyard`] instead of back to the tier.
pub(super) struct HostCopy {
    mem: Option<TensorMem>,
    readers: Vec<Box<dyn DeviceFence>>,
    /// The copy from device memory that writes it, while queued on the device (an offload from
    /// device memory does not wait for it): readers wait for it first.
    written: Option<Box<dyn DeviceFence>>,
    graveyard: Arc<Graveyard>,
}

impl HostCopy {
    pub(super) fn new(mem: TensorMem, graveyard: Arc<Graveyard>) -> Self {
        Self { mem: Some(mem), readers: Vec::new(), written: None, graveyard }
    }

    /// A copy whose bytes arrive when `written` completes.
    pub(super) fn being_written(
        mem: TensorMem,
        written: Box<dyn DeviceFence>,
        graveyard: Arc<Graveyard>,
    ) -> Self {
        Self { mem: Some(mem), readers: Vec::new(), written: Some(written), graveyard }
    }

    /// The fence of the copy still writing it, if any (cleared once it is done).
    fn pending_write(&mut self) -> Option<&dyn DeviceFence> {
        if self.written.as_ref().is_some_and(|w| w.is_done()) {
            self.written = None;
        }
        self.written.as_deref()
    }

    /// Copy into `dst`: host memory to device memory queued without blocking (the copy waits on
    /// the device for `dst`'s ready fence, `dst`'s ready fence becomes the copy's); anything
    /// else synchronously.
    pub(super) fn copy_into(&mut self, dst: &mut TensorMem) -> Result<()> {
        self.pending_write();
        let mem = self.mem.as_ref().expect("a live host copy holds its memory");
        match (mem.host(), dst) {
            (Some(src), TensorMem::Device(d)) => {
                // SAFETY: `src` is this copy's memory, written only by the offload that made it
                // (`written`, which the copy waits for on the device); it is released only once
                // `f` completed (kept in `readers`, then the graveyard).
                let f = unsafe {
                    crate::tier::device::copy_in_async(d.as_mut(), src, self.written.as_deref())?
                };
                self.readers.retain(|r| !r.is_done());
                self.readers.push(f);
                Ok(())
            }
            (_, dst) => {
                if let Some(w) = &self.written {
                    w.wait()?;
                }
                mem.copy_into(dst)
            }
        }
    }
}

impl Drop for HostCopy {
    fn drop(&mut self) {
        self.readers.retain(|r| !r.is_done());
        // A copy still writing the memory keeps it from the tier like a reader does.
        if let Some(w) = self.written.take()
            && !w.is_done()
        {
            self.readers.push(w);
        }
        if let Some(mem) = self.mem.take()
            && !self.readers.is_empty()
        {
            self.graveyard.bury(std::mem::take(&mut self.readers), mem);
        }
    }
}

/// Host-tier memory whose copy was dropped while asynchronous copies to the GPU still read it:
/// released once they complete (reaped before the tier allocates, drained when it is full, and
/// waited for when the store closes).
#[derive(Default)]
pub(super) struct Graveyard(Mutex<Vec<Buried>>);

/// Memory and the copies still reading it.
type Buried = (Vec<Box<dyn DeviceFence>>, TensorMem);

impl Graveyard {
    fn bury(&self, readers: Vec<Box<dyn DeviceFence>>, mem: TensorMem) {
        self.0.lock().push((readers, mem));
    }

    /// Release the memory no copy reads any more; returns how many bytes.
    pub(super) fn reap(&self) -> u64 {
        let done: Vec<Buried> = {
            let mut g = self.0.lock();
            let (done, pending) = std::mem::take(&mut *g)
                .into_iter()
                .partition(|(r, _): &Buried| r.iter().all(|f| f.is_done()));
            *g = pending;
            done
        };
        done.iter().map(|(_, m)| m.len()).sum()
    }

    /// Wait for every copy still reading buried memory, then release it all; returns how many
    /// bytes.
    pub(super) fn drain(&self) -> Result<u64> {
        let all = std::mem::take(&mut *self.0.lock());
        let bytes = all.iter().map(|(_, m)| m.len()).sum();
        let mut first = None;
        for (readers, mem) in all {
            for f in &readers {
                if let Err(e) = f.wait() {
                    first.get_or_insert(e);
                }
            }
            drop(mem);
        }
        first.map_or(Ok(bytes), Err)
    }

    /// Buried memory, bytes.
    pub(super) fn bytes(&self) -> u64 {
        self.0.lock().iter().map(|(_, m)| m.len()).sum()
    }
}

impl Drop for Graveyard {
    fn drop(&mut self) {
        if let Err(e) = self.drain() {
            crate::notice::error(format!("waiting for copies from the host tier failed: {e}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::tier::MemoryTier;

    /// A fence that completes when the test says so (a copy still running on the device).
    struct Pending(Arc<AtomicBool>);

    impl DeviceFence for Pending {
        fn wait(&self) -> Result<()> {
            self.0.store(true, Ordering::SeqCst);
            Ok(())
        }
        fn is_done(&self) -> bool {
            self.0.load(Ordering::SeqCst)
        }
        fn wait_on_stream(&self, _stream: u64) -> Result<()> {
            Ok(())
        }
    }

    fn tier_mem(tier: &Arc<dyn MemoryTier>, bytes: u64) -> TensorMem {
        tier.alloc(bytes).unwrap()
    }

    #[test]
    fn a_host_copy_still_read_is_released_only_when_its_copies_complete() {
        let tier: Arc<dyn MemoryTier> = crate::tier::HostTier::new("host", 8 << 20).unwrap();
        let graveyard = Arc::new(Graveyard::default());
        let done = Arc::new(AtomicBool::new(false));
        let mut copy = HostCopy::new(tier_mem(&tier, 1 << 20), graveyard.clone());
        copy.readers.push(Box::new(Pending(done.clone())));
        drop(copy);
        assert_eq!(tier.used_bytes(), 1 << 20, "a copy still reads it: buried, not released");
        assert_eq!(graveyard.bytes(), 1 << 20);
        assert_eq!(graveyard.reap(), 0, "nothing to reap while the copy runs");
        assert_eq!(tier.used_bytes(), 1 << 20);
        done.store(true, Ordering::SeqCst);
        assert_eq!(graveyard.reap(), 1 << 20);
        assert_eq!(tier.used_bytes(), 0, "released once the copy completed");
        // A copy nobody reads goes straight back.
        drop(HostCopy::new(tier_mem(&tier, 1 << 20), graveyard.clone()));
        assert_eq!((tier.used_bytes(), graveyard.bytes()), (0, 0));
    }

    #[test]
    fn a_host_copy_still_being_written_waits_for_its_write() {
        let tier: Arc<dyn MemoryTier> = crate::tier::HostTier::new("host", 8 << 20).unwrap();
        let graveyard = Arc::new(Graveyard::default());
        // Dropped while its write is queued: buried until the write completes.
        let done = Arc::new(AtomicBool::new(false));
        let copy = HostCopy::being_written(
            tier_mem(&tier, 1 << 20),
            Box::new(Pending(done.clone())),
            graveyard.clone(),
        );
        drop(copy);
        assert_eq!(graveyard.bytes(), 1 << 20, "a copy still writes it: buried");
        assert_eq!(graveyard.reap(), 0);
        done.store(true, Ordering::SeqCst);
        assert_eq!(graveyard.reap(), 1 << 20);
        assert_eq!(tier.used_bytes(), 0);
        // Read into host memory: the reader waits for the write first.
        let written = Arc::new(AtomicBool::new(false));
        let mut copy = HostCopy::being_written(
            tier_mem(&tier, 4096),
            Box::new(Pending(written.clone())),
            graveyard.clone(),
        );
        assert!(copy.pending_write().is_some());
        let mut dst = tier_mem(&tier, 4096);
        copy.copy_into(&mut dst).unwrap();
        assert!(written.load(Ordering::SeqCst), "the read waited for the write");
        assert!(copy.pending_write().is_none(), "a completed write is forgotten");
        drop(copy);
        assert_eq!(graveyard.bytes(), 0, "nothing pending: straight back to the tier");
    }

    #[test]
    fn drain_waits_for_every_reader_and_dropping_the_graveyard_drains_it() {
        let tier: Arc<dyn MemoryTier> = crate::tier::HostTier::new("host", 8 << 20).unwrap();
        let graveyard = Arc::new(Graveyard::default());
        let flags: Vec<_> = (0..3).map(|_| Arc::new(AtomicBool::new(false))).collect();
        for f in &flags[..2] {
            let mut copy = HostCopy::new(tier_mem(&tier, 1 << 20), graveyard.clone());
            copy.readers.push(Box::new(Pending(f.clone())));
        }
        assert_eq!(graveyard.drain().unwrap(), 2 << 20);
        assert!(flags[..2].iter().all(|f| f.load(Ordering::SeqCst)), "every reader waited for");
        assert_eq!(tier.used_bytes(), 0);
        let mut copy = HostCopy::new(tier_mem(&tier, 1 << 20), graveyard.clone());
        copy.readers.push(Box::new(Pending(flags[2].clone())));
        drop(copy);
        drop(graveyard);
        assert!(flags[2].load(Ordering::SeqCst), "the graveyard waited before letting go");
        assert_eq!(tier.used_bytes(), 0);
    }
}
