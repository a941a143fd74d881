//! io_uring registered (fixed) buffers under the churn `teraio run` produces: several pools at
//! once (one replaced now and then, its mappings unmapped), tight pool bounds that make
//! `BufferPool::alloc` unmap cached regions of other sizes, slab pieces and large regions,
//! multi-piece (READV/WRITEV) and single-piece (READ_FIXED/WRITE_FIXED) requests from several
//! threads over rings of several devices, completions in any order. Every byte is verified,
//! and once every pool of the churn is gone the rings must have unpinned their memory (before
//! ee4da32 some 360 ring entries still pinned unmapped pool memory at that point).

mod io_common;

use std::sync::Arc;

use io_common::{fill, map, open_uring_threads};
use parking_lot::Mutex;
use rand::{Rng, SeedableRng, rngs::StdRng};
use teraio_engine::Error;
use teraio_engine::array::{DeviceArray, IoTicket};
use teraio_engine::pool::{BufferPool, IoBuf, PoolConfig};

const MIB: u64 = 1 << 20;
const DEVICES: u32 = 4;
const THREADS: u64 = 4;
/// Operations a thread keeps in flight, each in its own device window.
const BATCH: u64 = 4;
/// Bytes of each device one operation may touch.
const WINDOW: u64 = 4 * MIB;

/// Sizes that land in slabs (below 2 MiB) and in regions of several 2 MiB multiples.
const SIZES: [usize; 10] = [
    4096,
    12 << 10,
    64 << 10,
    300 << 10,
    MIB as usize,
    2 * MIB as usize,
    3 * MIB as usize + 4096,
    6 * MIB as usize,
    10 * MIB as usize,
    12 * MIB as usize,
];

/// A pool of `capacity` bytes; pool `i` of the set prefers huge pages unless `i` is 1 (as the
/// store's metadata pool, on ordinary pages), so both backings are exercised together.
fn new_pool(capacity: u64, i: usize) -> Arc<BufferPool> {
    BufferPool::new(PoolConfig { capacity_bytes: capacity, prefer_huge_pages: i != 1 }).unwrap()
}

