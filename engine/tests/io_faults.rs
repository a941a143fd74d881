//! Fault injection on simulated disks: EIO on one device fails only the operations touching
//! it (with the device named), ENOSPC, short transfers are resumed, crashes lose exactly the
//! unflushed writes, and a GiB-sized striped round trip stays cheap.

mod io_common;

use std::sync::Arc;

use io_common::{Kind, map, open, pattern, pool};
use teraio_engine::Error;
use teraio_engine::array::{ArrayConfig, DeviceArray, ExistingData, Target};
use teraio_engine::backend::sim::{SimDisk, SimFault, SimOp};

const MIB: u64 = 1 << 20;

#[test]
fn eio_on_one_device_fails_that_tensor_only() {
    let fx = open(Kind::Sim, 4, 32 * MIB, 8);
    let p = pool(64 * MIB);
    // Tensor A on devices 0-1, tensor B on devices 2-3.
    let a = map(4 * MIB, MIB, 2, 0, 0);
    let b = map(4 * MIB, MIB, 2, 2, 0);
    fx.sims[2].inject(SimFault::Eio { op: SimOp::Write, after_ops: 0 });
    let mut ba = p.alloc(4 * MIB as usize).unwrap();
    ba.copy_from_slice(&pattern(4 * MIB as usize, 1));
    let mut bb = p.alloc(4 * MIB as usize).unwrap();
    bb.copy_from_slice(&pattern(4 * MIB as usize, 2));
    let ta = fx.array.submit_write(&a, 0..4 * MIB, ba).unwrap();
    let tb = fx.array.submit_write(&b, 0..4 * MIB, bb).unwrap();
    let (_, ra) = ta.wait();
    while !tb.is_done() {
        std::thread::yield_now();
    }
    assert_eq!(tb.failed_devices(), vec![2]);
    ra.expect("tensor A does not touch the failing device");
    let (bb, rb) = tb.wait();
    assert_eq!(bb.len(), 4 * MIB as usize, "the buffer comes back on error");
    match rb {
        Err(Error::Io { device: 2, ref path, ref source }) => {
            assert_eq!(path.to_str(), Some("sim:2"));
            assert_eq!(source.raw_os_error(), Some(libc::EIO));
        }
        other => panic!("expected EIO on device 2, got {other:?}"),
    }
    let msg = rb.unwrap_err().to_string();
    assert!(msg.contains("device 2") && msg.contains("sim:2"), "{msg}");
    // Device 3 received its half of B anyway (the other devices continue).
    let mut lane3 = vec![0u8; MIB as usize];
    fx.sims[3].peek(0, &mut lane3);
    assert!(lane3[..] == pattern(4 * MIB as usize, 2)[MIB as usize..2 * MIB as usize]);
    // Reads of A still work, and after clearing the fault B can be written.
    let (back, r) =
        fx.array.submit_read(&a, 0..4 * MIB, p.alloc(4 * MIB as usize).unwrap()).unwrap().wait();
    r.unwrap();
    assert!(back[..] == pattern(4 * MIB as usize, 1)[..]);
    fx.sims[2].clear_faults();
    fx.array.submit_write(&b, 0..4 * MIB, bb).unwrap().wait().1.unwrap();
}

