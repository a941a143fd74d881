//! Crash tests on simulated disks: a persistent store runs a fixed sequence of acknowledged
//! operations; the disks stop accepting writes at every possible point (each device, each
//! write), lose what was not flushed, and the store is reopened. Every acknowledged tensor must
//! be there, intact; every acknowledged free must be gone; no two tensors may overlap.

mod store_common;

use std::collections::HashMap;
use std::sync::Arc;

use store_common::*;
use teraio_engine::backend::sim::{SimDisk, SimFault, SimOp};
use teraio_engine::store::{OffloadOptions, TensorStore};
use teraio_layout::format::{DeviceLayout, RecordBody, encode_journal_batch};

#[derive(Clone, Copy, Debug)]
enum Step {
    Offload(u64, usize),
    Free(u64),
    Checkpoint,
}

const STEPS: &[Step] = &[
    Step::Offload(1, 3 * MIB as usize + 5),
    Step::Offload(2, MIB as usize),
    Step::Offload(3, 5 * MIB as usize - 3),
    Step::Free(2),
    Step::Offload(1, 2 * MIB as usize),
    Step::Checkpoint,
    Step::Offload(4, 4 * MIB as usize),
    Step::Free(3),
    Step::Offload(2, 700_000),
];

/// The state a step leaves: id -> (version, len).
type State = HashMap<u64, (u64, usize)>;

fn apply(state: &mut State, i: usize, step: Step) {
    match step {
        Step::Offload(id, len) => {
            state.insert(id, (i as u64, len));
        }
        Step::Free(id) => {
            state.remove(&id);
        }
        Step::Checkpoint => {}
    }
}

/// Overwrites that outgrow the array: the extents of the versions they replace are reused only
/// through the checkpoints written when an allocation finds no space (issue 36), so a crash
/// lands in those checkpoints too.
const OVERWRITES: &[Step] = &[
    Step::Offload(1, 4 * MIB as usize),
    Step::Offload(2, 2 * MIB as usize + 9),
    Step::Offload(1, 4 * MIB as usize),
    Step::Offload(1, 4 * MIB as usize - 100),
    Step::Offload(2, 3 * MIB as usize),
    Step::Offload(1, 4 * MIB as usize),
    Step::Free(2),
    Step::Offload(3, 3 * MIB as usize - 5),
    Step::Offload(1, 4 * MIB as usize),
    Step::Offload(3, 3 * MIB as usize - 5),
    Step::Offload(1, 3 * MIB as usize),
];

/// Run the steps until one fails. Returns the index of the first failed step (or steps.len()).
fn run(store: &TensorStore, steps: &[Step]) -> usize {
    let pool = pool();
    for (i, &step) in steps.iter().enumerate() {
        let ok = match step {
            Step::Offload(id, len) => store
                .offload_sync(
                    id,
                    host_mem(&pool, &content(id, i as u64, len)),
                    OffloadOptions::default(),
                )
                .is_ok(),
            Step::Free(id) => store.free(id).and_then(|h| h.wait()).is_ok(),
            Step::Checkpoint => store.checkpoint().is_ok(),
        };
        if !ok {
            return i;
        }
    }
    steps.len()
}

fn writes(disks: &[Arc<SimDisk>]) -> Vec<u64> {
    disks.iter().map(|d| d.stats().writes).collect()
}

/// Verify the reopened store holds `before` or `after` (the step in flight may or may not have
/// taken effect), tensor by tensor, with intact content.
fn verify(disks: &[Arc<SimDisk>], before: &State, after: &State, what: &str) {
    let store = store(disks, true);
    let pool = pool();
    let ids: std::collections::BTreeSet<u64> = before.keys().chain(after.keys()).copied().collect();
    for id in ids {
        let candidates: Vec<_> = [before.get(&id), after.get(&id)].into_iter().collect();
        let found = store.info(id);
        match found {
            None => assert!(candidates.contains(&None), "{what}: acknowledged tensor {id} is lost"),
            Some(info) => {
                let len = info.size_bytes as usize;
                let got = store
                    .prefetch_sync(id, host_zeroed(&pool, len))
                    .unwrap_or_else(|e| panic!("{what}: tensor {id} unreadable: {e}"));
                let got = bytes_of(&got);
                let ok = candidates
                    .iter()
                    .flatten()
                    .any(|&&(v, l)| l == len && content(id, v, l) == got);
                assert!(
                    ok,
                    "{what}: tensor {id} ({len} bytes) holds neither its old nor its new content"
                );
            }
        }
    }
    for t in store.tensors() {
        assert!(
            before.contains_key(&t.id.get()) || after.contains_key(&t.id.get()),
            "{what}: unknown tensor {} appeared",
            t.id
        );
    }
    // The reopen itself refuses overlapping tensors; the allocator must agree with the table.
    let used: u64 = store
        .tensors()
        .iter()
        .map(|t| t.stripe_map.as_ref().unwrap().extents().map(|(_, e)| e.len).sum::<u64>())
        .sum();
    assert_eq!(store.space().total.used_bytes, used, "{what}: allocator and table disagree");
}

#[test]
fn every_acknowledged_tensor_survives_a_crash_at_every_write() {
    crash_at_every_write(STEPS, 2, 64 * MIB);
}

