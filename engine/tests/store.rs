//! Tensor store: ordering, cancellation, checksums, failures, host tier, persistence, crashes.

mod store_common;

use std::collections::HashMap;
use std::sync::Arc;

use proptest::prelude::*;
use store_common::*;
use teraio_engine::Error;
use teraio_engine::backend::sim::{SimFault, SimOp};
use teraio_engine::queue::Priority;
use teraio_engine::store::{
    Destination, Location, OffloadOptions, OffloadOutcome, StoreConfig, TensorStore,
};
use teraio_engine::tier::{HostTier, MemoryTier, TensorMem};

#[test]
fn offload_then_prefetch_round_trips_odd_sizes() {
    let disks = sim_disks(4, 256 * MIB, 1);
    let store = store(&disks, false);
    let pool = pool();
    let sizes = [1u64, 4095, 4096, MIB - 1, MIB, MIB + 1, 5 * MIB + 12345];
    for (id, &size) in sizes.iter().enumerate() {
        let data = content(id as u64, 0, size as usize);
        let out = store
            .offload_sync(id as u64, host_mem(&pool, &data), OffloadOptions::default())
            .unwrap();
        assert_eq!(out, OffloadOutcome::OnSsd);
        assert_eq!(store.info(id as u64).unwrap().location, Location::OnSsd);
    }
    for (id, &size) in sizes.iter().enumerate() {
        let got = store.prefetch_sync(id as u64, host_zeroed(&pool, size as usize)).unwrap();
        assert_same(
            &bytes_of(&got),
            &content(id as u64, 0, size as usize),
            &format!("tensor {id} of {size} bytes"),
        );
    }
    let st = store.stats();
    assert_eq!(st.ssd_write.ops, sizes.len() as u64);
    assert_eq!(st.ssd_read.ops, sizes.len() as u64);
    assert!(st.chunks_verified >= sizes.len() as u64);
}

#[test]
fn operations_on_one_tensor_apply_in_issue_order() {
    let disks = sim_disks(2, 256 * MIB, 2);
    let store = store(&disks, false);
    let pool = pool();
    let len = 3 * MIB as usize + 7;
    let mut handles = Vec::new();
    for v in 0..8 {
        let h = store
            .offload(9, host_mem(&pool, &content(9, v, len)), OffloadOptions::default())
            .unwrap();
        handles.push(h);
        // Each prefetch must see exactly the version offloaded just before it.
        let p = store.prefetch(9, host_zeroed(&pool, len), Priority::Normal).unwrap();
        assert_same(&bytes_of(&p.wait().unwrap()), &content(9, v, len), &format!("version {v}"));
    }
    for h in handles {
        let o = h.wait().unwrap();
        assert!(matches!(o, OffloadOutcome::OnSsd | OffloadOutcome::Cancelled));
    }
}

#[test]
fn prefetch_cancels_a_queued_offload_and_completes_at_once() {
    let disks = sim_disks(1, 256 * MIB, 3);
    // Slow the disk down so the first offload is still running when we queue the second.
    disks[0].inject(SimFault::Latency { min_us: 50_000, max_us: 50_000 });
    let mut cfg = StoreConfig::new(sim_array(&disks));
    cfg.workers = 1;
    let store = TensorStore::open(cfg).unwrap();
    let pool = pool();
    let len = 2 * MIB as usize;
    // Prepare the buffers first so the operations are issued back to back.
    let (m1, m2, dst) = (
        host_mem(&pool, &content(1, 0, len)),
        host_mem(&pool, &content(2, 0, len)),
        host_zeroed(&pool, len),
    );
    let busy = store.offload(1, m1, OffloadOptions::default()).unwrap();
    let queued = store.offload(2, m2, OffloadOptions::default()).unwrap();
    let p = store.prefetch(2, dst, Priority::Urgent).unwrap();
    assert!(p.is_done(), "a prefetch of a queued offload completes at once");
    assert_same(&bytes_of(&p.wait().unwrap()), &content(2, 0, len), "content");
    assert_eq!(queued.wait().unwrap(), OffloadOutcome::Cancelled);
    assert_eq!(busy.wait().unwrap(), OffloadOutcome::OnSsd);
    assert_eq!(store.stats().offloads_cancelled, 1);
    assert_eq!(store.stats().ssd_write.ops, 1);
}

