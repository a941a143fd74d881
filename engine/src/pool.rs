//! Host buffer pool: large, aligned, reusable regions that O_DIRECT I/O (and later CUDA's
//! `cuMemHostRegister`) can use directly.
//!
//! Physically contiguous memory matters as much as queue depth: a block device accepts a
//! bounded number of memory segments per request (254 on the virtio disk of our machines), so a
//! 1 MiB transfer from scattered 4 KiB pages is split in two while huge-page memory keeps it
//! whole. The pool therefore backs every buffer of 2 MiB or more with huge pages when it can:
//!
//! 1. [`PageBacking::HugeTlb`]: `MAP_HUGETLB` when the system has huge pages reserved
//!    (`/proc/sys/vm/nr_hugepages` > 0). A region that cannot get huge pages (the reserve is
//!    used up, or the kernel cannot fault them in: every page is populated when the region is
//!    mapped, see `populate_huge`) falls back to the next mode.
//! 2. [`PageBacking::TransparentHuge`]: 2 MiB-aligned anonymous regions with
//!    `madvise(MADV_HUGEPAGE)` when transparent huge pages are in `always` or `madvise` mode.
//! 3. [`PageBacking::Normal`]: ordinary pages (a one-line notice says so).
//!
//! Buffers below 2 MiB get a power-of-two capacity and are cut from 2 MiB slabs backed the
//! same way, so they are physically contiguous too.
//!
//! Buffers are **not zeroed**: a fresh region reads as zeros, a reused one holds whatever its
//! previous user left. The pool is bounded: [`BufferPool::alloc`] returns [`Error::NoSpace`]
//! instead of waiting when the live buffers would exceed the capacity. Freed regions are kept
//! for reuse (same capacity) and unmapped only when room is needed for a region of another size.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::{Error, Result};

/// Alignment of every buffer and granularity of every capacity.
pub const BUF_ALIGN_BYTES: usize = 4096;
/// Huge page size: buffers of at least this size are aligned to it and sized in multiples of it.
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// Configuration of a [`BufferPool`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Upper bound on the bytes of live buffers (capacities, not lengths).
    pub capacity_bytes: u64,
    /// Back large buffers with huge pages when the system offers them.
    pub prefer_huge_pages: bool,
}

impl Default for PoolConfig {
    /// 1 GiB, huge pages preferred.
    fn default() -> Self {
        Self { capacity_bytes: 1 << 30, prefer_huge_pages: true }
    }
}

/// How the pool's large buffers are backed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageBacking {
    /// Reserved huge pages (`MAP_HUGETLB`): physically contiguous 2 MiB pages.
    HugeTlb,
    /// Transparent huge pages requested with `madvise(MADV_HUGEPAGE)` on 2 MiB-aligned regions.
    TransparentHuge,
    /// Ordinary 4 KiB pages.
    Normal,
}

/// One mapping owned by the pool.
struct Region {
    /// Start of the usable, aligned memory.
    ptr: NonNull<u8>,
    /// Usable bytes from `ptr`.
    capacity: usize,
    /// Start and length of the whole mapping (for munmap); 0 for a piece of a slab.
    map_ptr: *mut libc::c_void,
    map_len: usize,
    /// The io_uring registration slot of the mapping this memory lies in.
    reg: Option<Registration>,
    /// Page-locked by the pool's [`HostPinner`] (whole mappings only).
    pinned: bool,
}

/// Page-locks a pool's mappings for a device's DMA (CUDA's `cuMemHostRegister`), so copies
/// between them and device memory run at the bus's speed instead of through the driver's own
/// staging. Set with [`BufferPool::pin_with`].
pub trait HostPinner: Send + Sync {
    /// Page-lock `[ptr, ptr + len)`.
    ///
    /// # Safety
    /// The range must be mapped and stay mapped until [`unpin`](Self::unpin).
    unsafe fn pin(&self, ptr: *mut u8, len: usize) -> Result<()>;
    /// Undo [`pin`](Self::pin).
    ///
    /// # Safety
    /// `ptr` was pinned by `pin` and no copy uses the memory any more.
    unsafe fn unpin(&self, ptr: *mut u8);
}

