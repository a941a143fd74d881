//! Moving the bytes: the offloads, prefetches and frees a worker runs (extents allocated,
//! written and read striped with their checksums, host-tier copies).

use std::sync::Arc;
use std::time::Instant;

use teraio_layout::StripeMap;

use super::commit::Update;
use super::host_copy::HostCopy;
use super::worker::Outcome;
use super::{Destination, Inner, OffloadOutcome, SsdCopy, TensorKey, chunk_checksums};
use crate::pool::IoBuf;
use crate::tier::{DeviceFence, MemoryTier, TensorMem};
use crate::{Error, Result};

impl Inner {
    /// Give extents back to the allocator: at once in volatile mode, at the next checkpoint in
    /// persistent mode (a crash must never hand one tensor's blocks to another).
    pub(super) fn release_extents(&self, map: &StripeMap) {
        match &self.persist {
            Some(p) => p.defer_free(map.clone()),
            None => {
                if let Err(e) = self.alloc.lock().free_tensor(map) {
                    // The table and the allocator disagree: a bug, never silently ignored.
                    panic!("teraio: allocator rejected the extents of a live tensor: {e}");
                }
            }
        }
    }

    /// Host-tier memory for a copy of `size` bytes: memory whose last reader finished goes back
    /// first; when the tier is full, wait for the readers of what is buried.
    fn host_alloc(&self, tier: &Arc<dyn MemoryTier>, size: u64) -> Result<TensorMem> {
        self.graveyard.reap();
        let mut got = tier.alloc(size);
        if matches!(got, Err(Error::NoSpace(_))) && self.graveyard.bytes() > 0 {
            got = self.graveyard.drain().and_then(|_| tier.alloc(size));
        }
        got
    }

    /// An offload of device memory to the host tier, queued on the device behind `after` (the
    /// caller's queued work): finished as soon as the copy is queued. `src` comes back with the
    /// copy as its ready fence; the host copy is marked as being written until it completes.
    /// Without room in the host tier (or when queuing fails) it runs as a blocking offload.
    pub(super) fn run_offload_queued(
        &self,
        id: TensorKey,
        size: u64,
        mut src: TensorMem,
        name: Option<String>,
        after: Option<Box<dyn DeviceFence>>,
    ) -> (Outcome, Update) {
        let started = Instant::now();
        let queued = match (&self.host_tier, &mut src) {
            (Some(tier), TensorMem::Device(d)) => match self.host_alloc(tier, size) {
                Ok(mut mem) => {
                    let dst = mem.host_mut().expect("host-tier memory is host memory");
                    // SAFETY: `dst` is the new host copy's own memory: nobody reads it before
                    // `written` completes (HostCopy waits for it) and it is released only
                    // after (HostCopy's drop buries it with the fence); `src` comes back to the
                    // caller with the copy as its ready fence.
                    let r = unsafe {
                        crate::tier::device::copy_out_async(d.as_mut(), dst, after.as_deref())
                    };
                    r.ok().map(|written| (mem, written))
                }
                Err(_) => None,
            },
            _ => None,
        };
        let Some((mem, written)) = queued else {
            return match after.map_or(Ok(()), |f| f.wait()) {
                Ok(()) => self.run_offload(id, size, src, Destination::Host, name),
                Err(e) => (Outcome::Offload(Err(e)), Update::Held(src)),
            };
        };
        let mut st = self.stats.lock();
        st.host_write.start(started);
        st.host_write.finish(Instant::now(), started.elapsed(), size, true);
        st.host_writes_queued += 1;
        drop(st);
        (
            Outcome::Offload(Ok(OffloadOutcome::InHost)),
            Update::Host { mem, name, src, written: Some(written) },
        )
    }

    pub(super) fn run_offload(
        &self,
        id: TensorKey,
        size: u64,
        src: TensorMem,
        destination: Destination,
        name: Option<String>,
    ) -> (Outcome, Update) {
        // The host tier is not durable: a persistent store offloads to SSD only.
        if destination == Destination::Host && self.persist.is_none() {
            if let Some(tier) = &self.host_tier {
                let started = Instant::now();
                self.stats.lock().host_write.start(started);
                match self.host_alloc(tier, size) {
                    Ok(mut mem) => {
                        let r = src.copy_into(&mut mem);
                        let ok = r.is_ok();
                        self.stats.lock().host_write.finish(
                            Instant::now(),
                            started.elapsed(),
                            size,
                            ok,
                        );
                        return match r {
                            Ok(()) => (
                                Outcome::Offload(Ok(OffloadOutcome::InHost)),
                                Update::Host { mem, name, src, written: None },
                            ),
                            Err(e) => (Outcome::Offload(Err(e)), Update::Held(src)),
                        };
                    }
                    Err(Error::NoSpace(_)) => {
                        let mut st = self.stats.lock();
                        st.host_write.finish(Instant::now(), started.elapsed(), 0, true);
                        st.host_write.ops -= 1;
                        st.host_fallbacks += 1;
                    }
                    Err(e) => {
                        self.stats.lock().host_write.finish(
                            Instant::now(),
                            started.elapsed(),
                            0,
                            false,
                        );
                        return (Outcome::Offload(Err(e)), Update::Held(src));
                    }
                }
            } else {
                self.stats.lock().host_fallbacks += 1;
            }
        }
        let budget = self.inflight.acquire(size);
        let started = Instant::now();
        self.stats.lock().ssd_write.start(started);
        let result = self.write_to_ssd(id, size, src);
        self.inflight.release(budget);
        let ok = result.is_ok();
        self.stats.lock().ssd_write.finish(Instant::now(), started.elapsed(), size, ok);
        match result {
            Ok((copy, src)) => {
                (Outcome::Offload(Ok(OffloadOutcome::OnSsd)), Update::Ssd { copy, name, src })
            }
            Err(failure) => {
                let (e, src) = *failure;
                (Outcome::Offload(Err(e)), Update::Held(src))
            }
        }
    }