#[test]
fn urgent_work_overtakes_queued_normal_work() {
    let disks = sim_disks(1, 512 * MIB, 4);
    disks[0].inject(SimFault::Latency { min_us: 5_000, max_us: 5_000 });
    let mut cfg = StoreConfig::new(sim_array(&disks));
    cfg.workers = 1;
    let store = TensorStore::open(cfg).unwrap();
    let pool = pool();
    let len = MIB as usize;
    // Prepare every buffer first so the operations are issued back to back.
    let mut mems: Vec<_> = (0..7).map(|i| host_mem(&pool, &content(i, 0, len))).collect();
    let urgent_mem = mems.pop().unwrap();
    let normal: Vec<_> = mems
        .into_iter()
        .enumerate()
        .map(|(i, m)| store.offload(i as u64, m, OffloadOptions::default()).unwrap())
        .collect();
    let urgent = store
        .offload(
            100,
            urgent_mem,
            OffloadOptions { priority: Priority::Urgent, ..Default::default() },
        )
        .unwrap();
    urgent.wait().unwrap();
    let still_queued = normal.iter().filter(|h| !h.is_done()).count();
    assert!(still_queued >= 3, "urgent finished after {} of 6 normal offloads", 6 - still_queued);
    for h in normal {
        h.wait().unwrap();
    }
    let st = store.stats();
    assert_eq!(st.queue_wait[Priority::Urgent as usize].ops, 1);
}

#[test]
fn corrupt_bytes_on_disk_are_a_checksum_mismatch_naming_the_tensor() {
    let disks = sim_disks(1, 64 * MIB, 5);
    let store = store(&disks, false);
    let pool = pool();
    let len = 3 * MIB as usize;
    store
        .offload_sync(77, host_mem(&pool, &content(77, 0, len)), OffloadOptions::default())
        .unwrap();
    let map = store.info(77).unwrap().stripe_map.unwrap();
    let (dev, off) = map.locate(MIB + 10).unwrap();
    let mut b = [0u8; 1];
    disks[dev as usize].peek(off, &mut b);
    disks[dev as usize].poke(off, &[b[0] ^ 0x40]);
    let err = store.prefetch_sync(77, host_zeroed(&pool, len)).unwrap_err();
    match err {
        Error::ChecksumMismatch { tensor, offset, .. } => {
            assert_eq!(tensor, "77");
            assert_eq!(offset, MIB);
        }
        other => panic!("expected a checksum mismatch, got {other}"),
    }
}

#[test]
fn failed_offload_keeps_the_tensor_and_reports_the_device() {
    let disks = sim_disks(2, 64 * MIB, 6);
    let store = store(&disks, false);
    let pool = pool();
    let len = 4 * MIB as usize;
    disks[1].inject(SimFault::Eio { op: SimOp::Write, after_ops: 0 });
    let err = store
        .offload_sync(5, host_mem(&pool, &content(5, 0, len)), OffloadOptions::default())
        .unwrap_err();
    assert!(err.to_string().contains("device 1"), "error names the device: {err}");
    assert_eq!(store.info(5).unwrap().location, Location::Held);
    // Nothing leaked: all space is free again.
    assert_eq!(store.space().total.used_bytes, 0);
    // The data is not lost: a prefetch returns it from the held memory.
    let got = store.prefetch_sync(5, host_zeroed(&pool, len)).unwrap();
    assert_same(&bytes_of(&got), &content(5, 0, len), "content");
    // Other tensors go on once the device recovers.
    disks[1].clear_faults();
    store.offload_sync(6, host_mem(&pool, &content(6, 0, len)), OffloadOptions::default()).unwrap();
    assert_same(
        &bytes_of(&store.prefetch_sync(6, host_zeroed(&pool, len)).unwrap()),
        &content(6, 0, len),
        "content",
    );
}

#[test]
fn no_space_is_an_error_that_loses_nothing() {
    let disks = sim_disks(1, 32 * MIB, 7);
    let store = store(&disks, false);
    let pool = pool();
    let free = store.space().total.free_bytes;
    let too_big = (free + MIB) as usize;
    let err = store
        .offload_sync(1, host_mem(&pool, &content(1, 0, too_big)), OffloadOptions::default())
        .unwrap_err();
    assert!(matches!(err, Error::Alloc(_)), "{err}");
    assert_eq!(store.space().total.free_bytes, free);
    assert_same(&bytes_of(&store.take_held(1).unwrap()), &content(1, 0, too_big), "content");
}