// SAFETY: a Region is an exclusively owned anonymous mapping; moving it between threads is fine.
unsafe impl Send for Region {}

impl Region {
    fn unmap(self) {
        // SAFETY: map_ptr/map_len describe a mapping this region owns and nothing references
        // any more (the IoBuf using it was dropped, or it was never handed out).
        let rc = unsafe { libc::munmap(self.map_ptr, self.map_len) };
        debug_assert_eq!(rc, 0, "munmap of a pool region failed");
        if let Some(r) = self.reg {
            registry_release(r);
        }
    }
}

/// Registration slots shared by every pool: the size of each io_uring ring's sparse buffer
/// table. Mappings beyond this many simply do not get registered (plain I/O is used).
pub const REGISTRATION_SLOTS: u32 = 1024;

/// The largest mapping the kernel registers as one fixed buffer (io_uring_register(2):
/// `io_buffer_validate` refuses more than 1 GiB). Larger mappings get no registration.
pub const REGISTRATION_MAX_BYTES: usize = 1 << 30;

/// Where a buffer's memory lies for io_uring buffer registration: slot `index` of every ring's
/// buffer table describes `[base, base + len)` while `generation` matches. A slot is reused by
/// a later mapping with a new generation; rings re-register on a mismatch, so a stale entry
/// (whose pages the kernel keeps pinned until then) is never used for I/O, and they drop
/// entries whose mapping is gone (see [`registration_live`]) to unpin that memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registration {
    /// Slot in the rings' buffer tables.
    pub index: u16,
    /// Unique per mapping, never 0.
    pub generation: u64,
    /// Start of the mapping.
    pub base: *mut u8,
    /// Length of the mapping.
    pub len: usize,
}

// SAFETY: plain data describing a mapping; it grants no access by itself.
unsafe impl Send for Registration {}
// SAFETY: as above.
unsafe impl Sync for Registration {}

struct Registry {
    free: Vec<u16>,
    next_generation: u64,
}

static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);

/// Generation of the mapping holding each slot now (0: free). Written under `REGISTRY`'s lock,
/// read by the rings without it.
static LIVE: [AtomicU64; REGISTRATION_SLOTS as usize] =
    [const { AtomicU64::new(0) }; REGISTRATION_SLOTS as usize];
/// Bumped after every release, so a ring notices that some of its entries may be stale.
static RELEASES: AtomicU64 = AtomicU64::new(0);

fn registry_acquire(base: *mut u8, len: usize) -> Option<Registration> {
    if len > REGISTRATION_MAX_BYTES {
        return None;
    }
    let mut g = REGISTRY.lock();
    let r = g.get_or_insert_with(|| Registry {
        free: (0..REGISTRATION_SLOTS as u16).rev().collect(),
        next_generation: 1,
    });
    let index = r.free.pop()?;
    let generation = r.next_generation;
    r.next_generation += 1;
    LIVE[usize::from(index)].store(generation, Ordering::Release);
    Some(Registration { index, generation, base, len })
}

/// Called after the mapping of `reg` was unmapped.
fn registry_release(reg: Registration) {
    let mut g = REGISTRY.lock();
    let r = g.as_mut().expect("a registration was acquired, so the registry exists");
    let live = &LIVE[usize::from(reg.index)];
    assert_eq!(
        live.load(Ordering::Acquire),
        reg.generation,
        "registration slot {} released twice or by the wrong mapping",
        reg.index
    );
    live.store(0, Ordering::Release);
    debug_assert!(!r.free.contains(&reg.index));
    r.free.push(reg.index);
    RELEASES.fetch_add(1, Ordering::AcqRel);
}

/// The generation of the mapping holding registration slot `index` now (0: none). A ring entry
/// with another generation describes memory that was unmapped (or belongs to an older mapping).
pub fn registration_live(index: u16) -> u64 {
    LIVE.get(usize::from(index)).map_or(0, |g| g.load(Ordering::Acquire))
}

