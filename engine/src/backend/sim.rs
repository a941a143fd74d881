//! An in-memory simulated device for tests: seeded latency, injected errors (EIO, ENOSPC,
//! short transfers) and crashes that lose every write not yet made durable by a flush.
//!
//! A [`SimDisk`] is shared through an `Arc` and outlives the arrays opened on it, so a test can
//! write, [`crash`](SimDisk::crash), and reopen. Memory is allocated in 1 MiB chunks on first
//! write (never-written chunks read as zeros), so GiB-sized sparse disks are cheap.

use std::collections::HashMap;
use std::io;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::{Backend, IoDirection, IoFailure, IoRequest, IoVec, advance_iovecs, bad_device};

const CHUNK_BYTES: usize = 1 << 20;

/// Which operations a fault applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimOp {
    /// Reads only.
    Read,
    /// Writes only.
    Write,
    /// Reads and writes.
    Any,
}

impl SimOp {
    fn matches(self, kind: IoDirection) -> bool {
        matches!(
            (self, kind),
            (SimOp::Any, _) | (SimOp::Read, IoDirection::Read) | (SimOp::Write, IoDirection::Write)
        )
    }
}

/// A fault to inject. Faults stay active until [`SimDisk::clear_faults`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimFault {
    /// After `after_ops` matching operations succeeded, every further one fails with EIO.
    Eio {
        /// Operations the fault applies to.
        op: SimOp,
        /// Matching operations let through first.
        after_ops: u64,
    },
    /// After `after_ops` writes succeeded, every further write fails with ENOSPC.
    Enospc {
        /// Writes let through first.
        after_ops: u64,
    },
    /// After `after_ops` matching operations, every further one moves only half its bytes
    /// (rounded down to 512; transfers of less than 1 KiB move whole). Backends must resume.
    ShortTransfer {
        /// Operations the fault applies to.
        op: SimOp,
        /// Matching operations let through first.
        after_ops: u64,
    },
    /// Every operation takes `len / bytes_per_s` seconds (a drive's bandwidth; several of
    /// these add up: a second one of a ninth of the first makes the disk 10x slower).
    Throughput {
        /// Bytes per second.
        bytes_per_s: u64,
    },
    /// Every operation takes a seeded random time in `[min_us, max_us]`.
    Latency {
        /// Shortest latency in microseconds.
        min_us: u64,
        /// Longest latency in microseconds.
        max_us: u64,
    },
}

/// Counters of what a simulated disk did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Read operations (each resumed piece counts).
    pub reads: u64,
    /// Write operations (each resumed piece counts).
    pub writes: u64,
    /// Flushes.
    pub flushes: u64,
    /// Operations cut short by an injected fault.
    pub short_transfers: u64,
    /// Operations failed by an injected fault.
    pub injected_errors: u64,
    /// Crashes.
    pub crashes: u64,
}

struct ActiveFault {
    fault: SimFault,
    seen: u64,
}

struct SimState {
    chunks: Vec<Option<Box<[u8]>>>,
    /// State of each chunk written since the last flush, as of that flush.
    preimages: HashMap<usize, Option<Box<[u8]>>>,
    faults: Vec<ActiveFault>,
    rng: SmallRng,
    stats: SimStats,
}

/// An in-memory disk. Share it as `Arc<SimDisk>`; open arrays on it with
/// [`crate::array::Target::Sim`].
pub struct SimDisk {
    capacity_bytes: u64,
    block_bytes: u32,
    state: Mutex<SimState>,
}

impl std::fmt::Debug for SimDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimDisk")
            .field("capacity_bytes", &self.capacity_bytes)
            .field("block_bytes", &self.block_bytes)
            .finish()
    }
}

/// What one operation may do, decided under the lock.
struct Decision {
    result: io::Result<usize>,
    latency: Duration,
}

impl SimDisk {
    /// A zero-filled disk of `capacity_bytes` (rounded down to the block size) with logical
    /// blocks of `block_bytes` (a power of two >= 512). `seed` drives the latency faults.
    pub fn new(capacity_bytes: u64, block_bytes: u32, seed: u64) -> Arc<SimDisk> {
        assert!(
            block_bytes.is_power_of_two() && block_bytes >= 512,
            "sim block size {block_bytes} must be a power of two >= 512"
        );
        let capacity_bytes = capacity_bytes / u64::from(block_bytes) * u64::from(block_bytes);
        let chunks = (capacity_bytes as usize).div_ceil(CHUNK_BYTES);
        Arc::new(SimDisk {
            capacity_bytes,
            block_bytes,
            state: Mutex::new(SimState {
                chunks: (0..chunks).map(|_| None).collect(),
                preimages: HashMap::new(),
                faults: Vec::new(),
                rng: SmallRng::seed_from_u64(seed),
                stats: SimStats::default(),
            }),
        })
    }