#[test]
fn host_tier_is_a_second_destination_with_a_cap() {
    let disks = sim_disks(1, 64 * MIB, 8);
    let tier: Arc<dyn MemoryTier> = HostTier::new("host", 4 * MIB).unwrap();
    let mut cfg = StoreConfig::new(sim_array(&disks));
    cfg.host_tier = Some(tier.clone());
    let store = TensorStore::open(cfg).unwrap();
    let pool = pool();
    let len = 3 * MIB as usize;
    let host = OffloadOptions { destination: Destination::Host, ..Default::default() };
    assert_eq!(
        store.offload_sync(1, host_mem(&pool, &content(1, 0, len)), host.clone()).unwrap(),
        OffloadOutcome::InHost
    );
    assert_eq!(store.info(1).unwrap().location, Location::InHost);
    assert!(tier.used_bytes() >= len as u64);
    // The tier is full: the next one falls back to SSD.
    assert_eq!(
        store.offload_sync(2, host_mem(&pool, &content(2, 0, len)), host).unwrap(),
        OffloadOutcome::OnSsd
    );
    assert_eq!(store.stats().host_fallbacks, 1);
    assert_same(
        &bytes_of(&store.prefetch_sync(1, host_zeroed(&pool, len)).unwrap()),
        &content(1, 0, len),
        "content",
    );
    assert_eq!(tier.used_bytes(), 0, "a prefetch from the host tier releases it");
    assert_same(
        &bytes_of(&store.prefetch_sync(2, host_zeroed(&pool, len)).unwrap()),
        &content(2, 0, len),
        "content",
    );
}

#[test]
fn free_releases_space_and_forgets_the_tensor() {
    let disks = sim_disks(2, 64 * MIB, 9);
    let store = store(&disks, false);
    let pool = pool();
    store
        .offload_sync(
            1,
            host_mem(&pool, &content(1, 0, 5 * MIB as usize)),
            OffloadOptions::default(),
        )
        .unwrap();
    assert!(store.space().total.used_bytes >= 5 * MIB);
    store.free(1).unwrap().wait().unwrap();
    assert_eq!(store.space().total.used_bytes, 0);
    assert!(store.info(1).is_none());
    assert!(matches!(
        store.prefetch(1, host_zeroed(&pool, 5 * MIB as usize), Priority::Normal),
        Err(Error::UnknownTensor(_))
    ));
    assert!(matches!(store.free(1), Err(Error::UnknownTensor(_))));
}