/// Allocate from one of the shared pools (a random one first), waiting (bounded) while all are
/// full.
fn alloc(pools: &[Mutex<Arc<BufferPool>>], rng: &mut StdRng, len: usize) -> IoBuf {
    let first = rng.gen_range(0..pools.len());
    for _ in 0..10_000 {
        for k in 0..pools.len() {
            let p = Arc::clone(&pools[(first + k) % pools.len()].lock());
            match p.alloc(len) {
                Ok(b) => return b,
                Err(Error::NoSpace(_)) => {}
                Err(e) => panic!("alloc({len}): {e}"),
            }
        }
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    panic!("no pool had room for {len} bytes");
}

enum Op {
    Striped { unit: u64, base: u64 },
    Raw { device: u32, offset: u64 },
}

fn submit(array: &DeviceArray, op: &Op, len: usize, buf: IoBuf, write: bool) -> IoTicket {
    match *op {
        Op::Striped { unit, base } => {
            let m = map(len as u64, unit, DEVICES, 0, base);
            let r = 0..len as u64;
            if write { array.write_tensor(&m, r, buf) } else { array.read_tensor(&m, r, buf) }
        }
        Op::Raw { device, offset } => if write {
            array.write_at(device, offset, buf)
        } else {
            array.read_at(device, offset, buf)
        }
        .unwrap(),
    }
}

fn worker(array: &DeviceArray, pools: &[Mutex<Arc<BufferPool>>], t: u64, batches: u64) -> u64 {
    let mut rng = StdRng::seed_from_u64(0x5eed ^ t);
    let mut checked = 0;
    for batch in 0..batches {
        // Now and then replace a pool: the old one is dropped (its mappings unmapped and their
        // registration slots reused) once its last buffer is gone.
        if rng.gen_range(0..8) == 0 {
            let i = rng.gen_range(0..pools.len());
            let cap = [48, 64, 80][rng.gen_range(0..3)] * MIB;
            *pools[i].lock() = new_pool(cap, i);
        }
        let mut writes = Vec::new();
        for j in 0..BATCH {
            let base = (t * BATCH + j) * WINDOW;
            let (op, len) = if rng.gen_bool(0.5) {
                let unit = [64 << 10, 256 << 10, MIB][rng.gen_range(0..3)];
                let len = SIZES[rng.gen_range(0..SIZES.len())];
                (Op::Striped { unit, base: base / u64::from(DEVICES) * u64::from(DEVICES) }, len)
            } else {
                let len = SIZES[rng.gen_range(0..7)].next_multiple_of(4096);
                (Op::Raw { device: rng.gen_range(0..DEVICES), offset: base }, len)
            };
            let seed = (t << 48) | (batch << 8) | j;
            let mut b = alloc(pools, &mut rng, len);
            fill(&mut b, seed);
            let ticket = submit(array, &op, len, b, true);
            writes.push((op, len, seed, ticket));
        }
        // Wait in a shuffled order, then read everything back into buffers of any pool.
        let mut done = Vec::new();
        while !writes.is_empty() {
            let (op, len, seed, ticket) = writes.swap_remove(rng.gen_range(0..writes.len()));
            let (b, r) = ticket.wait();
            r.unwrap_or_else(|e| panic!("thread {t} batch {batch}: write of {len} bytes: {e}"));
            drop(b);
            done.push((op, len, seed));
        }
        let mut reads = Vec::new();
        for (op, len, seed) in done {
            let mut back = alloc(pools, &mut rng, len);
            back.fill(0xEE);
            reads.push((len, seed, submit(array, &op, len, back, false)));
        }
        for (len, seed, ticket) in reads {
            let (b, r) = ticket.wait();
            r.unwrap_or_else(|e| panic!("thread {t} batch {batch}: read of {len} bytes: {e}"));
            let mut want = vec![0u8; len];
            fill(&mut want, seed);
            assert!(b[..len] == want[..], "thread {t} batch {batch}: {len} bytes came back wrong");
            checked += len as u64;
        }
    }
    checked
}

#[test]
fn fixed_buffers_survive_pool_churn_and_slot_reuse() {
    let window_end = THREADS * BATCH * WINDOW;
    let fx = open_uring_threads(DEVICES as usize, window_end, 8, 2);
    let pools: Vec<_> = [64 * MIB, 80 * MIB, 48 * MIB]
        .into_iter()
        .enumerate()
        .map(|(i, c)| Mutex::new(new_pool(c, i)))
        .collect();
    let checked: u64 = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                s.spawn({
                    let (array, pools) = (&fx.array, &pools);
                    move || worker(array, pools, t, 60)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert!(checked > 0);
    if std::env::var("TERAIO_FIXED_BUFFERS").as_deref() == Ok("0") {
        return;
    }
    assert!(fx.array.fixed_buffer_ops() > 0, "no request used a registered buffer");
    // Every pool of the churn is gone: the rings must unpin what they registered once they
    // run again. One small pool keeps a single live mapping (its slab).
    drop(pools);
    let last = new_pool(4 * MIB, 0);
    let rings = DEVICES as usize * 2;
    for k in 0..4 * rings as u64 {
        let d = (k % u64::from(DEVICES)) as u32;
        let (_, r) = fx.array.read_at(d, 0, last.alloc(4096).unwrap()).unwrap().wait();
        r.unwrap();
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while fx.array.registered_buffers() > rings as u64 {
        assert!(
            std::time::Instant::now() < deadline,
            "{} ring entries still pin unmapped pool memory",
            fx.array.registered_buffers()
        );
        let (_, r) = fx.array.read_at(0, 0, last.alloc(4096).unwrap()).unwrap().wait();
        r.unwrap();
    }
}