/// How many registrations were released so far; a change tells a ring to look for stale
/// entries.
pub fn registration_releases() -> u64 {
    RELEASES.load(Ordering::Acquire)
}

struct PoolState {
    /// Capacities of live buffers, summed.
    used_bytes: u64,
    /// Capacities of cached free regions, summed.
    cached_bytes: u64,
    /// Every mapped byte: live and cached regions, and slabs.
    mapped_bytes: u64,
    /// Free regions by capacity.
    free: HashMap<usize, Vec<Region>>,
    /// Free slab pieces (small buffers) by capacity.
    small_free: HashMap<usize, Vec<Region>>,
    /// 2 MiB regions cut into small buffers; unmapped when the pool is dropped.
    slabs: Vec<Region>,
}

/// A bounded pool of aligned host buffers for I/O. `Send + Sync`; share it as `Arc<BufferPool>`.
pub struct BufferPool {
    capacity_bytes: u64,
    backing: PageBacking,
    state: Mutex<PoolState>,
    /// Page-locks new mappings ([`BufferPool::pin_with`]).
    pinner: OnceLock<Arc<dyn HostPinner>>,
    /// A pin failed (reported once).
    pin_failed: AtomicBool,
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferPool")
            .field("capacity_bytes", &self.capacity_bytes)
            .field("backing", &self.backing)
            .field("used_bytes", &self.used_bytes())
            .finish()
    }
}