#[test]
fn prefetch_with_wrong_size_is_refused() {
    let disks = sim_disks(1, 64 * MIB, 10);
    let store = store(&disks, false);
    let pool = pool();
    store
        .offload_sync(1, host_mem(&pool, &content(1, 0, 1000)), OffloadOptions::default())
        .unwrap();
    assert!(matches!(
        store.prefetch(1, host_zeroed(&pool, 999), Priority::Normal),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn many_threads_hammering_distinct_tensors() {
    let disks = sim_disks(4, 512 * MIB, 11);
    let store = Arc::new(store(&disks, false));
    let pool = pool();
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let store = store.clone();
            let pool = pool.clone();
            std::thread::spawn(move || {
                for round in 0..12u64 {
                    for k in 0..3u64 {
                        let id = t * 100 + k;
                        let len = ((round * 7919 + k * 104_729) % (3 * MIB) + 1) as usize;
                        let data = content(id, round, len);
                        let offload = store
                            .offload(id, host_mem(&pool, &data), OffloadOptions::default())
                            .unwrap();
                        let got = store
                            .prefetch(id, host_zeroed(&pool, len), Priority::Normal)
                            .unwrap()
                            .wait()
                            .unwrap();
                        assert_same(
                            &bytes_of(&got),
                            &data,
                            &format!("thread {t} tensor {id} round {round}"),
                        );
                        // Either written, or cancelled by the prefetch that overtook it.
                        offload.wait().unwrap();
                    }
                }
                for k in 0..3u64 {
                    store.free(t * 100 + k).unwrap().wait().unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    store.drain();
    assert_eq!(store.space().total.used_bytes, 0);
    assert!(store.tensors().is_empty());
}

#[derive(Debug, Clone)]
enum ModelOp {
    Offload { id: u64, len: usize },
    Prefetch { id: u64 },
    Free { id: u64 },
    Drain,
    Reopen,
}

fn arbitrary_op() -> impl Strategy<Value = ModelOp> {
    prop_oneof![
        4 => (0..5u64, 1..(2 * MIB as usize + 5000)).prop_map(|(id, len)| ModelOp::Offload { id, len }),
        4 => (0..5u64).prop_map(|id| ModelOp::Prefetch { id }),
        1 => (0..5u64).prop_map(|id| ModelOp::Free { id }),
        1 => Just(ModelOp::Drain),
        1 => Just(ModelOp::Reopen),
    ]
}

/// Random sequences of asynchronous operations against a HashMap model. Prefetches must return
/// exactly the last version offloaded before them; frees make later prefetches fail.
fn run_model(ops: Vec<ModelOp>, persistent: bool) {
    let disks = sim_disks(3, 128 * MIB, 12);
    let pool = pool();
    let mut store = Some(store(&disks, persistent));
    // Content the store holds, and ids it knows (a volatile prefetch takes the content out).
    let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
    let mut known: std::collections::HashSet<u64> = Default::default();
    let mut version = 0u64;
    let mut pending = Vec::new();
    for op in ops {
        let s = store.as_ref().unwrap();
        match op {
            ModelOp::Offload { id, len } => {
                version += 1;
                let data = content(id, version, len);
                let h = s.offload(id, host_mem(&pool, &data), OffloadOptions::default()).unwrap();
                pending.push(h);
                model.insert(id, data);
                known.insert(id);
            }
            ModelOp::Prefetch { id } => match model.get(&id) {
                Some(data) => {
                    let got = s
                        .prefetch(id, host_zeroed(&pool, data.len()), Priority::Normal)
                        .unwrap()
                        .wait()
                        .unwrap();
                    assert_same(&bytes_of(&got), data, &format!("tensor {id}"));
                    if !persistent {
                        model.remove(&id);
                    }
                }
                None => {
                    let r = s
                        .prefetch(id, host_zeroed(&pool, 4096), Priority::Normal)
                        .and_then(|h| h.wait());
                    assert!(r.is_err(), "prefetch of absent tensor {id} must fail");
                }
            },
            ModelOp::Free { id } => {
                let r = s.free(id).and_then(|h| h.wait());
                model.remove(&id);
                assert_eq!(r.is_ok(), known.remove(&id), "free {id}: {r:?}");
            }
            ModelOp::Drain => s.drain(),
            ModelOp::Reopen => {
                for h in pending.drain(..) {
                    h.wait().unwrap();
                }
                if persistent {
                    drop(store.take());
                    store = Some(self::store(&disks, true));
                    known.retain(|id| model.contains_key(id));
                }
            }
        }
    }
    for h in pending {
        h.wait().unwrap();
    }
    let s = store.unwrap();
    s.drain();
    let mut ids: Vec<_> = s.tensors().iter().map(|t| t.id.get()).collect();
    ids.sort_unstable();
    // After a reopen only tensors with content survive.
    let mut want: Vec<_> =
        if persistent { model.keys().copied().collect() } else { known.iter().copied().collect() };
    want.sort_unstable();
    assert_eq!(ids, want);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn model_volatile(ops in proptest::collection::vec(arbitrary_op(), 1..40)) {
        run_model(ops, false);
    }

    #[test]
    fn model_persistent(ops in proptest::collection::vec(arbitrary_op(), 1..30)) {
        run_model(ops, true);
    }
}

#[test]
fn staged_memory_goes_through_staging_buffers() {
    struct Vram(Vec<u8>);
    impl teraio_engine::tier::StagedMemory for Vram {
        fn len(&self) -> u64 {
            self.0.len() as u64
        }
        fn copy_out(&self, offset: u64, dst: &mut [u8]) -> teraio_engine::Result<()> {
            dst.copy_from_slice(&self.0[offset as usize..offset as usize + dst.len()]);
            Ok(())
        }
        fn copy_in(&mut self, offset: u64, src: &[u8]) -> teraio_engine::Result<()> {
            self.0[offset as usize..offset as usize + src.len()].copy_from_slice(src);
            Ok(())
        }
    }
    let disks = sim_disks(2, 64 * MIB, 13);
    let store = store(&disks, false);
    let len = 3 * MIB as usize + 3;
    let data = content(3, 1, len);
    store
        .offload_sync(3, TensorMem::Staged(Box::new(Vram(data.clone()))), OffloadOptions::default())
        .unwrap();
    let got = store.prefetch_sync(3, TensorMem::Staged(Box::new(Vram(vec![0; len])))).unwrap();
    assert_same(&bytes_of(&got), &data, "content");
}

#[test]
fn offload_keep_hands_the_source_back_after_the_copy_is_stored() {
    let disks = sim_disks(2, 64 * MIB, 14);
    let store = store(&disks, false);
    let pool = pool();
    let len = 2 * MIB as usize + 99;
    let data = content(8, 0, len);
    let (outcome, src) = store
        .offload_keep(8, host_mem(&pool, &data), OffloadOptions::default())
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(outcome, OffloadOutcome::OnSsd);
    assert_same(&bytes_of(&src), &data, "the source is intact");
    assert_eq!(store.info(8).unwrap().location, Location::OnSsd);
    // A prefetch does not cancel a queued offload_keep: the copy is written.
    let h = store.offload_keep(8, src, OffloadOptions::default()).unwrap();
    let got = store.prefetch(8, host_zeroed(&pool, len), Priority::Normal).unwrap().wait().unwrap();
    assert_same(&bytes_of(&got), &data, "prefetched");
    assert_eq!(h.wait().unwrap().0, OffloadOutcome::OnSsd);
    assert_eq!(store.stats().offloads_cancelled, 0);
}

#[test]
fn a_retaining_store_keeps_copies_after_prefetch() {
    let disks = sim_disks(2, 64 * MIB, 15);
    let tier: Arc<dyn MemoryTier> = HostTier::new("host", 8 * MIB).unwrap();
    let mut cfg = StoreConfig::new(sim_array(&disks));
    cfg.retain_on_prefetch = true;
    cfg.host_tier = Some(tier);
    let store = TensorStore::open(cfg).unwrap();
    let pool = pool();
    let len = 3 * MIB as usize;
    let host = OffloadOptions { destination: Destination::Host, ..Default::default() };
    store.offload_sync(1, host_mem(&pool, &content(1, 0, len)), OffloadOptions::default()).unwrap();
    store.offload_sync(2, host_mem(&pool, &content(2, 0, len)), host).unwrap();
    for round in 0..3 {
        for id in [1, 2] {
            let got = store.prefetch_sync(id, host_zeroed(&pool, len)).unwrap();
            assert_same(
                &bytes_of(&got),
                &content(id, 0, len),
                &format!("round {round} tensor {id}"),
            );
        }
    }
    assert_eq!(store.info(1).unwrap().location, Location::OnSsd);
    assert_eq!(store.info(2).unwrap().location, Location::InHost);
    // No cancellation: a prefetch behind a queued offload waits for the write.
    let h =
        store.offload(1, host_mem(&pool, &content(1, 1, len)), OffloadOptions::default()).unwrap();
    let got = store.prefetch_sync(1, host_zeroed(&pool, len)).unwrap();
    assert_same(&bytes_of(&got), &content(1, 1, len), "new version");
    assert_eq!(h.wait().unwrap(), OffloadOutcome::OnSsd);
    assert_eq!(store.stats().offloads_cancelled, 0);
}

#[test]
fn retaining_store_survives_rewrite_then_interleaved_reads_and_writes() {
    let disks = sim_disks(4, 1024 * MIB, 16);
    let mut cfg = StoreConfig::new(sim_array(&disks));
    cfg.retain_on_prefetch = true;
    let store = TensorStore::open(cfg).unwrap();
    let pool = pool();
    let len = 32 * MIB as usize;
    let n = 16u64;
    let hs: Vec<_> = (0..n)
        .map(|i| {
            store
                .offload(
                    100 + i,
                    host_mem(&pool, &content(100 + i, 0, len)),
                    OffloadOptions::default(),
                )
                .unwrap()
        })
        .collect();
    for h in hs {
        h.wait().unwrap();
    }
    let back: Vec<_> = (0..n)
        .map(|i| store.prefetch(100 + i, host_zeroed(&pool, len), Priority::Normal).unwrap())
        .map(|h| h.wait().unwrap())
        .collect();
    for (i, m) in back.iter().enumerate() {
        assert_same(&bytes_of(m), &content(100 + i as u64, 0, len), "first read");
    }
    let hs: Vec<_> = back
        .into_iter()
        .enumerate()
        .map(|(i, m)| store.offload(100 + i as u64, m, OffloadOptions::default()).unwrap())
        .collect();
    for h in hs {
        h.wait().unwrap();
    }
    let mut pairs = Vec::new();
    for i in 0..n {
        let w = store
            .offload(200 + i, host_mem(&pool, &content(200 + i, 0, len)), OffloadOptions::default())
            .unwrap();
        let r = store.prefetch(100 + i, host_zeroed(&pool, len), Priority::Normal).unwrap();
        pairs.push((w, r));
    }
    for (i, (w, r)) in pairs.into_iter().enumerate() {
        w.wait().unwrap();
        assert_same(
            &bytes_of(&r.wait().unwrap()),
            &content(100 + i as u64, 0, len),
            &format!("tensor {i}"),
        );
    }
}

// Issue 36, "an old version comes back": once an offload of v2 is accepted, no prefetch may
// return v1; when v2 cannot be had, the prefetch fails naming the tensor.

/// The prefetch must fail as "nothing to read" naming tensor `id` (never return a version).
#[track_caller]
fn assert_no_version(r: teraio_engine::Result<TensorMem>, id: u64, what: &str) {
    match r {
        Err(Error::InvalidState { tensor, detail }) => {
            assert_eq!(tensor, id.to_string(), "{what}: the error names the tensor");
            assert!(detail.contains("offload"), "{what}: the error says what to do: {detail}");
        }
        Err(other) => {
            panic!("{what}: expected an error saying there is nothing to read, got {other}")
        }
        Ok(m) => {
            let got = bytes_of(&m);
            let version = (0..4).find(|&v| content(id, v, got.len()) == got);
            panic!("{what}: a prefetch returned {} bytes (version {version:?})", got.len())
        }
    }
}

fn prefetch_now(store: &TensorStore, id: u64, len: usize) -> teraio_engine::Result<TensorMem> {
    store.prefetch(id, host_zeroed(&pool(), len), Priority::Urgent).and_then(|h| h.wait())
}

/// A one-worker volatile store whose worker is kept busy by a slow offload of another tensor,
/// so that an offload queued now is still queued when the next prefetch comes.
fn busy_volatile_store(seed: u64) -> (Vec<Arc<teraio_engine::backend::sim::SimDisk>>, TensorStore) {
    let disks = sim_disks(1, 256 * MIB, seed);
    let mut cfg = StoreConfig::new(sim_array(&disks));
    cfg.workers = 1;
    (disks, TensorStore::open(cfg).unwrap())
}

#[test]
fn a_prefetch_that_cancels_an_overwrite_leaves_no_older_version_behind() {
    for (v2_len, what) in [(MIB as usize, "same size"), (3 * MIB as usize, "another size")] {
        let (disks, store) = busy_volatile_store(40);
        let pool = pool();
        let (id, v1_len) = (4242u64, MIB as usize);
        let v1 = host_mem(&pool, &content(id, 1, v1_len));
        assert_eq!(store.offload_sync(id, v1, Default::default()).unwrap(), OffloadOutcome::OnSsd);
        disks[0].inject(SimFault::Latency { min_us: 50_000, max_us: 50_000 });
        let (busy_mem, v2, dst) = (
            host_mem(&pool, &content(7, 0, MIB as usize)),
            host_mem(&pool, &content(id, 2, v2_len)),
            host_zeroed(&pool, v2_len),
        );
        let busy = store.offload(7, busy_mem, OffloadOptions::default()).unwrap();
        let overwrite = store.offload(id, v2, OffloadOptions::default()).unwrap();
        let p = store.prefetch(id, dst, Priority::Urgent).unwrap();
        assert_same(&bytes_of(&p.wait().unwrap()), &content(id, 2, v2_len), what);
        assert_eq!(overwrite.wait().unwrap(), OffloadOutcome::Cancelled, "{what}");
        assert_no_version(prefetch_now(&store, id, v2_len), id, what);
        // The older copy's space is given back, not leaked.
        busy.wait().unwrap();
        store.free(7).unwrap().wait().unwrap();
        assert_eq!(store.space().total.used_bytes, 0, "{what}");
        // A new offload is read back as usual.
        store
            .offload_sync(id, host_mem(&pool, &content(id, 3, v2_len)), Default::default())
            .unwrap();
        let got = prefetch_now(&store, id, v2_len).unwrap();
        assert_same(&bytes_of(&got), &content(id, 3, v2_len), what);
    }
}

#[test]
fn a_prefetch_that_cancels_an_overwrite_behind_a_running_one_never_sees_the_older() {
    // v1's offload is still running (slow disk) when v2 is queued behind it and the prefetch
    // cancels v2: whatever v1's offload leaves (a copy, or its source when it fails) is older.
    for fail_v1 in [false, true] {
        let disks = sim_disks(1, 256 * MIB, 41);
        let store = store(&disks, false);
        let pool = pool();
        let (id, len) = (77u64, 2 * MIB as usize);
        disks[0].inject(SimFault::Latency { min_us: 50_000, max_us: 50_000 });
        if fail_v1 {
            disks[0].inject(SimFault::Eio { op: SimOp::Write, after_ops: 0 });
        }
        let (v1, v2, dst) = (
            host_mem(&pool, &content(id, 1, len)),
            host_mem(&pool, &content(id, 2, len)),
            host_zeroed(&pool, len),
        );
        let first = store.offload(id, v1, OffloadOptions::default()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(10)); // v1's write is running
        let second = store.offload(id, v2, OffloadOptions::default()).unwrap();
        let got = store.prefetch(id, dst, Priority::Urgent).unwrap().wait().unwrap();
        assert_same(&bytes_of(&got), &content(id, 2, len), "the prefetch gets v2");
        assert_eq!(second.wait().unwrap(), OffloadOutcome::Cancelled);
        assert_eq!(first.wait().is_err(), fail_v1);
        disks[0].clear_faults();
        let what = format!("v1's offload failed: {fail_v1}");
        assert_no_version(prefetch_now(&store, id, len), id, &what);
        store.drain();
        assert_eq!(store.space().total.used_bytes, 0, "{what}");
        assert!(store.take_held(id).is_none(), "{what}: v1's source is not kept");
    }
}

#[test]
fn the_issues_repro_a_second_prefetch_never_returns_the_overwritten_version() {
    // The report's sequence on the default store, 20 times (it returned v1 in 19 of 20 runs).
    let pool = pool();
    for run in 0..20u64 {
        for v2_len in [MIB as usize, 3 * MIB as usize] {
            let disks = sim_disks(2, 64 * MIB, 42 + run);
            let store = TensorStore::open(StoreConfig::new(sim_array(&disks))).unwrap();
            let id = 1u64;
            store
                .offload_sync(
                    id,
                    host_mem(&pool, &content(id, 1, MIB as usize)),
                    Default::default(),
                )
                .unwrap();
            let v2 =
                store.offload(id, host_mem(&pool, &content(id, 2, v2_len)), Default::default());
            let got = prefetch_now(&store, id, v2_len).unwrap();
            assert_same(&bytes_of(&got), &content(id, 2, v2_len), "the first prefetch");
            v2.unwrap().wait().unwrap();
            let what = format!("run {run}, v2 of {v2_len} bytes");
            assert_no_version(prefetch_now(&store, id, v2_len), id, &what);
        }
    }
}

/// A store of `mode` on one small disk; tensor `id` at v1 (1 MiB) and a filler taking the
/// rest of the space, so that an overwrite of the same size fails with NoSpace.
fn full_store_with_v1(
    disks: &[Arc<teraio_engine::backend::sim::SimDisk>],
    persistent: bool,
    retain: bool,
    id: u64,
) -> TensorStore {
    let mut cfg = StoreConfig::new(sim_array(disks));
    cfg.persistent = persistent;
    cfg.retain_on_prefetch = retain;
    let store = TensorStore::open(cfg).unwrap();
    let pool = pool();
    store
        .offload_sync(id, host_mem(&pool, &content(id, 1, MIB as usize)), Default::default())
        .unwrap();
    let free = store.space().total.free_bytes as usize;
    store.offload_sync(99, host_mem(&pool, &content(99, 0, free)), Default::default()).unwrap();
    assert_eq!(store.space().total.free_bytes, 0);
    store
}

#[test]
fn an_overwrite_that_fails_with_no_space_never_lets_the_older_version_back() {
    let id = 31u64;
    let len = MIB as usize;
    for (persistent, retain, what) in [
        (false, false, "volatile"),
        (false, true, "retain_on_prefetch"),
        (true, false, "persistent"),
    ] {
        let disks = sim_disks(1, 32 * MIB, 43);
        let store = full_store_with_v1(&disks, persistent, retain, id);
        let pool = pool();
        let err = store
            .offload_sync(id, host_mem(&pool, &content(id, 2, len)), Default::default())
            .unwrap_err();
        assert!(err.to_string().contains("no space"), "{what}: {err}");
        assert_eq!(store.info(id).unwrap().location, Location::Held, "{what}");
        assert!(
            !store.has_current_copy_in(id, Destination::Ssd),
            "{what}: the SSD copy is v1, not the tensor's current content"
        );
        let got = prefetch_now(&store, id, len).unwrap();
        assert_same(&bytes_of(&got), &content(id, 2, len), &format!("{what}: the held v2"));
        assert_no_version(prefetch_now(&store, id, len), id, what);
        // Held again, then taken back by the caller: still nothing older to read.
        disks[0].inject(SimFault::Eio { op: SimOp::Write, after_ops: 0 });
        let r = store.offload_sync(id, host_mem(&pool, &content(id, 3, len)), Default::default());
        assert!(r.is_err(), "{what}: v3's write fails");
        disks[0].clear_faults();
        assert_same(&bytes_of(&store.take_held(id).unwrap()), &content(id, 3, len), what);
        assert_no_version(prefetch_now(&store, id, len), id, what);
        if persistent {
            // v1 is the durable version (v2 and v3 were never acknowledged): a reopen finds it.
            drop(store);
            let store = self::store(&disks, true);
            let got = prefetch_now(&store, id, len).unwrap();
            assert_same(&bytes_of(&got), &content(id, 1, len), "after reopen, the durable v1");
        }
    }
}

#[test]
fn a_failed_overwrite_drops_the_older_host_tier_copy() {
    let disks = sim_disks(1, 64 * MIB, 44);
    let tier: Arc<dyn MemoryTier> = HostTier::new("host", 8 * MIB).unwrap();
    let mut cfg = StoreConfig::new(sim_array(&disks));
    cfg.host_tier = Some(tier.clone());
    let store = TensorStore::open(cfg).unwrap();
    let pool = pool();
    let (id, len) = (5u64, MIB as usize);
    let host = OffloadOptions { destination: Destination::Host, ..Default::default() };
    assert_eq!(
        store.offload_sync(id, host_mem(&pool, &content(id, 1, len)), host).unwrap(),
        OffloadOutcome::InHost
    );
    disks[0].inject(SimFault::Eio { op: SimOp::Write, after_ops: 0 });
    store.offload_sync(id, host_mem(&pool, &content(id, 2, len)), Default::default()).unwrap_err();
    assert_eq!(tier.used_bytes(), 0, "the older host copy is released");
    let got = prefetch_now(&store, id, len).unwrap();
    assert_same(&bytes_of(&got), &content(id, 2, len), "the held v2");
    assert_no_version(prefetch_now(&store, id, len), id, "after the held copy was taken");
}

#[test]
fn a_persistent_store_reuses_overwritten_extents_without_a_manual_checkpoint() {
    // The report: 55 overwrites of one 1 MiB tensor on a 64 MiB file failed with "no space for
    // 1048576 bytes: 0 bytes free" (overwritten extents waited for a checkpoint nobody wrote).
    let disks = sim_disks(1, 64 * MIB, 45);
    let pool = pool();
    let len = MIB as usize;
    let rounds = 200u64;
    {
        let store = store(&disks, true);
        let data_bytes = store.space().total.free_bytes;
        assert!(rounds * MIB > 2 * data_bytes, "the overwrites outgrow the array");
        for v in 0..rounds {
            let out =
                store.offload_sync(1, host_mem(&pool, &content(1, v, len)), Default::default());
            assert_eq!(out.unwrap_or_else(|e| panic!("overwrite {v}: {e}")), OffloadOutcome::OnSsd);
        }
        let got = prefetch_now(&store, 1, len).unwrap();
        assert_same(&bytes_of(&got), &content(1, rounds - 1, len), "the last version");
    }
    let store = store(&disks, true);
    let got = prefetch_now(&store, 1, len).unwrap();
    assert_same(&bytes_of(&got), &content(1, rounds - 1, len), "the last version after reopen");
    assert_eq!(store.space().total.used_bytes, MIB, "one copy's extents in use");
}

#[test]
fn a_persistent_store_full_of_live_tensors_still_reports_no_space() {
    // The checkpoint on NoSpace frees only what waits for one: live data is never reclaimed.
    let disks = sim_disks(1, 32 * MIB, 46);
    let store = store(&disks, true);
    let pool = pool();
    let free = store.space().total.free_bytes as usize;
    store.offload_sync(1, host_mem(&pool, &content(1, 0, free)), Default::default()).unwrap();
    let err = store
        .offload_sync(2, host_mem(&pool, &content(2, 0, 4096)), Default::default())
        .unwrap_err();
    assert!(matches!(err, Error::Alloc(_)), "{err}");
    let got = prefetch_now(&store, 1, free).unwrap();
    assert_same(&bytes_of(&got), &content(1, 0, free), "the live tensor");
}

#[test]
fn a_free_after_a_failed_journal_write_is_an_error_not_a_promise() {
    // The journal write of tensor 8's offload fails: that record may still reach the disk (a
    // write that failed at its sync), so a reopen may find the tensor; the metadata is
    // read-only until then. A free of it cannot be made durable and must say so (it returned
    // Ok, and the "freed" tensor came back after a crash: found by the store's model test).
    let disks = sim_disks(1, 64 * MIB, 47);
    let store = store(&disks, true);
    let pool = pool();
    // How many writes an offload makes: its data, then its journal record last.
    let before = disks[0].stats().writes;
    store
        .offload_sync(9, host_mem(&pool, &content(9, 1, MIB as usize)), Default::default())
        .unwrap();
    let writes = disks[0].stats().writes - before;
    disks[0].inject(SimFault::Eio { op: SimOp::Write, after_ops: writes - 1 }); // data, no journal
    let err = store
        .offload_sync(8, host_mem(&pool, &content(8, 1, MIB as usize)), Default::default())
        .unwrap_err();
    assert!(err.to_string().contains("device 0"), "{err}");
    disks[0].clear_faults();
    let err = store.free(8).unwrap().wait().unwrap_err();
    assert!(err.to_string().contains("reopen"), "the error says what to do: {err}");
    // After a reopen the store knows again what is durable, and the free works.
    drop(store);
    let store = self::store(&disks, true);
    if store.info(8).is_some() {
        store.free(8).unwrap().wait().unwrap();
    }
    assert!(store.info(8).is_none());
}