    /// Capacity in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Logical block size.
    pub fn block_bytes(&self) -> u32 {
        self.block_bytes
    }

    /// Add a fault; it stays until [`clear_faults`](Self::clear_faults).
    pub fn inject(&self, fault: SimFault) {
        self.state.lock().faults.push(ActiveFault { fault, seen: 0 });
    }

    /// Remove one fault equal to `fault` (the first one added); returns whether there was one.
    pub fn remove_fault(&self, fault: SimFault) -> bool {
        let mut st = self.state.lock();
        match st.faults.iter().position(|f| f.fault == fault) {
            Some(i) => {
                st.faults.remove(i);
                true
            }
            None => false,
        }
    }

    /// Remove every fault.
    pub fn clear_faults(&self) {
        self.state.lock().faults.clear();
    }

    /// Lose every write not made durable by a flush (as a power cut would).
    pub fn crash(&self) {
        let mut st = self.state.lock();
        let pre = std::mem::take(&mut st.preimages);
        for (chunk, old) in pre {
            st.chunks[chunk] = old;
        }
        st.stats.crashes += 1;
    }

    /// Make every completed write durable.
    pub fn flush(&self) {
        let mut st = self.state.lock();
        st.preimages.clear();
        st.stats.flushes += 1;
    }

    /// Counters.
    pub fn stats(&self) -> SimStats {
        self.state.lock().stats
    }

    /// Copy bytes out, bypassing faults (for test assertions and probing).
    pub fn peek(&self, offset: u64, out: &mut [u8]) {
        let st = self.state.lock();
        let end = (offset + out.len() as u64).min(self.capacity_bytes);
        let mut pos = offset;
        while pos < end {
            let c = (pos as usize) / CHUNK_BYTES;
            let within = pos as usize % CHUNK_BYTES;
            let n = (CHUNK_BYTES - within).min((end - pos) as usize);
            let dst = &mut out[(pos - offset) as usize..][..n];
            match &st.chunks[c] {
                Some(data) => dst.copy_from_slice(&data[within..within + n]),
                None => dst.fill(0),
            }
            pos += n as u64;
        }
        let filled = (end.saturating_sub(offset) as usize).min(out.len());
        out[filled..].fill(0);
    }

    /// Copy bytes in, bypassing faults; durable at once (for preparing test fixtures).
    pub fn poke(&self, offset: u64, data: &[u8]) {
        let mut st = self.state.lock();
        let end = (offset + data.len() as u64).min(self.capacity_bytes);
        let mut pos = offset;
        while pos < end {
            let c = (pos as usize) / CHUNK_BYTES;
            let within = pos as usize % CHUNK_BYTES;
            let n = (CHUNK_BYTES - within).min((end - pos) as usize);
            let chunk = st.chunks[c].get_or_insert_with(|| vec![0; CHUNK_BYTES].into_boxed_slice());
            chunk[within..within + n].copy_from_slice(&data[(pos - offset) as usize..][..n]);
            pos += n as u64;
        }
    }

    fn decide(&self, st: &mut SimState, kind: IoDirection, offset: u64, len: usize) -> Decision {
        let mut latency = Duration::ZERO;
        let mut error = None;
        let mut allowed = len;
        let mut short = false;
        for f in st.faults.iter_mut() {
            match f.fault {
                SimFault::Latency { min_us, max_us } => {
                    let us =
                        if max_us > min_us { st.rng.gen_range(min_us..=max_us) } else { min_us };
                    latency += Duration::from_micros(us);
                }
                SimFault::Throughput { bytes_per_s } if bytes_per_s > 0 => {
                    latency += Duration::from_secs_f64(len as f64 / bytes_per_s as f64);
                }
                SimFault::Eio { op, after_ops } if op.matches(kind) => {
                    f.seen += 1;
                    if f.seen > after_ops {
                        error.get_or_insert(libc::EIO);
                    }
                }
                SimFault::Enospc { after_ops } if kind == IoDirection::Write => {
                    f.seen += 1;
                    if f.seen > after_ops {
                        error.get_or_insert(libc::ENOSPC);
                    }
                }
                SimFault::ShortTransfer { op, after_ops } if op.matches(kind) => {
                    f.seen += 1;
                    if f.seen > after_ops && len >= 1024 {
                        allowed = len / 2 / 512 * 512;
                        short = true;
                    }
                }
                _ => {}
            }
        }
        match kind {
            IoDirection::Read => st.stats.reads += 1,
            IoDirection::Write => st.stats.writes += 1,
        }
        if let Some(errno) = error {
            st.stats.injected_errors += 1;
            return Decision { result: Err(io::Error::from_raw_os_error(errno)), latency };
        }
        if short {
            st.stats.short_transfers += 1;
        }
        if offset >= self.capacity_bytes {
            let result = match kind {
                IoDirection::Read => Ok(0),
                IoDirection::Write => Err(io::Error::from_raw_os_error(libc::ENOSPC)),
            };
            return Decision { result, latency };
        }
        let allowed = allowed.min((self.capacity_bytes - offset) as usize);
        Decision { result: Ok(allowed), latency }
    }