    /// Extents for a tensor of `size` bytes. Persistent mode: the extents of overwritten and
    /// freed tensors become reusable only at a checkpoint (a crash must never hand one tensor's
    /// blocks to another), so when the array is full but such extents wait, a checkpoint is
    /// written (making them free, safely) and the allocation tried once more.
    fn alloc_extents(&self, size: u64) -> Result<StripeMap> {
        // (The allocator's lock is released before a checkpoint takes it.)
        let first = self.alloc.lock().alloc_tensor(size);
        match (first, &self.persist) {
            (Err(teraio_allocator::Error::NoSpace { .. }), Some(p)) if p.has_deferred_frees() => {
                self.checkpoint()?;
                Ok(self.alloc.lock().alloc_tensor(size)?)
            }
            (r, _) => Ok(r?),
        }
    }

    /// Allocate, checksum, write (and journal). On failure the source comes back.
    fn write_to_ssd(
        &self,
        id: TensorKey,
        size: u64,
        src: TensorMem,
    ) -> std::result::Result<(SsdCopy, TensorMem), Box<(Error, TensorMem)>> {
        let map = match self.alloc_extents(size) {
            Ok(m) => m,
            Err(e) => return Err(Box::new((e, src))),
        };
        let chunk = map.unit_bytes();
        let padded = map.padded_bytes() as usize;
        let fail = |e: Error, src: TensorMem| {
            if let Err(fe) = self.alloc.lock().free_tensor(&map) {
                panic!("teraio: could not return fresh extents of tensor {id}: {fe}");
            }
            Err(Box::new((e, src)))
        };
        // Device memory takes the GPU data paths (pipelined bounce or GPUDirect Storage).
        if let TensorMem::Device(dev) = &src {
            let r = self.gpu.write(&self.array, &self.staging, &map, dev.as_ref(), self.checksums);
            let checksums = match r {
                Ok(c) => c,
                Err(e) => return fail(e, src),
            };
            if self.persist.is_some()
                && let Err(e) = self.array.sync()
            {
                return fail(e, src);
            }
            return Ok((SsdCopy { map, chunk_bytes: chunk, checksums }, src));
        }
        // Host memory goes to the device directly; other memory through a staging buffer.
        let (buf, src_back) = match src {
            TensorMem::Host(mut b) => {
                if b.capacity() < padded {
                    let e = Error::InvalidArgument(format!(
                        "tensor {id}: buffer capacity {} is below the padded size {padded}",
                        b.capacity()
                    ));
                    return fail(e, TensorMem::Host(b));
                }
                b.set_len(padded);
                (b, None)
            }
            TensorMem::Device(_) => unreachable!("device memory returned above"),
            staged @ TensorMem::Staged(_) => {
                let mut b = match self.staging.alloc(padded) {
                    Ok(b) => b,
                    Err(e) => return fail(e, staged),
                };
                if let Err(e) = staged.copy_out(0, &mut b[..size as usize]) {
                    return fail(e, staged);
                }
                (b, Some(staged))
            }
        };
        let restore = |mut b: IoBuf, src_back: Option<TensorMem>| match src_back {
            Some(s) => s,
            None => {
                b.set_len(size as usize);
                TensorMem::Host(b)
            }
        };
        // The checksums are computed while the write is in flight: both only read the buffer.
        let (ptr, len) = (buf.as_ptr(), size as usize);
        let ticket = self.array.write_tensor(&map, 0..size, buf);
        let checksums = if self.checksums {
            // SAFETY: the buffer is owned by `ticket`, which stays alive (and keeps the memory
            // mapped) until `wait` below; `len <= padded <= capacity`; a write only reads the
            // buffer, so nothing mutates it while this shared view exists.
            let bytes = unsafe { std::slice::from_raw_parts(ptr, len) };
            chunk_checksums(bytes, chunk)
        } else {
            Vec::new()
        };
        let (buf, r) = ticket.wait();
        let src = restore(buf, src_back);
        if let Err(e) = r {
            return fail(e, src);
        }
        if self.persist.is_some() {
            // Data durable before the journal record that names it.
            if let Err(e) = self.array.sync() {
                return fail(e, src);
            }
        }
        Ok((SsdCopy { map, chunk_bytes: chunk, checksums }, src))
    }