fn read_trimmed(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

/// Whether reserved huge pages (of the default 2 MiB size) are available now.
fn hugetlb_pages_free() -> u64 {
    let Ok(info) = std::fs::read_to_string("/proc/meminfo") else { return 0 };
    info.lines()
        .find_map(|l| l.strip_prefix("HugePages_Free:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Whether transparent huge pages can be asked for with madvise.
fn thp_available() -> bool {
    read_trimmed("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_some_and(|s| s.contains("[always]") || s.contains("[madvise]"))
}

impl BufferPool {
    /// Create a pool bounded to `config.capacity_bytes` of live buffers. Nothing is mapped yet.
    pub fn new(config: PoolConfig) -> Result<Arc<BufferPool>> {
        if config.capacity_bytes < BUF_ALIGN_BYTES as u64 {
            return Err(Error::InvalidArgument(format!(
                "buffer pool capacity {} is below one {BUF_ALIGN_BYTES}-byte buffer",
                config.capacity_bytes
            )));
        }
        let backing = if !config.prefer_huge_pages {
            PageBacking::Normal
        } else if hugetlb_pages_free() > 0 {
            PageBacking::HugeTlb
        } else if thp_available() {
            PageBacking::TransparentHuge
        } else {
            crate::notice::info(
                "no huge pages reserved and transparent huge pages disabled; I/O buffers use \
                 ordinary pages (large transfers may be split)",
            );
            PageBacking::Normal
        };
        Ok(Arc::new(BufferPool {
            capacity_bytes: config.capacity_bytes,
            backing,
            state: Mutex::new(PoolState {
                used_bytes: 0,
                cached_bytes: 0,
                mapped_bytes: 0,
                free: HashMap::new(),
                small_free: HashMap::new(),
                slabs: Vec::new(),
            }),
            pinner: OnceLock::new(),
            pin_failed: AtomicBool::new(false),
        }))
    }

    /// How large buffers are backed.
    pub fn backing(&self) -> PageBacking {
        self.backing
    }

    /// Bytes held by live buffers (their capacities).
    pub fn used_bytes(&self) -> u64 {
        self.state.lock().used_bytes
    }

    /// The bound on live buffers.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// The capacity a request of `len` bytes gets: below 2 MiB the next power of two (at least
    /// 4096; such buffers are cut from 2 MiB huge-page slabs), from 2 MiB up a multiple of 2 MiB.
    ///
    /// Saturates at the largest multiple of 2 MiB for lengths within 2 MiB of `usize::MAX`
    /// (no pool has that capacity, so [`alloc`](Self::alloc) refuses them).
    pub fn capacity_for(len: usize) -> usize {
        let len = len.max(1);
        if len > HUGE_PAGE_BYTES / 2 {
            len.div_ceil(HUGE_PAGE_BYTES)
                .checked_mul(HUGE_PAGE_BYTES)
                .unwrap_or(usize::MAX / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
        } else {
            len.next_power_of_two().max(BUF_ALIGN_BYTES)
        }
    }

    /// A buffer of `len` bytes (not zeroed; see the module docs), aligned to 4096 bytes, and to
    /// 2 MiB when its capacity is 2 MiB or more. Returns [`Error::NoSpace`] when the live
    /// buffers would exceed the pool's capacity; never blocks.
    pub fn alloc(self: &Arc<Self>, len: usize) -> Result<IoBuf> {
        if len as u64 > self.capacity_bytes {
            return Err(Error::NoSpace(format!(
                "buffer pool: {len} bytes requested, more than its capacity of {} bytes \
                 (raise the engine's `host_buffers` or move the tensor in pieces)",
                self.capacity_bytes
            )));
        }
        let capacity = Self::capacity_for(len);
        let cap64 = capacity as u64;
        let mut st = self.state.lock();
        if st.used_bytes.saturating_add(cap64) > self.capacity_bytes {
            return Err(Error::NoSpace(format!(
                "buffer pool: {} bytes requested, {} of {} in use",
                capacity, st.used_bytes, self.capacity_bytes
            )));
        }
        st.used_bytes += cap64;
        let small = capacity < HUGE_PAGE_BYTES;
        if small && let Some(piece) = st.small_free.get_mut(&capacity).and_then(Vec::pop) {
            return Ok(IoBuf { pool: Arc::clone(self), region: Some(piece), len });
        }
        if let Some(region) = st.free.get_mut(&capacity).and_then(Vec::pop) {
            st.cached_bytes -= cap64;
            return Ok(IoBuf { pool: Arc::clone(self), region: Some(region), len });
        }
        // New memory: a slab for small buffers, a region for large ones. Keep mapped memory
        // within the bound by unmapping cached regions of other sizes first.
        let want = if small { HUGE_PAGE_BYTES as u64 } else { cap64 };
        let mut victims = Vec::new();
        while st.mapped_bytes + want > self.capacity_bytes && st.cached_bytes > 0 {
            let Some(&key) = st.free.keys().next() else { break };
            let list = st.free.get_mut(&key).expect("key just listed");
            let victim = list.pop();
            if list.is_empty() {
                st.free.remove(&key);
            }
            if let Some(r) = victim {
                st.cached_bytes -= r.capacity as u64;
                st.mapped_bytes -= r.capacity as u64;
                victims.push(r);
            }
        }
        let slab = small && st.mapped_bytes + want <= self.capacity_bytes;
        let map_bytes = if slab { HUGE_PAGE_BYTES } else { capacity };
        st.mapped_bytes += map_bytes as u64;
        drop(st);
        victims.into_iter().for_each(|r| self.unmap_region(r));
        let region = match self.map_region(map_bytes) {
            Ok(r) => r,
            Err(e) => {
                let mut st = self.state.lock();
                st.used_bytes -= cap64;
                st.mapped_bytes -= map_bytes as u64;
                return Err(e);
            }
        };
        if !slab {
            return Ok(IoBuf { pool: Arc::clone(self), region: Some(region), len });
        }
        // Cut the slab into pieces of this capacity; hand out the first.
        let pieces = HUGE_PAGE_BYTES / capacity;
        let mut st = self.state.lock();
        let free = st.small_free.entry(capacity).or_default();
        for i in (1..pieces).rev() {
            // SAFETY: `i * capacity < HUGE_PAGE_BYTES`: inside the slab just mapped.
            let p = unsafe { region.ptr.as_ptr().add(i * capacity) };
            let ptr = NonNull::new(p).expect("inside a mapping");
            free.push(Region {
                ptr,
                capacity,
                map_ptr: std::ptr::null_mut(),
                map_len: 0,
                reg: region.reg,
                pinned: false,
            });
        }
        let first = Region {
            ptr: region.ptr,
            capacity,
            map_ptr: std::ptr::null_mut(),
            map_len: 0,
            reg: region.reg,
            pinned: false,
        };
        st.slabs.push(region);
        Ok(IoBuf { pool: Arc::clone(self), region: Some(first), len })
    }

    fn map_region(&self, capacity: usize) -> Result<Region> {
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        let large = capacity >= HUGE_PAGE_BYTES;
        if large && self.backing == PageBacking::HugeTlb {
            // SAFETY: a fresh anonymous mapping; no existing memory is touched.
            let p = unsafe {
                libc::mmap(std::ptr::null_mut(), capacity, prot, flags | libc::MAP_HUGETLB, -1, 0)
            };
            if p != libc::MAP_FAILED && populate_huge(p, capacity) {
                let ptr = NonNull::new(p.cast::<u8>()).expect("mmap returned a non-null pointer");
                let reg = registry_acquire(ptr.as_ptr(), capacity);
                return Ok(self.pin(Region {
                    ptr,
                    capacity,
                    map_ptr: p,
                    map_len: capacity,
                    reg,
                    pinned: false,
                }));
            }
            // The reserve is used up: fall back to transparent huge pages for this region.
        }
        let align = if large { HUGE_PAGE_BYTES } else { BUF_ALIGN_BYTES };
        let map_len = capacity + align - BUF_ALIGN_BYTES;
        // SAFETY: a fresh anonymous mapping; no existing memory is touched.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), map_len, prot, flags, -1, 0) };
        if p == libc::MAP_FAILED {
            return Err(Error::Os {
                context: format!("mapping a {capacity}-byte I/O buffer"),
                source: std::io::Error::last_os_error(),
            });
        }
        let addr = p as usize;
        let start = addr.next_multiple_of(align);
        debug_assert!(start + capacity <= addr + map_len);
        if large && self.backing != PageBacking::Normal {
            // SAFETY: [start, start + capacity) lies inside the mapping made above. madvise is
            // advisory: failure only means ordinary pages.
            unsafe { libc::madvise(start as *mut libc::c_void, capacity, libc::MADV_HUGEPAGE) };
        }
        let ptr = NonNull::new(start as *mut u8).expect("aligned address inside a mapping");
        let reg = registry_acquire(ptr.as_ptr(), capacity);
        Ok(self.pin(Region { ptr, capacity, map_ptr: p, map_len, reg, pinned: false }))
    }

    /// Page-lock a fresh mapping when the pool has a pinner. A mapping that cannot be pinned
    /// stays as it is (copies to it are correct, only slower); the first failure is reported.
    fn pin(&self, mut r: Region) -> Region {
        let Some(pinner) = self.pinner.get() else { return r };
        // SAFETY: the region's `capacity` bytes from `ptr` lie in its fresh mapping; writing
        // them faults the pages in before they are locked.
        unsafe { std::ptr::write_bytes(r.ptr.as_ptr(), 0, r.capacity) };
        // SAFETY: the mapping stays until `unmap_region`, which unpins first.
        match unsafe { pinner.pin(r.ptr.as_ptr(), r.capacity) } {
            Ok(()) => r.pinned = true,
            Err(e) => {
                if !self.pin_failed.swap(true, Ordering::Relaxed) {
                    crate::notice::warning(format!(
                        "page-locking a {}-byte host buffer failed ({e}); copies between it and \
                         the GPU go through the driver's staging (slower)",
                        r.capacity
                    ));
                }
            }
        }
        r
    }

    /// Unpin (when pinned) and unmap a whole mapping.
    fn unmap_region(&self, r: Region) {
        if r.pinned
            && let Some(pinner) = self.pinner.get()
        {
            // SAFETY: pinned by `pin` above; the region is being unmapped, nothing uses it.
            unsafe { pinner.unpin(r.ptr.as_ptr()) };
        }
        r.unmap();
    }

    /// Page-lock every mapping made from now on with `pinner` (a device's DMA: the host tier of
    /// an engine with a GPU). Mappings made before stay as they are. Once per pool.
    pub fn pin_with(&self, pinner: Arc<dyn HostPinner>) -> Result<()> {
        self.pinner
            .set(pinner)
            .map_err(|_| Error::InvalidArgument("the buffer pool has a pinner already".into()))
    }

    /// Whether mappings are page-locked for a device.
    pub fn pinned(&self) -> bool {
        self.pinner.get().is_some()
    }

    fn release(&self, region: Region) {
        let cap = region.capacity as u64;
        let mut st = self.state.lock();
        st.used_bytes -= cap;
        if region.map_len == 0 {
            // A slab piece: back to its class.
            st.small_free.entry(region.capacity).or_default().push(region);
        } else if st.mapped_bytes <= self.capacity_bytes {
            st.cached_bytes += cap;
            st.free.entry(region.capacity).or_default().push(region);
        } else {
            st.mapped_bytes -= cap;
            drop(st);
            self.unmap_region(region);
        }
    }
}

impl Drop for BufferPool {
    fn drop(&mut self) {
        let st = self.state.get_mut();
        let mut regions: Vec<Region> = st.free.drain().flat_map(|(_, list)| list).collect();
        // Slab pieces are views into the slabs; no IoBuf is alive (each holds the pool).
        st.small_free.clear();
        regions.append(&mut st.slabs);
        for r in regions {
            self.unmap_region(r);
        }
    }
}

/// An aligned host buffer from a [`BufferPool`]. Dereferences to its first [`len`](Self::len)
/// bytes; returns its memory to the pool on drop.
pub struct IoBuf {
    pool: Arc<BufferPool>,
    region: Option<Region>,
    len: usize,
}

// SAFETY: the buffer exclusively owns its region; &IoBuf only gives shared access to bytes.
unsafe impl Sync for IoBuf {}

impl IoBuf {
    fn region(&self) -> &Region {
        self.region.as_ref().expect("an IoBuf holds its region until dropped")
    }

    /// Bytes visible through `Deref`.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether [`len`](Self::len) is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes the buffer can hold: a multiple of 4096 (of 2 MiB from 2 MiB up), at least `len`.
    pub fn capacity(&self) -> usize {
        self.region().capacity
    }

    /// Change the visible length. Panics when `len` exceeds the capacity.
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.capacity(),
            "IoBuf::set_len({len}) beyond capacity {}",
            self.capacity()
        );
        self.len = len;
    }

    /// Start of the buffer (aligned to at least 4096).
    pub fn as_ptr(&self) -> *const u8 {
        self.region().ptr.as_ptr()
    }

    /// Start of the buffer, writable.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.region().ptr.as_ptr()
    }

    /// The whole capacity as a slice (bytes past `len` included).
    pub fn as_full_slice_mut(&mut self) -> &mut [u8] {
        let cap = self.capacity();
        // SAFETY: the region is `cap` bytes of mapped, exclusively owned memory.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), cap) }
    }

    /// The registration slot of the mapping holding this buffer (for io_uring fixed buffers),
    /// if it got one.
    pub fn registration(&self) -> Option<Registration> {
        self.region().reg
    }

    /// The pool this buffer returns to.
    pub fn pool(&self) -> &Arc<BufferPool> {
        &self.pool
    }
}

impl Deref for IoBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len <= capacity` bytes of mapped memory owned by this buffer; no mutable
        // alias exists while &self is held (I/O in flight owns the IoBuf itself).
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }
}

impl DerefMut for IoBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        // SAFETY: as in `deref`, with exclusive access through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), len) }
    }
}

impl std::fmt::Debug for IoBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoBuf")
            .field("ptr", &self.as_ptr())
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .finish()
    }
}

impl Drop for IoBuf {
    fn drop(&mut self) {
        if let Some(region) = self.region.take() {
            self.pool.release(region);
        }
    }
}

/// Fault in every huge page of a fresh `MAP_HUGETLB` mapping now (`MADV_POPULATE_WRITE`), so a
/// page the kernel cannot supply is an error here instead of a SIGBUS at its first touch: under
/// pressure from other processes on the huge-page reserve (and io_uring pinning pool pages), a
/// private hugetlb mapping's reservation did not always hold (Linux 6.18: the first write to the
/// second page of a fresh 4 MiB mapping raised SIGBUS, `engine/tests/io_fixed_buffers.rs` with a
/// second copy running). Returns whether the mapping is usable; if not it is unmapped (the
/// caller falls back to ordinary pages). A kernel without `MADV_POPULATE_WRITE` (before 5.14)
/// keeps the mapping as it is.
fn populate_huge(p: *mut libc::c_void, len: usize) -> bool {
    // SAFETY: `[p, p + len)` is the fresh mapping just made; populating only faults its pages.
    if unsafe { libc::madvise(p, len, libc::MADV_POPULATE_WRITE) } == 0 {
        return true;
    }
    if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
        return true;
    }
    // SAFETY: unmapping the mapping just made; nothing else refers to it yet.
    unsafe { libc::munmap(p, len) };
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(cap: u64) -> Arc<BufferPool> {
        BufferPool::new(PoolConfig { capacity_bytes: cap, prefer_huge_pages: true }).unwrap()
    }

    /// Records pins and unpins; fails every pin when `fail`.
    #[derive(Default)]
    struct CountingPinner {
        pinned: Mutex<Vec<(usize, usize)>>,
        unpinned: Mutex<Vec<usize>>,
        fail: bool,
    }

    impl HostPinner for CountingPinner {
        unsafe fn pin(&self, ptr: *mut u8, len: usize) -> Result<()> {
            if self.fail {
                return Err(Error::Unsupported("no device to pin for".into()));
            }
            self.pinned.lock().push((ptr as usize, len));
            Ok(())
        }
        unsafe fn unpin(&self, ptr: *mut u8) {
            self.unpinned.lock().push(ptr as usize);
        }
    }

    #[test]
    fn a_pinner_locks_each_mapping_once_and_unlocks_it_when_unmapped() {
        let p = pool(64 << 20);
        let pinner = Arc::new(CountingPinner::default());
        p.pin_with(pinner.clone()).unwrap();
        assert!(p.pin_with(pinner.clone()).is_err(), "one pinner per pool");
        assert!(p.pinned());
        let a = p.alloc(8 << 20).unwrap();
        let b = p.alloc(100).unwrap();
        let c = p.alloc(100).unwrap();
        // One large mapping and one slab for both small pieces.
        assert_eq!(pinner.pinned.lock().len(), 2);
        assert!(
            pinner.pinned.lock().iter().any(|&(q, l)| q == a.as_ptr() as usize && l >= 8 << 20)
        );
        drop((a, b, c));
        // Reused, not pinned again.
        let a2 = p.alloc(8 << 20).unwrap();
        assert_eq!(pinner.pinned.lock().len(), 2);
        assert!(pinner.unpinned.lock().is_empty());
        drop(a2);
        drop(p);
        let mut pinned: Vec<usize> = pinner.pinned.lock().iter().map(|x| x.0).collect();
        let mut unpinned = pinner.unpinned.lock().clone();
        pinned.sort_unstable();
        unpinned.sort_unstable();
        assert_eq!(pinned, unpinned, "every pinned mapping is unpinned before it is unmapped");
    }

    #[test]
    fn a_failing_pinner_leaves_buffers_usable_and_says_so_once_without_printing() {
        let _serial = crate::notice::tests::SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        crate::notice::take_all();
        let p = pool(16 << 20);
        p.pin_with(Arc::new(CountingPinner { fail: true, ..Default::default() })).unwrap();
        let mut a = p.alloc(4 << 20).unwrap();
        let b = p.alloc(4 << 20).unwrap(); // a second mapping, a second failed pin
        a.fill(7);
        assert!(a.iter().all(|&x| x == 7));
        drop(b);
        let said: Vec<_> = crate::notice::take_all()
            .into_iter()
            .filter(|n| n.message.starts_with("page-locking a"))
            .collect();
        assert_eq!(said.len(), 1, "{said:?}");
        assert_eq!(said[0].level, crate::notice::Level::Warning);
        assert!(said[0].message.contains("slower"), "{}", said[0].message);
    }

    #[test]
    fn a_request_beyond_any_capacity_is_no_space_not_a_panic() {
        let p = pool(8 << 20);
        for len in [usize::MAX, usize::MAX - 1, usize::MAX / 2 + 1, (8 << 20) + 1] {
            match p.alloc(len) {
                Err(Error::NoSpace(m)) => assert!(m.contains(&len.to_string()), "{m}"),
                other => panic!("{len} bytes: {other:?}"),
            }
        }
        assert!(BufferPool::capacity_for(usize::MAX) >= HUGE_PAGE_BYTES);
        assert_eq!(BufferPool::capacity_for(usize::MAX) % HUGE_PAGE_BYTES, 0);
        assert_eq!(p.used_bytes(), 0);
    }

    #[test]
    fn alignment_and_capacity_rounding() {
        let p = pool(64 << 20);
        let small = p.alloc(100).unwrap();
        assert_eq!(small.len(), 100);
        assert_eq!(small.capacity(), 4096);
        assert_eq!(p.alloc(5000).unwrap().capacity(), 8192);
        assert_eq!(small.as_ptr() as usize % 4096, 0);
        let large = p.alloc((2 << 20) + 1).unwrap();
        assert_eq!(large.capacity(), 4 << 20);
        assert_eq!(large.as_ptr() as usize % HUGE_PAGE_BYTES, 0);
        assert_eq!(p.used_bytes(), 4096 + (4 << 20));
    }

    #[test]
    fn bound_gives_no_space_and_memory_is_reused() {
        let p = pool(8 << 20);
        let mut a = p.alloc(4 << 20).unwrap();
        a[0] = 0xAB;
        let addr = a.as_ptr();
        let _b = p.alloc(4 << 20).unwrap();
        assert!(matches!(p.alloc(4096), Err(Error::NoSpace(_))));
        drop(a);
        assert_eq!(p.used_bytes(), 4 << 20);
        let c = p.alloc(4 << 20).unwrap();
        assert_eq!(c.as_ptr(), addr, "a freed region of the same size is reused");
        assert_eq!(c[0], 0xAB, "reused memory is not zeroed (documented)");
    }

    #[test]
    fn cached_regions_are_evicted_for_other_sizes() {
        let p = pool(4 << 20);
        drop(p.alloc(4 << 20).unwrap());
        let small: Vec<_> = (0..8).map(|_| p.alloc(4096).unwrap()).collect();
        assert_eq!(p.used_bytes(), 8 * 4096);
        drop(small);
        assert_eq!(p.used_bytes(), 0);
        let big = p.alloc(4 << 20).unwrap();
        assert_eq!(big.capacity(), 4 << 20);
    }

    #[test]
    fn small_buffers_share_aligned_slabs() {
        let p = pool(64 << 20);
        let a = p.alloc(1 << 20).unwrap();
        let b = p.alloc(600 << 10).unwrap();
        assert_eq!(b.capacity(), 1 << 20, "small capacities are powers of two");
        assert_eq!(a.as_ptr() as usize % (1 << 20), 0);
        assert_eq!(
            (a.as_ptr() as usize) / HUGE_PAGE_BYTES,
            (b.as_ptr() as usize) / HUGE_PAGE_BYTES
        );
        let addr = b.as_ptr();
        drop(b);
        assert_eq!(p.alloc(1 << 20).unwrap().as_ptr(), addr, "slab pieces are reused");
    }

    #[test]
    fn set_len_and_deref() {
        let p = pool(1 << 20);
        let mut b = p.alloc(10).unwrap();
        b.copy_from_slice(&[7; 10]);
        b.set_len(4096);
        assert_eq!(b.len(), 4096);
        assert_eq!(&b[..10], &[7; 10]);
    }

    #[test]
    #[should_panic(expected = "beyond capacity")]
    fn set_len_beyond_capacity_panics() {
        let p = pool(1 << 20);
        let mut b = p.alloc(10).unwrap();
        b.set_len(8192);
    }
}