    /// One operation over raw pieces; returns bytes moved (possibly fewer than asked).
    ///
    /// # Safety
    /// The iovecs must name valid memory (writable for reads) for the duration of the call.
    unsafe fn transfer(
        &self,
        kind: IoDirection,
        offset: u64,
        iovecs: &[IoVec],
    ) -> (io::Result<usize>, Duration) {
        let len: usize = iovecs.iter().map(|v| v.len).sum();
        let mut st = self.state.lock();
        let d = self.decide(&mut st, kind, offset, len);
        let n = match d.result {
            Ok(n) => n,
            Err(e) => return (Err(e), d.latency),
        };
        let mut left = n;
        let mut pos = offset;
        for v in iovecs {
            if left == 0 {
                break;
            }
            let take = v.len.min(left);
            let mut done = 0;
            while done < take {
                let c = (pos as usize) / CHUNK_BYTES;
                let within = pos as usize % CHUNK_BYTES;
                let k = (CHUNK_BYTES - within).min(take - done);
                // SAFETY: the caller guarantees the piece is valid for `v.len >= done + k` bytes.
                let mem = unsafe { v.ptr.add(done) };
                match kind {
                    IoDirection::Read => {
                        // SAFETY: as above; the piece is writable for reads.
                        let dst = unsafe { std::slice::from_raw_parts_mut(mem, k) };
                        match &st.chunks[c] {
                            Some(data) => dst.copy_from_slice(&data[within..within + k]),
                            None => dst.fill(0),
                        }
                    }
                    IoDirection::Write => {
                        // SAFETY: as above; the piece is readable.
                        let src = unsafe { std::slice::from_raw_parts(mem, k) };
                        let SimState { chunks, preimages, .. } = &mut *st;
                        preimages.entry(c).or_insert_with(|| chunks[c].clone());
                        let chunk = chunks[c]
                            .get_or_insert_with(|| vec![0; CHUNK_BYTES].into_boxed_slice());
                        chunk[within..within + k].copy_from_slice(src);
                    }
                }
                done += k;
                pos += k as u64;
            }
            left -= take;
        }
        (Ok(n), d.latency)
    }
}

/// Backend over simulated disks: a few worker threads execute requests against the disks.
pub struct SimBackend {
    disks: Vec<Arc<SimDisk>>,
    tx: Option<Sender<IoRequest>>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for SimBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimBackend").field("disks", &self.disks.len()).finish()
    }
}

/// Worker threads of a simulated backend (the device's internal parallelism).
const SIM_WORKERS: usize = 4;

impl SimBackend {
    /// A backend over `disks`; request device `i` goes to `disks[i]`.
    pub fn new(disks: Vec<Arc<SimDisk>>) -> io::Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<IoRequest>();
        let mut workers = Vec::new();
        for i in 0..SIM_WORKERS {
            let rx: Receiver<IoRequest> = rx.clone();
            let disks = disks.clone();
            workers.push(std::thread::Builder::new().name(format!("teraio-sim-{i}")).spawn(
                move || {
                    for req in rx.iter() {
                        run_request(&disks, req);
                    }
                },
            )?);
        }
        Ok(Self { disks, tx: Some(tx), workers })
    }
}

fn run_request(disks: &[Arc<SimDisk>], req: IoRequest) {
    let Some(disk) = disks.get(req.device()) else {
        let n = disks.len();
        let d = req.device();
        return req.complete(Err(bad_device(d, n)));
    };
    let total = req.len();
    let mut iov = req.iovecs().to_vec();
    let mut done = 0u64;
    let result = loop {
        if iov.is_empty() {
            break Ok(());
        }
        // SAFETY: the iovecs come from an IoRequest, whose constructor's contract keeps the
        // memory valid until the request completes (below, after this loop).
        let (r, latency) = unsafe { disk.transfer(req.kind(), req.offset() + done, &iov) };
        if !latency.is_zero() {
            std::thread::sleep(latency);
        }
        match r {
            Ok(0) => break Err(IoFailure::Short { done, len: total }),
            Ok(n) => {
                done += n as u64;
                advance_iovecs(&mut iov, n);
            }
            Err(e) => break Err(IoFailure::Os(e)),
        }
    };
    req.complete(result);
}