#[test]
fn overwrites_that_reuse_space_through_checkpoints_survive_a_crash_at_every_write() {
    const CAP: u64 = 8 * MIB;
    let written: usize =
        OVERWRITES.iter().map(|s| if let Step::Offload(_, len) = s { *len } else { 0 }).sum();
    let data = store(&sim_disks(2, CAP, 100), true).space().total.free_bytes;
    assert!(written as u64 > 2 * data, "the sequence writes {written} bytes on {data}");
    crash_at_every_write(OVERWRITES, 2, CAP);
}

/// Run `steps` once cleanly, then once per write of that run with the disks failing from that
/// write on, crashed and reopened: [`verify`] after each.
fn crash_at_every_write(steps: &[Step], disk_count: usize, capacity: u64) {
    // A clean run: per-step write counts of each disk.
    let disks = sim_disks(disk_count, capacity, 100);
    let clean = store(&disks, true);
    let pool = pool();
    let mut counts = vec![writes(&disks)];
    let mut states = vec![State::new()];
    for (i, &step) in steps.iter().enumerate() {
        match step {
            Step::Offload(id, len) => {
                clean
                    .offload_sync(
                        id,
                        host_mem(&pool, &content(id, i as u64, len)),
                        OffloadOptions::default(),
                    )
                    .unwrap_or_else(|e| panic!("clean run, step {i}: {e}"));
            }
            Step::Free(id) => clean.free(id).unwrap().wait().unwrap(),
            Step::Checkpoint => clean.checkpoint().unwrap(),
        }
        counts.push(writes(&disks));
        let mut s = states.last().unwrap().clone();
        apply(&mut s, i, step);
        states.push(s);
    }
    drop(clean);
    verify(&disks, &states[steps.len()], &states[steps.len()], "clean run");

    let mut crash_points = 0;
    for step in 0..steps.len() {
        for dev in 0..disk_count {
            for stop_at in counts[step][dev]..counts[step + 1][dev] {
                let disks = sim_disks(disk_count, capacity, 100);
                // Format the array and let the first `step` steps through on every disk, then
                // stop device `dev` at its `stop_at`-th write.
                let store = store(&disks, true);
                let base = writes(&disks);
                for (d, disk) in disks.iter().enumerate() {
                    let allow = if d == dev { stop_at } else { counts[step + 1][d] } - counts[0][d];
                    disk.inject(SimFault::Eio {
                        op: SimOp::Write,
                        after_ops: allow + base[d] - counts[0][d],
                    });
                }
                let failed_at = run(&store, steps);
                assert!(failed_at >= step, "step {failed_at} failed before the crash point");
                // The store closes with the faults still active, then power is lost.
                drop(store);
                for d in &disks {
                    d.crash();
                    d.clear_faults();
                }
                let what = format!("crash on device {dev} at write {stop_at} (step {step})");
                verify(
                    &disks,
                    &states[step],
                    &states[(failed_at + 1).min(steps.len())].clone(),
                    &what,
                );
                crash_points += 1;
            }
        }
    }
    let total: u64 = (0..disk_count).map(|d| counts[steps.len()][d] - counts[0][d]).sum();
    assert_eq!(crash_points, total, "one crash point per write of the sequence");
}

#[test]
fn a_reopen_makes_the_journal_it_applied_durable() {
    // A journal record that reached the device but not stable storage (its sync failed, then
    // the process restarted): a reopen that applies it must make it durable first, or a power
    // loss later brings back the tensor the reopened store showed as deleted (found by the
    // store's model test, engine/tests/store_model.rs).
    const CAP: u64 = 64 * MIB;
    let disks = sim_disks(1, CAP, 101);
    let pool = pool();
    let (a, b) = (content(1, 1, MIB as usize), content(2, 1, 3 * MIB as usize));
    {
        let s = store(&disks, true);
        s.offload_sync(1, host_mem(&pool, &a), OffloadOptions::default()).unwrap();
        s.offload_sync(2, host_mem(&pool, &b), OffloadOptions::default()).unwrap();
    } // closed: a checkpoint covers records 1 and 2, the journal starts over
    let array = sim_array(&disks);
    let layout = DeviceLayout::with_defaults(CAP, 4096, MIB).unwrap();
    let batch = encode_journal_batch(3, &[RecordBody::DeleteTensor { id: 1 }], 4096).unwrap();
    let mut buf = pool.alloc(batch.len()).unwrap();
    buf.copy_from_slice(&batch);
    let (_, r) = array.write_at(0, layout.journal.offset, buf).unwrap().wait();
    r.unwrap(); // written, never flushed
    drop(array);
    {
        let s = store(&disks, true);
        assert!(s.info(1).is_none(), "the reopen applied the delete");
        // Power is lost before anything else is written (the close's checkpoint fails).
        disks[0].inject(SimFault::Eio { op: SimOp::Write, after_ops: 0 });
        drop(s);
    }
    disks[0].crash();
    disks[0].clear_faults();
    let s = store(&disks, true);
    assert!(s.info(1).is_none(), "tensor 1, deleted as the reopened store said, came back");
    let got = s.prefetch_sync(2, host_zeroed(&pool, b.len())).unwrap();
    assert_same(&bytes_of(&got), &b, "tensor 2");
}