    pub(super) fn run_prefetch(
        &self,
        id: TensorKey,
        mut dst: TensorMem,
        ssd: Option<SsdCopy>,
        host: Option<HostCopy>,
        held: Option<TensorMem>,
    ) -> (Outcome, Update) {
        let size = dst.len();
        let mut host = host;
        if held.is_some() || host.is_some() {
            let from_host = held.is_none();
            let started = Instant::now();
            if from_host {
                self.stats.lock().host_read.start(started);
            }
            let r = match (&held, &mut host) {
                (Some(mem), _) => mem.copy_into(&mut dst),
                (None, Some(h)) => h.copy_into(&mut dst),
                (None, None) => unreachable!("checked above"),
            }
            .map(|()| dst);
            if from_host {
                self.stats.lock().host_read.finish(
                    Instant::now(),
                    started.elapsed(),
                    size,
                    r.is_ok(),
                );
            }
            // Memory copies are consumed by a successful prefetch (the data lives in `dst` now),
            // except a host-tier copy in a retaining store; on failure they go back.
            return match r {
                Ok(d) if self.retain => {
                    (Outcome::Prefetch(Ok(d)), Update::Restore { host, held: None })
                }
                Ok(d) => (Outcome::Prefetch(Ok(d)), Update::None),
                Err(e) => (Outcome::Prefetch(Err(e)), Update::Restore { host, held }),
            };
        }
        let Some(copy) = ssd else {
            let e = Error::InvalidState {
                tensor: id.to_string(),
                detail: "no copy to prefetch from (freed?)".into(),
            };
            return (Outcome::Prefetch(Err(e)), Update::None);
        };
        let budget = self.inflight.acquire(size);
        let started = Instant::now();
        self.stats.lock().ssd_read.start(started);
        let r = self.read_from_ssd(id, dst, &copy);
        self.inflight.release(budget);
        self.stats.lock().ssd_read.finish(Instant::now(), started.elapsed(), size, r.is_ok());
        // A volatile store hands the tensor back and forgets it; a persistent or retaining one
        // keeps it.
        let update = if r.is_ok() && !self.retain { Update::ConsumedSsd } else { Update::None };
        (Outcome::Prefetch(r), update)
    }

    fn read_from_ssd(&self, id: TensorKey, dst: TensorMem, copy: &SsdCopy) -> Result<TensorMem> {
        let size = copy.map.size_bytes();
        let padded = copy.map.padded_bytes() as usize;
        if let TensorMem::Device(mut dev) = dst {
            let sums: &[u32] = if self.checksums { &copy.checksums } else { &[] };
            let name = id.to_string();
            self.gpu.read(&self.array, &self.staging, &copy.map, dev.as_mut(), sums, &name)?;
            self.stats.lock().chunks_verified += sums.len() as u64;
            return Ok(TensorMem::Device(dev));
        }
        let (buf, staged) = match dst {
            TensorMem::Host(mut b) => {
                if b.capacity() < padded {
                    return Err(Error::InvalidArgument(format!(
                        "tensor {id}: buffer capacity {} is below the padded size {padded}",
                        b.capacity()
                    )));
                }
                b.set_len(padded);
                (b, None)
            }
            TensorMem::Device(_) => unreachable!("device memory returned above"),
            staged @ TensorMem::Staged(_) => (self.staging.alloc(padded)?, Some(staged)),
        };
        let (mut buf, r) = self.array.read_tensor(&copy.map, 0..size, buf).wait();
        r?;
        if self.checksums && !copy.checksums.is_empty() {
            self.verify(id, &buf[..size as usize], copy)?;
        }
        match staged {
            Some(mut s) => {
                s.copy_in(0, &buf[..size as usize])?;
                Ok(s)
            }
            None => {
                buf.set_len(size as usize);
                Ok(TensorMem::Host(buf))
            }
        }
    }

    fn verify(&self, id: TensorKey, bytes: &[u8], copy: &SsdCopy) -> Result<()> {
        let chunks = bytes.chunks(copy.chunk_bytes as usize);
        if chunks.len() != copy.checksums.len() {
            return Err(Error::Corruption(format!(
                "tensor {id}: {} checksums recorded for {} chunks",
                copy.checksums.len(),
                chunks.len()
            )));
        }
        for (i, (c, &stored)) in chunks.zip(&copy.checksums).enumerate() {
            let computed = crc32c::crc32c(c);
            if computed != stored {
                return Err(Error::ChecksumMismatch {
                    tensor: id.to_string(),
                    offset: i as u64 * copy.chunk_bytes,
                    stored,
                    computed,
                });
            }
        }
        self.stats.lock().chunks_verified += copy.checksums.len() as u64;
        Ok(())
    }

    pub(super) fn run_free(
        &self,
        ssd: Option<SsdCopy>,
        host: Option<HostCopy>,
        held: Option<TensorMem>,
    ) -> (Outcome, Update) {
        drop(host);
        drop(held);
        (Outcome::Free(Ok(())), Update::Freed(ssd))
    }
}