impl Backend for SimBackend {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn submit(&self, request: IoRequest) {
        match &self.tx {
            Some(tx) => {
                if let Err(e) = tx.send(request) {
                    e.0.complete(Err(IoFailure::Os(io::Error::other("sim backend shut down"))));
                }
            }
            None => request.complete(Err(IoFailure::Os(io::Error::other("sim backend shut down")))),
        }
    }

    fn flush(&self, device: usize) -> io::Result<()> {
        let disk = self.disks.get(device).ok_or_else(|| io::Error::other("no such device"))?;
        let mut st = disk.state.lock();
        for f in st.faults.iter_mut() {
            // The device dies at its first refused write: flushes before that one succeed.
            if let SimFault::Eio { op: SimOp::Write | SimOp::Any, after_ops } = f.fault
                && f.seen > after_ops
            {
                st.stats.injected_errors += 1;
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
        }
        drop(st);
        disk.flush();
        Ok(())
    }
}

impl Drop for SimBackend {
    fn drop(&mut self) {
        self.tx = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crash_loses_unflushed_writes_only() {
        let d = SimDisk::new(4 << 20, 4096, 1);
        d.poke(0, &[1; 4096]);
        let mut a = vec![2u8; 4096];
        let v = [IoVec { ptr: a.as_mut_ptr(), len: 4096 }];
        // SAFETY: `a` outlives the call.
        let (r, _) = unsafe { d.transfer(IoDirection::Write, 0, &v) };
        assert_eq!(r.unwrap(), 4096);
        let mut out = vec![0u8; 4096];
        d.peek(0, &mut out);
        assert_eq!(out, vec![2; 4096]);
        d.crash();
        d.peek(0, &mut out);
        assert_eq!(out, vec![1; 4096], "the unflushed write is lost");
        // SAFETY: as above.
        let _ = unsafe { d.transfer(IoDirection::Write, 2 << 20, &v) };
        d.flush();
        d.crash();
        d.peek(2 << 20, &mut out);
        assert_eq!(out, vec![2; 4096], "the flushed write survives");
    }

    #[test]
    fn faults_trigger_after_the_given_count() {
        let d = SimDisk::new(1 << 20, 512, 1);
        d.inject(SimFault::Eio { op: SimOp::Read, after_ops: 1 });
        let mut a = vec![0u8; 4096];
        let v = [IoVec { ptr: a.as_mut_ptr(), len: 4096 }];
        // SAFETY: `a` outlives the calls.
        unsafe {
            assert!(d.transfer(IoDirection::Read, 0, &v).0.is_ok());
            assert_eq!(
                d.transfer(IoDirection::Read, 0, &v).0.unwrap_err().raw_os_error(),
                Some(libc::EIO)
            );
            assert!(d.transfer(IoDirection::Write, 0, &v).0.is_ok(), "a read fault spares writes");
        }
        d.clear_faults();
        d.inject(SimFault::ShortTransfer { op: SimOp::Any, after_ops: 0 });
        // SAFETY: as above.
        assert_eq!(unsafe { d.transfer(IoDirection::Read, 0, &v) }.0.unwrap(), 2048);
        assert_eq!(d.stats().short_transfers, 1);
    }

    #[test]
    fn throughput_faults_add_up_and_come_off_one_by_one() {
        let d = SimDisk::new(1 << 20, 512, 1);
        let base = SimFault::Throughput { bytes_per_s: 1 << 30 };
        let slow = SimFault::Throughput { bytes_per_s: (1 << 30) / 9 };
        d.inject(base);
        d.inject(slow);
        let mut st = d.state.lock();
        let t = d.decide(&mut st, IoDirection::Write, 0, 1 << 20).latency;
        drop(st);
        let expected = 10.0 * (1 << 20) as f64 / (1u64 << 30) as f64;
        assert!((t.as_secs_f64() - expected).abs() < 1e-6, "{t:?} vs {expected}");
        assert!(d.remove_fault(slow));
        assert!(!d.remove_fault(slow), "removed once");
        let mut st = d.state.lock();
        let t = d.decide(&mut st, IoDirection::Read, 0, 1 << 20).latency;
        assert!((t.as_secs_f64() - expected / 10.0).abs() < 1e-6, "{t:?}");
    }
}
