//! Model-based test of the tensor store (issue 36): seeded random operations on a few tensors
//! (offload and offload_keep, overwrite of the same or another size, to SSD or the host tier;
//! prefetch; free; a prefetch right behind an offload, which may cancel it; wait; take_held;
//! silent corruption of an SSD copy; overwrites too large for the array; checkpoint; reopen,
//! clean or after a crash that loses every unflushed write) against a model of what every
//! tensor must read back, in three modes (volatile, `retain_on_prefetch`, persistent), with
//! phases of the simulated disks' faults (EIO, ENOSPC, short transfers, latency).
//!
//! Each operation's outcome is applied to the model in the tensor's issue order (the store's
//! contract), so the model knows exactly which copy the store has. It checks:
//! - every prefetch that returns data returns the newest version offloaded before it, byte for
//!   byte (never an older version, never wrong bytes); one that fails fails with an error that
//!   names the tensor or the device, and only where the model allows it (nothing to read, a
//!   fault phase, a corrupted copy: then a checksum mismatch);
//! - without faults, an offload fails only for lack of space, and a prefetch of a tensor the
//!   store has fails only on a corrupted copy;
//! - the store's view (location, used space) agrees with the model whenever nothing is queued;
//! - after a reopen a persistent store holds exactly the acknowledged versions (or, after a
//!   failed journal write, possibly the version that write carried), intact or caught by its
//!   checksum;
//! - no operation hangs (each wait is bounded).
//!
//! Budget: `TERAIO_STORE_OPS` operations per mode (default 1,500: seconds, run by CI);
//! `benches/store-soak.sh` runs 100,000 per mode; `TERAIO_STORE_SEEDS=<n>` picks another series
//! of seeds. A failure prints its case's seed: `TERAIO_STORE_SEED=<seed>` replays that case
//! alone (the interleaving of the store's workers may differ from run to run).

mod store_common;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use store_common::{MIB, bytes_of, host_zeroed, pool};
use teraio_engine::Error;
use teraio_engine::array::{ArrayConfig, DeviceArray, ExistingData, Target};
use teraio_engine::backend::sim::{SimDisk, SimFault, SimOp};
use teraio_engine::pool::BufferPool;
use teraio_engine::queue::{Handle, Priority};
use teraio_engine::store::{
    Destination, Location, OffloadOptions, OffloadOutcome, StoreConfig, TensorStore,
};
use teraio_engine::tier::{HostTier, MemoryTier, TensorMem};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Volatile,
    Retain,
    Persistent,
}

/// Tensors of a case (ids 0..TENSORS).
const TENSORS: u64 = 6;
const DISKS: usize = 3;
/// Small disks, so that the array runs out of space now and then.
const DISK_BYTES: u64 = 3 * MIB;
/// Stripe and allocation unit.
const UNIT_BYTES: u64 = 64 << 10;
const HOST_TIER_BYTES: u64 = MIB;
const OPS_PER_CASE: usize = 300;
/// A wait longer than this is a hang.
const HANG: Duration = Duration::from_secs(120);

/// One version of a tensor: its bytes are [`data`]`(id, v, len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Version {
    v: u64,
    len: usize,
}