#[test]
fn failed_devices_names_every_failing_device() {
    let fx = open(Kind::Sim, 3, 16 * MIB, 8);
    let p = pool(16 * MIB);
    fx.sims[0].inject(SimFault::Eio { op: SimOp::Read, after_ops: 0 });
    fx.sims[2].inject(SimFault::Eio { op: SimOp::Any, after_ops: 0 });
    let m = map(3 * MIB, MIB, 3, 0, 0);
    let t = fx.array.submit_read(&m, 0..3 * MIB, p.alloc(3 * MIB as usize).unwrap()).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !t.is_done() {
        assert!(std::time::Instant::now() < deadline);
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let mut failed = t.failed_devices();
    failed.sort_unstable();
    assert_eq!(failed, vec![0, 2]);
    assert!(matches!(t.wait().1, Err(Error::Io { device: 0 | 2, .. })));
}

#[test]
fn enospc_is_reported() {
    let fx = open(Kind::Sim, 1, 16 * MIB, 8);
    let p = pool(16 * MIB);
    fx.sims[0].inject(SimFault::Enospc { after_ops: 1 });
    fx.array.write_at(0, 0, p.alloc(4096).unwrap()).unwrap().wait().1.unwrap();
    let (_, r) = fx.array.write_at(0, 4096, p.alloc(4096).unwrap()).unwrap().wait();
    match r {
        Err(Error::Io { device: 0, source, .. }) => {
            assert_eq!(source.raw_os_error(), Some(libc::ENOSPC))
        }
        other => panic!("expected ENOSPC, got {other:?}"),
    }
}

#[test]
fn short_transfers_are_resumed() {
    let fx = open(Kind::Sim, 2, 16 * MIB, 8);
    let p = pool(32 * MIB);
    for d in &fx.sims {
        d.inject(SimFault::ShortTransfer { op: SimOp::Any, after_ops: 0 });
    }
    let size = 5 * MIB + 777;
    let m = map(size, 256 * 1024, 2, 0, 0);
    let data = pattern(size as usize, 3);
    let mut b = p.alloc(m.padded_bytes() as usize).unwrap();
    b[..size as usize].copy_from_slice(&data);
    fx.array.submit_write(&m, 0..size, b).unwrap().wait().1.unwrap();
    let (back, r) = fx
        .array
        .submit_read(&m, 0..size, p.alloc(m.padded_bytes() as usize).unwrap())
        .unwrap()
        .wait();
    r.unwrap();
    assert!(back[..size as usize] == data[..]);
    let shorts: u64 = fx.sims.iter().map(|d| d.stats().short_transfers).sum();
    assert!(shorts > 4, "the faults really cut transfers short ({shorts})");
}

#[test]
fn reading_past_a_sim_disk_end_is_refused_up_front() {
    let fx = open(Kind::Sim, 1, 4 * MIB, 8);
    let p = pool(8 * MIB);
    let e = fx.array.read_at(0, 4 * MIB, p.alloc(4096).unwrap()).unwrap_err();
    assert!(e.to_string().contains("past the end"), "{e}");
}

#[test]
fn crash_loses_only_unsynced_writes() {
    let disks: Vec<Arc<SimDisk>> = (0..2).map(|i| SimDisk::new(16 * MIB, 4096, i)).collect();
    let targets = || disks.iter().map(|d| Target::Sim(Arc::clone(d))).collect::<Vec<_>>();
    let p = pool(32 * MIB);
    let a = map(2 * MIB, MIB, 2, 0, 0);
    let b = map(2 * MIB, MIB, 2, 0, 4 * MIB);
    {
        let array = DeviceArray::open(ArrayConfig::new(targets())).unwrap();
        let mut buf = p.alloc(2 * MIB as usize).unwrap();
        buf.copy_from_slice(&pattern(2 * MIB as usize, 10));
        array.submit_write(&a, 0..2 * MIB, buf).unwrap().wait().1.unwrap();
        array.sync().unwrap();
        let mut buf = p.alloc(2 * MIB as usize).unwrap();
        buf.copy_from_slice(&pattern(2 * MIB as usize, 11));
        array.submit_write(&b, 0..2 * MIB, buf).unwrap().wait().1.unwrap();
        // Power cut before B was synced.
        disks.iter().for_each(|d| d.crash());
    }
    let mut config = ArrayConfig::new(targets());
    config.existing = ExistingData::AllowTeraio;
    let array = DeviceArray::open(config).unwrap();
    let (back, r) =
        array.submit_read(&a, 0..2 * MIB, p.alloc(2 * MIB as usize).unwrap()).unwrap().wait();
    r.unwrap();
    assert!(back[..] == pattern(2 * MIB as usize, 10)[..], "synced data survives the crash");
    let (back, r) =
        array.submit_read(&b, 0..2 * MIB, p.alloc(2 * MIB as usize).unwrap()).unwrap().wait();
    r.unwrap();
    assert!(back.iter().all(|&x| x == 0), "unsynced data is lost");
}

#[test]
fn failed_sync_names_the_device() {
    let fx = open(Kind::Sim, 2, 8 * MIB, 4);
    fx.sims[1].inject(SimFault::Eio { op: SimOp::Write, after_ops: 0 });
    // The device dies at its first refused write; from then on its flushes fail too.
    let buf = pool(MIB).alloc(4096).unwrap();
    let (_, r) = fx.array.write_at(1, 0, buf).unwrap().wait();
    assert!(r.is_err(), "the write is refused");
    match fx.array.sync() {
        Err(Error::Io { device: 1, .. }) => {}
        other => panic!("expected a flush error on device 1, got {other:?}"),
    }
}

#[test]
fn gib_sized_striped_round_trip_on_sim() {
    const GIB: u64 = 1 << 30;
    let fx = open(Kind::Sim, 4, GIB / 4 + 8 * MIB, 32);
    let p = pool(GIB + 4 * MIB);
    let size = GIB + 4097;
    let m = map(size, MIB, 4, 0, 0);
    let mut buf = p.alloc(m.padded_bytes() as usize).unwrap();
    io_common::fill(&mut buf[..size as usize], 77);
    let (mut buf, r) = fx.array.submit_write(&m, 0..size, buf).unwrap().wait();
    r.unwrap();
    let sum_before = checksum(&buf[..size as usize]);
    let tail_before = buf[GIB as usize..size as usize].to_vec();
    buf[..size as usize].fill(0);
    let (buf, r) = fx.array.submit_read(&m, 0..size, buf).unwrap().wait();
    r.unwrap();
    assert_eq!(checksum(&buf[..size as usize]), sum_before);
    assert_eq!(&buf[GIB as usize..size as usize], &tail_before[..], "the unit+1 tail came back");
}

fn checksum(b: &[u8]) -> u64 {
    b.chunks(8).fold(0u64, |acc, c| {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        acc.rotate_left(5) ^ u64::from_le_bytes(w)
    })
}