/// Deterministic bytes of tensor `id` at version `v` (word by word: fast enough for 10^5 ops).
fn data(id: u64, v: u64, len: usize) -> Vec<u8> {
    let mut x =
        (id + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ v.wrapping_mul(0xD1B5_4A32_D192_ED03);
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// What the store has of a tensor's newest version, as the model knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Avail {
    /// Nothing to read (never offloaded, freed, taken back by a prefetch or take_held).
    Nothing,
    /// A copy on SSD or in the host tier.
    Stored,
    /// The source memory of a failed offload.
    Held,
    /// The offload was cancelled by the prefetch issued right after it, which gets its data.
    Cancelled,
}

enum Pending {
    Offload { h: Handle<OffloadOutcome>, ver: Version, faulty: bool },
    OffloadKeep { h: Handle<(OffloadOutcome, TensorMem)>, ver: Version, faulty: bool },
    Prefetch { h: Handle<TensorMem>, faulty: bool },
    Free { h: Handle<()>, faulty: bool },
}

struct Tensor {
    /// The size of the newest offload issued (the store's size of the tensor: a prefetch's
    /// destination has it).
    issued_len: Option<usize>,
    /// The newest version as of the operations resolved so far (None: never offloaded, or
    /// freed): what a prefetch resolved now must return, if anything.
    current: Option<Version>,
    avail: Avail,
    /// The stored SSD copy was damaged on the disk.
    corrupt: bool,
    /// Persistent mode: what a reopen may find, (version or absent, copy damaged): the
    /// acknowledged state first, then those of failed operations whose journal record may have
    /// reached the disk all the same (a journal write that failed at its sync).
    durable: Vec<(Option<Version>, bool)>,
    /// Every version ever offloaded (to name a stale read).
    history: Vec<Version>,
    pending: VecDeque<Pending>,
}

impl Tensor {
    fn new() -> Self {
        Self {
            issued_len: None,
            current: None,
            avail: Avail::Nothing,
            corrupt: false,
            durable: vec![(None, false)],
            history: Vec::new(),
            pending: VecDeque::new(),
        }
    }
}

/// What a run did (for the soak's report).
#[derive(Default, Debug, Clone, Copy)]
struct Counts {
    ops: u64,
    cases: u64,
    offloads: u64,
    offloads_failed: u64,
    offloads_no_space: u64,
    offloads_cancelled: u64,
    prefetches_compared: u64,
    prefetch_errors: u64,
    checksum_mismatches_caught: u64,
    frees: u64,
    take_held: u64,
    corruptions: u64,
    fault_phases: u64,
    reopens: u64,
    crashes: u64,
    checkpoints: u64,
}

impl Counts {
    fn add(&mut self, o: &Counts) {
        self.ops += o.ops;
        self.cases += o.cases;
        self.offloads += o.offloads;
        self.offloads_failed += o.offloads_failed;
        self.offloads_no_space += o.offloads_no_space;
        self.offloads_cancelled += o.offloads_cancelled;
        self.prefetches_compared += o.prefetches_compared;
        self.prefetch_errors += o.prefetch_errors;
        self.checksum_mismatches_caught += o.checksum_mismatches_caught;
        self.frees += o.frees;
        self.take_held += o.take_held;
        self.corruptions += o.corruptions;
        self.fault_phases += o.fault_phases;
        self.reopens += o.reopens;
        self.crashes += o.crashes;
        self.checkpoints += o.checkpoints;
    }
}

struct Case {
    mode: Mode,
    seed: u64,
    rng: SmallRng,
    disks: Vec<Arc<SimDisk>>,
    tier: Option<Arc<dyn MemoryTier>>,
    store: Option<TensorStore>,
    pool: Arc<BufferPool>,
    tensors: Vec<Tensor>,
    next_version: u64,
    /// Faults are injected now.
    faulty: bool,
    /// Persistent: a fault phase since the last reopen (the journal may be read-only).
    tainted: bool,
    counts: Counts,
    /// The last operations, for a failure's report.
    log: VecDeque<String>,
}

fn is_no_space(e: &Error) -> bool {
    matches!(e, Error::NoSpace(_) | Error::Alloc(teraio_allocator::Error::NoSpace { .. }))
}

impl Case {
    fn new(mode: Mode, seed: u64, pool: Arc<BufferPool>) -> Self {
        let disks: Vec<_> =
            (0..DISKS).map(|i| SimDisk::new(DISK_BYTES, 4096, seed ^ (i as u64 + 1))).collect();
        let tier: Option<Arc<dyn MemoryTier>> = match mode {
            Mode::Persistent => None,
            _ => Some(HostTier::new("host", HOST_TIER_BYTES).expect("host tier")),
        };
        let mut case = Self {
            mode,
            seed,
            rng: SmallRng::seed_from_u64(seed),
            disks,
            tier,
            store: None,
            pool,
            tensors: (0..TENSORS).map(|_| Tensor::new()).collect(),
            next_version: 0,
            faulty: false,
            tainted: false,
            counts: Counts { cases: 1, ..Counts::default() },
            log: VecDeque::new(),
        };
        case.store = Some(case.open());
        case
    }

    fn open(&self) -> TensorStore {
        let mut acfg =
            ArrayConfig::new(self.disks.iter().map(|d| Target::Sim(d.clone())).collect());
        acfg.existing = ExistingData::AllowTeraio;
        acfg.stripe_unit_bytes = UNIT_BYTES;
        let array = DeviceArray::open(acfg).unwrap_or_else(|e| self.fail(&format!("open: {e}")));
        let mut cfg = StoreConfig::new(array);
        cfg.persistent = self.mode == Mode::Persistent;
        cfg.retain_on_prefetch = self.mode == Mode::Retain;
        cfg.alloc_unit_bytes = UNIT_BYTES;
        cfg.workers = 2;
        cfg.inflight_bytes_max = 8 * MIB;
        // Backpressure: a call blocks while this many operations are queued (an operation that
        // never gave its place back would stop the test).
        cfg.queued_ops_max = 24;
        cfg.host_tier = self.tier.clone();
        TensorStore::open(cfg).unwrap_or_else(|e| self.fail(&format!("open the store: {e}")))
    }

    fn store(&self) -> &TensorStore {
        self.store.as_ref().expect("an open store")
    }

    #[track_caller]
    fn fail(&self, what: &str) -> ! {
        let log: Vec<_> = self.log.iter().cloned().collect();
        panic!(
            "{:?} store, case seed {} (replay: TERAIO_STORE_SEED={}): {what}\nlast operations:\n  {}",
            self.mode,
            self.seed,
            self.seed,
            log.join("\n  ")
        )
    }

    fn note(&mut self, s: String) {
        if self.log.len() == 80 {
            self.log.pop_front();
        }
        self.log.push_back(s);
    }

    fn random_len(&mut self, id: u64) -> usize {
        if let Some(len) = self.tensors[id as usize].issued_len
            && self.rng.gen_bool(0.3)
        {
            return len; // an overwrite of the same size
        }
        match self.rng.gen_range(0..10) {
            0..=5 => self.rng.gen_range(1..=64 << 10),
            6..=8 => self.rng.gen_range((64 << 10) + 1..=384 << 10),
            _ => self.rng.gen_range((384 << 10) + 1..=1280 << 10),
        }
    }

    /// Offload a new version of `id` of `len` bytes; `keep`: with `offload_keep` (the source
    /// comes back; never cancelled).
    fn issue_offload(&mut self, id: u64, len: usize, keep: bool) {
        self.next_version += 1;
        let ver = Version { v: self.next_version, len };
        let destination = if self.tier.is_some() && self.rng.gen_bool(0.3) {
            Destination::Host
        } else {
            Destination::Ssd
        };
        let how = if keep { "offload_keep" } else { "offload" };
        self.note(format!("{how} {id} v{} ({len} bytes) to {destination:?}", ver.v));
        let bytes = data(id, ver.v, len);
        let mut src = self.pool.alloc(len).expect("pool");
        src.copy_from_slice(&bytes);
        let opts = OffloadOptions { destination, ..Default::default() };
        let faulty = self.faulty;
        let src = TensorMem::Host(src);
        let pending = if keep {
            self.store().offload_keep(id, src, opts).map(|h| Pending::OffloadKeep {
                h,
                ver,
                faulty,
            })
        } else {
            self.store().offload(id, src, opts).map(|h| Pending::Offload { h, ver, faulty })
        };
        let pending =
            pending.unwrap_or_else(|e| self.fail(&format!("{how} {id} refused at the call: {e}")));
        let t = &mut self.tensors[id as usize];
        t.issued_len = Some(len);
        t.history.push(ver);
        t.pending.push_back(pending);
        self.counts.offloads += 1;
    }

    fn issue_prefetch(&mut self, id: u64) {
        let issued_len = self.tensors[id as usize].issued_len;
        let len = issued_len.unwrap_or(4096);
        self.note(format!("prefetch {id} ({len} bytes)"));
        let dst = host_zeroed(&self.pool, len);
        let priority = if self.rng.gen_bool(0.5) { Priority::Normal } else { Priority::Urgent };
        match self.store().prefetch(id, dst, priority) {
            Ok(h) => self.tensors[id as usize]
                .pending
                .push_back(Pending::Prefetch { h, faulty: self.faulty }),
            Err(e) => {
                // Refused at the call: nothing was queued for the tensor and it had nothing to
                // read (or is unknown): the model, once up to date, must agree.
                self.resolve(id);
                let avail = self.tensors[id as usize].avail;
                let named = match &e {
                    Error::UnknownTensor(t) | Error::InvalidState { tensor: t, .. } => {
                        *t == id.to_string()
                    }
                    Error::InvalidArgument(m) => {
                        issued_len.is_none() && m.contains(&id.to_string())
                    }
                    _ => false,
                };
                if avail != Avail::Nothing || !named {
                    self.fail(&format!(
                        "prefetch {id} refused at the call ({e}) while the model has {avail:?}"
                    ));
                }
                self.counts.prefetch_errors += 1;
            }
        }
    }

    fn issue_free(&mut self, id: u64) {
        self.note(format!("free {id}"));
        match self.store().free(id) {
            Ok(h) => self.tensors[id as usize]
                .pending
                .push_back(Pending::Free { h, faulty: self.faulty }),
            Err(e) => {
                self.resolve(id);
                let t = &self.tensors[id as usize];
                let ok = matches!(&e, Error::UnknownTensor(n) if *n == id.to_string());
                if !ok || t.avail != Avail::Nothing {
                    let avail = t.avail;
                    self.fail(&format!("free {id} refused ({e}) while the model has {avail:?}"));
                }
            }
        }
        self.counts.frees += 1;
    }

    /// Wait for tensor `id`'s operations in issue order, applying each outcome to the model.
    fn resolve(&mut self, id: u64) {
        while let Some(p) = self.tensors[id as usize].pending.pop_front() {
            match p {
                Pending::Offload { h, ver, faulty } => {
                    let r = self.wait(h, id, "offload");
                    self.note(format!(
                        "  = offload {id} v{}: {:?}",
                        ver.v,
                        r.as_ref().map_err(|e| e.to_string())
                    ));
                    self.offloaded(id, ver, faulty, r);
                }
                Pending::OffloadKeep { h, ver, faulty } => {
                    let r = self.wait(h, id, "offload_keep").map(|(outcome, src)| {
                        if outcome == OffloadOutcome::Cancelled {
                            self.fail(&format!("offload_keep {id} v{} was cancelled", ver.v));
                        }
                        if bytes_of(&src) != data(id, ver.v, ver.len) {
                            self.fail(&format!("offload_keep {id} v{}: source changed", ver.v));
                        }
                        outcome
                    });
                    self.note(format!(
                        "  = offload_keep {id} v{}: {:?}",
                        ver.v,
                        r.as_ref().map_err(|e| e.to_string())
                    ));
                    self.offloaded(id, ver, faulty, r);
                }
                Pending::Prefetch { h, faulty } => {
                    let r = self.wait(h, id, "prefetch");
                    self.note(format!(
                        "  = prefetch {id}: {:?}",
                        r.as_ref().map(|m| m.len()).map_err(|e| e.to_string())
                    ));
                    self.prefetched(id, faulty, r);
                }
                Pending::Free { h, faulty } => {
                    let r = self.wait(h, id, "free");
                    self.note(format!(
                        "  = free {id}: {:?}",
                        r.as_ref().map_err(|e| e.to_string())
                    ));
                    self.freed(id, faulty, r);
                }
            }
        }
    }

    fn wait<T>(&self, h: Handle<T>, id: u64, what: &str) -> teraio_engine::Result<T> {
        match h.wait_timeout(HANG) {
            Ok(r) => r,
            Err(_) => self.fail(&format!("{what} of tensor {id} hangs (over {HANG:?})")),
        }
    }

    fn resolve_all(&mut self) {
        for id in 0..TENSORS {
            self.resolve(id);
        }
    }

    fn offloaded(
        &mut self,
        id: u64,
        ver: Version,
        faulty: bool,
        r: teraio_engine::Result<OffloadOutcome>,
    ) {
        let (mode, tainted) = (self.mode, self.tainted);
        let t = &mut self.tensors[id as usize];
        // Whatever its outcome, the offload's version is the newest now.
        t.current = Some(ver);
        match r {
            Ok(OffloadOutcome::OnSsd | OffloadOutcome::InHost) => {
                if matches!(r, Ok(OffloadOutcome::InHost)) && mode == Mode::Persistent {
                    self.fail(&format!(
                        "offload {id} v{}: a persistent store used the host tier",
                        ver.v
                    ));
                }
                t.avail = Avail::Stored;
                t.corrupt = false;
                if mode == Mode::Persistent {
                    t.durable = vec![(Some(ver), false)];
                }
            }
            Ok(OffloadOutcome::Cancelled) => {
                if mode != Mode::Volatile {
                    self.fail(&format!("offload {id} v{} cancelled in a {mode:?} store", ver.v));
                }
                t.avail = Avail::Cancelled;
                self.counts.offloads_cancelled += 1;
            }
            Err(e) => {
                t.avail = Avail::Held;
                if mode == Mode::Persistent && (faulty || tainted) {
                    t.durable.push((Some(ver), false));
                }
                self.counts.offloads_failed += 1;
                if is_no_space(&e) {
                    self.counts.offloads_no_space += 1;
                } else if !faulty && !tainted {
                    self.fail(&format!("offload {id} v{} failed without faults: {e}", ver.v));
                }
            }
        }
    }

    fn prefetched(&mut self, id: u64, faulty: bool, r: teraio_engine::Result<TensorMem>) {
        let mode = self.mode;
        let expect = self.tensors[id as usize].current;
        let (avail, corrupt) = (self.tensors[id as usize].avail, self.tensors[id as usize].corrupt);
        match r {
            Ok(mem) => {
                let got = bytes_of(&mem);
                drop(mem);
                let Some(want) = expect else {
                    self.fail(&format!(
                        "prefetch {id} returned {} bytes for a tensor with no version",
                        got.len()
                    ))
                };
                if got != data(id, want.v, want.len) {
                    let which = self.tensors[id as usize]
                        .history
                        .iter()
                        .find(|h| h.len == got.len() && data(id, h.v, h.len) == got)
                        .map_or("bytes of no version".to_string(), |h| format!("version v{}", h.v));
                    self.fail(&format!(
                        "prefetch {id} returned {} bytes, {which}; the newest is v{} ({} bytes)",
                        got.len(),
                        want.v,
                        want.len
                    ));
                }
                if avail == Avail::Nothing || (avail == Avail::Stored && corrupt) {
                    self.fail(&format!(
                        "prefetch {id} returned v{} while the model has {avail:?} (corrupt: {corrupt})",
                        want.v
                    ));
                }
                self.counts.prefetches_compared += 1;
                self.tensors[id as usize].avail = match avail {
                    Avail::Held | Avail::Cancelled => Avail::Nothing,
                    Avail::Stored if mode == Mode::Volatile => Avail::Nothing,
                    a => a,
                };
            }
            Err(e) => {
                self.counts.prefetch_errors += 1;
                let names_it = |t: &str| t == id.to_string();
                let ok = match (avail, &e) {
                    (Avail::Nothing, Error::InvalidState { tensor, .. })
                    | (Avail::Nothing, Error::UnknownTensor(tensor)) => names_it(tensor),
                    (Avail::Stored, Error::ChecksumMismatch { tensor, .. }) if corrupt => {
                        self.counts.checksum_mismatches_caught += 1;
                        names_it(tensor)
                    }
                    // A fault phase: an I/O error names the device (or the tensor).
                    (Avail::Stored, e) if faulty => {
                        let m = e.to_string();
                        m.contains("device") || m.contains(&format!("tensor {id}"))
                    }
                    _ => false,
                };
                if !ok {
                    self.fail(&format!(
                        "prefetch {id} failed ({e}) while the model has {avail:?} (corrupt: \
                         {corrupt}, faults: {faulty})"
                    ));
                }
            }
        }
    }

    fn freed(&mut self, id: u64, faulty: bool, r: teraio_engine::Result<()>) {
        let (mode, tainted) = (self.mode, self.tainted);
        let t = &mut self.tensors[id as usize];
        match r {
            Ok(()) => {
                t.current = None;
                t.avail = Avail::Nothing;
                t.corrupt = false;
                t.durable = vec![(None, false)];
            }
            Err(e) => {
                // Only a journal write fails a free (the tensor stays; memory copies are gone).
                if mode != Mode::Persistent || !(faulty || tainted) {
                    self.fail(&format!("free {id} failed: {e}"));
                }
                if t.avail == Avail::Held {
                    t.avail = Avail::Nothing;
                }
                t.durable.push((None, false));
            }
        }
    }

    fn take_held(&mut self, id: u64) {
        self.resolve(id);
        self.note(format!("take_held {id}"));
        let got = self.store().take_held(id);
        let t = &self.tensors[id as usize];
        match (t.avail, got) {
            (Avail::Held, Some(mem)) => {
                let want = t.current.expect("a held tensor has a version");
                if bytes_of(&mem) != data(id, want.v, want.len) {
                    self.fail(&format!("take_held {id}: not v{}", want.v));
                }
                self.tensors[id as usize].avail = Avail::Nothing;
                self.counts.take_held += 1;
            }
            (Avail::Held, None) => {
                self.fail(&format!("take_held {id}: nothing, the model holds it"))
            }
            (a, Some(_)) => {
                self.fail(&format!("take_held {id} returned memory; the model has {a:?}"))
            }
            (_, None) => {}
        }
    }

    fn corrupt(&mut self, id: u64) {
        self.resolve(id);
        let t = &self.tensors[id as usize];
        if t.avail != Avail::Stored || t.corrupt {
            return;
        }
        let info = self.store().info(id).expect("a stored tensor is known");
        if info.host_copy || info.stripe_map.is_none() {
            return;
        }
        self.note(format!("corrupt the SSD copy of {id}"));
        if self.store().corrupt_ssd_copy(&self.disks, id).is_none() {
            self.fail(&format!("tensor {id} has no SSD copy to corrupt"));
        }
        let t = &mut self.tensors[id as usize];
        t.corrupt = true;
        let current = t.current;
        for d in t.durable.iter_mut().filter(|d| d.0 == current) {
            d.1 = true;
        }
        self.counts.corruptions += 1;
    }

    fn faults_on(&mut self) {
        self.resolve_all();
        for _ in 0..self.rng.gen_range(1..=3) {
            let disk = self.rng.gen_range(0..DISKS);
            let after_ops = self.rng.gen_range(0..40);
            let fault = match self.rng.gen_range(0..6) {
                0 => SimFault::Eio { op: SimOp::Write, after_ops },
                1 => SimFault::Eio { op: SimOp::Read, after_ops },
                2 => SimFault::Eio { op: SimOp::Any, after_ops },
                3 => SimFault::Enospc { after_ops },
                4 => SimFault::ShortTransfer { op: SimOp::Any, after_ops },
                _ => SimFault::Latency { min_us: 0, max_us: 300 },
            };
            self.note(format!("fault on disk {disk}: {fault:?}"));
            self.disks[disk].inject(fault);
        }
        self.faulty = true;
        self.tainted |= self.mode == Mode::Persistent;
        self.counts.fault_phases += 1;
    }

    fn faults_off(&mut self) {
        self.resolve_all();
        self.note("faults cleared".into());
        for d in &self.disks {
            d.clear_faults();
        }
        self.faulty = false;
    }

    /// An explicit checkpoint (with operations in flight): it fails only after a fault.
    fn checkpoint(&mut self) {
        self.note("checkpoint".into());
        if let Err(e) = self.store().checkpoint()
            && !(self.faulty || self.tainted)
        {
            self.fail(&format!("checkpoint failed without faults: {e}"));
        }
        self.counts.checkpoints += 1;
    }

    /// Close and reopen the persistent store; `crash`: the disks refuse every write from the
    /// close on (its checkpoint fails) and then lose what was not flushed.
    fn reopen(&mut self, crash: bool) {
        self.faults_off();
        self.note(if crash { "crash and reopen" } else { "reopen" }.into());
        if crash {
            for d in &self.disks {
                d.inject(SimFault::Eio { op: SimOp::Write, after_ops: 0 });
            }
        }
        drop(self.store.take());
        if crash {
            for d in &self.disks {
                d.crash();
                d.clear_faults();
            }
        }
        self.store = Some(self.open());
        self.tainted = false;
        self.counts.reopens += 1;
        self.counts.crashes += u64::from(crash);
        for id in 0..TENSORS {
            let candidates = self.tensors[id as usize].durable.clone();
            let found = match self.store().info(id) {
                None => (None, false),
                Some(info) => {
                    let len = info.size_bytes as usize;
                    let r = self.store().prefetch_sync(id, host_zeroed(&self.pool, len));
                    let matching = |corrupt: bool| {
                        candidates
                            .iter()
                            .find(|(c, k)| *k == corrupt && c.is_some_and(|c| c.len == len))
                    };
                    let hit = match &r {
                        // (The damage is done by poking the disk, which a crash may undo: the
                        // simulated disk restores whole 1 MiB chunks written since the last
                        // flush. Reading the intact version is never wrong.)
                        Ok(mem) => {
                            let got = bytes_of(mem);
                            candidates
                                .iter()
                                .find(|(c, k)| {
                                    (!*k || crash) && c.is_some_and(|c| data(id, c.v, c.len) == got)
                                })
                                .map(|&(c, _)| (c, false))
                        }
                        Err(Error::ChecksumMismatch { .. }) => matching(true).copied(),
                        Err(_) => None,
                    };
                    match hit {
                        Some(h) => h,
                        None => self.fail(&format!(
                            "after reopen tensor {id} ({len} bytes) reads {:?}; what may be \
                             durable: {candidates:?}",
                            r.map(|m| m.len())
                        )),
                    }
                }
            };
            if !candidates.iter().any(|c| c.0 == found.0) {
                self.fail(&format!(
                    "after reopen tensor {id} is {found:?}; what may be durable: {candidates:?}"
                ));
            }
            let t = &mut self.tensors[id as usize];
            t.current = found.0;
            t.issued_len = found.0.map(|v| v.len);
            t.corrupt = found.1;
            t.avail = if found.0.is_some() { Avail::Stored } else { Avail::Nothing };
            t.durable = vec![found];
        }
    }

    /// With nothing queued, the store's view agrees with the model.
    fn check_quiescent(&mut self) {
        self.resolve_all();
        // (A prefetch that cancelled an offload may have queued the discarding of older copies,
        // which has no handle: the store says they are gone already.)
        let store = self.store();
        for id in 0..TENSORS {
            let avail = self.tensors[id as usize].avail;
            let loc = store.info(id).map(|i| i.location);
            let ok = match avail {
                Avail::Nothing => matches!(loc, None | Some(Location::Caller)),
                Avail::Stored => matches!(loc, Some(Location::OnSsd | Location::InHost)),
                Avail::Held => loc == Some(Location::Held),
                Avail::Cancelled => false,
            };
            if !ok {
                let info = store.info(id);
                self.fail(&format!(
                    "tensor {id} is {loc:?} in the store, {avail:?} in the model: {info:?}"
                ));
            }
        }
        let live: u64 = store
            .tensors()
            .iter()
            .filter_map(|t| t.stripe_map.as_ref())
            .map(|m| m.extents().map(|(_, e)| e.len).sum::<u64>())
            .sum();
        let used = store.space().total.used_bytes;
        // A persistent store frees replaced extents at its next checkpoint.
        let ok = if self.mode == Mode::Persistent { used >= live } else { used == live };
        if !ok {
            self.fail(&format!("{used} bytes allocated, live copies use {live}"));
        }
    }

    fn step(&mut self) {
        let id = self.rng.gen_range(0..TENSORS);
        self.counts.ops += 1;
        match self.rng.gen_range(0..100) {
            0..=21 => {
                let len = self.random_len(id);
                let keep = self.rng.gen_bool(0.15);
                self.issue_offload(id, len, keep);
            }
            22..=29 => {
                let len = self.random_len(id);
                self.issue_offload(id, len, false);
                self.resolve(id);
            }
            30..=31 => {
                // Larger than the array's free space, most of the time.
                let len = self.rng.gen_range(2 * MIB as usize..=6 * MIB as usize);
                self.issue_offload(id, len, false);
            }
            32..=46 => self.issue_prefetch(id),
            47..=56 => {
                self.issue_prefetch(id);
                self.resolve(id);
            }
            57..=66 => {
                // A prefetch right behind an offload: cancels it while it is still queued.
                let len = self.random_len(id);
                self.issue_offload(id, len, false);
                self.issue_prefetch(id);
            }
            67..=71 => self.issue_free(id),
            72..=79 => {
                self.note(format!("wait {id}"));
                self.resolve(id);
            }
            80..=83 => {
                self.note("wait for all".into());
                self.check_quiescent();
            }
            84..=86 => self.take_held(id),
            87..=89 => self.corrupt(id),
            90..=93 => {
                if self.faulty {
                    self.faults_off();
                } else {
                    self.faults_on();
                }
            }
            _ => {
                if self.mode == Mode::Persistent {
                    match self.rng.gen_range(0..3) {
                        0 => self.checkpoint(),
                        n => self.reopen(n == 2),
                    }
                } else {
                    self.check_quiescent();
                }
            }
        }
    }

    fn run(mut self, ops: usize) -> Counts {
        for _ in 0..ops {
            self.step();
        }
        self.faults_off();
        self.check_quiescent();
        if self.mode == Mode::Persistent {
            self.reopen(false);
            self.check_quiescent();
        }
        drop(self.store.take());
        self.counts
    }
}

fn budget() -> usize {
    std::env::var("TERAIO_STORE_OPS")
        .ok()
        .map(|s| {
            s.replace(['_', ','], "").parse().expect("TERAIO_STORE_OPS: a number of operations")
        })
        .unwrap_or(1500)
}

/// Run `budget()` operations in cases of [`OPS_PER_CASE`], each case a fresh array and seed
/// (or the one case `TERAIO_STORE_SEED` names).
fn model(mode: Mode, base_seed: u64) {
    let pool = pool();
    let started = Instant::now();
    let mut total = Counts::default();
    if let Some(seed) = std::env::var("TERAIO_STORE_SEED").ok().and_then(|s| s.parse().ok()) {
        total.add(&Case::new(mode, seed, pool).run(OPS_PER_CASE));
    } else {
        let ops = budget();
        // Another series of cases (the soak's SEEDS): TERAIO_STORE_SEEDS=<n> shifts every seed.
        let offset: u64 = std::env::var("TERAIO_STORE_SEEDS")
            .ok()
            .map(|s| s.parse().expect("TERAIO_STORE_SEEDS: a number"))
            .unwrap_or(0)
            * 1_000_000_007;
        let mut done = 0;
        for case in 0.. {
            if done >= ops {
                break;
            }
            let n = OPS_PER_CASE.min(ops - done);
            let seed = base_seed.wrapping_mul(1_000_003).wrapping_add(case).wrapping_add(offset);
            total.add(&Case::new(mode, seed, pool.clone()).run(n));
            done += n;
        }
    }
    // One line a mode: the soak script collects these for docs/BENCHMARKS.md.
    eprintln!(
        "store model {mode:?}: {} operations in {} cases, {:.1} s, every check passed: {total:?}",
        total.ops,
        total.cases,
        started.elapsed().as_secs_f64()
    );
    assert!(total.prefetches_compared > 0, "no prefetch returned data to compare");
}

#[test]
fn model_volatile_store() {
    model(Mode::Volatile, 1);
}

#[test]
fn model_retaining_store() {
    model(Mode::Retain, 2);
}

#[test]
fn model_persistent_store() {
    model(Mode::Persistent, 3);
}
