//! One conformance suite, run on every backend (io_uring, psync, sim): raw and striped round
//! trips of odd sizes with data verified, alignment and bounds validation, dropped tickets,
//! many requests in flight, and durability barriers.

mod io_common;

use io_common::{Kind, all, map, open, pattern, pool};
use teraio_engine::Error;
use teraio_engine::array::{DeviceArray, IoTicket};
use teraio_engine::pool::IoBuf;

const MIB: u64 = 1 << 20;

fn _assert_thread_safety() {
    fn send<T: Send>() {}
    fn sync<T: Sync>() {}
    send::<IoBuf>();
    send::<IoTicket>();
    send::<DeviceArray>();
    sync::<DeviceArray>();
    sync::<teraio_engine::pool::BufferPool>();
}

/// The whole suite again on SPDK aio bdevs in SPDK's interrupt mode, in a child process of this
/// test binary: SPDK's mode is set once per process, and this one runs SPDK polling.
#[cfg(feature = "spdk")]
#[test]
fn the_suite_in_spdk_interrupt_mode() {
    if std::env::var_os(io_common::SPDK_INTERRUPT_ENV).is_some() {
        return; // the child itself
    }
    let (ok, text) = io_common::run_child(
        &["--skip", "the_suite_in_spdk_interrupt_mode", "--test-threads", "2"],
        &[(io_common::SPDK_INTERRUPT_ENV, "1")],
    );
    assert!(ok, "the suite failed in SPDK interrupt mode:\n{text}");
    let passed: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("test result: ok. ")?.split(' ').next()?.parse().ok())
        .unwrap_or(0);
    assert!(passed >= 10, "the interrupt-mode run passed only {passed} tests:\n{text}");
}

#[test]
fn raw_round_trip_on_every_device() {
    for kind in all() {
        let fx = open(kind, 3, 16 * MIB, 8);
        let p = pool(64 * MIB);
        for dev in 0..3u32 {
            let data = pattern(3 * MIB as usize + 8192, u64::from(dev) + 1);
            let mut buf = p.alloc(data.len()).unwrap();
            buf.copy_from_slice(&data);
            let (buf, r) = fx.array.write_at(dev, 4 * MIB, buf).unwrap().wait();
            r.unwrap_or_else(|e| panic!("{kind:?}: write on device {dev}: {e}"));
            drop(buf);
            let mut back = p.alloc(data.len()).unwrap();
            back.fill(0);
            let (back, r) = fx.array.read_at(dev, 4 * MIB, back).unwrap().wait();
            r.unwrap();
            assert!(back[..] == data[..], "{kind:?}: device {dev} returned other bytes");
        }
        assert_eq!(fx.array.device_count(), 3);
        assert_eq!(fx.array.device_capacity(1), 16 * MIB);
        assert!(fx.array.max_io_bytes() >= 4096 && fx.array.max_io_bytes().is_multiple_of(4096));
        fx.array.sync().unwrap();
    }
}

#[test]
fn validation_errors_come_before_any_io() {
    for kind in all() {
        let fx = open(kind, 2, 8 * MIB, 4);
        let p = pool(16 * MIB);
        let e = fx.array.write_at(0, 100, p.alloc(4096).unwrap()).unwrap_err();
        assert!(
            matches!(e, Error::Misaligned { what: "device offset", value: 100, .. }),
            "{kind:?}: {e}"
        );
        let e = fx.array.write_at(0, 0, p.alloc(1000).unwrap()).unwrap_err();
        assert!(matches!(e, Error::Misaligned { what: "transfer length", .. }), "{kind:?}: {e}");
        assert!(e.to_string().contains("O_DIRECT"), "the message says why: {e}");
        let e = fx.array.read_at(1, 8 * MIB - 4096, p.alloc(8192).unwrap()).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{kind:?}: {e}");
        assert!(e.to_string().contains("past the end of device 1"), "{e}");
        let e = fx.array.read_at(5, 0, p.alloc(4096).unwrap()).unwrap_err();
        assert!(e.to_string().contains("device 5 does not exist"), "{e}");
        // A stripe map range needing more than the buffer holds.
        let m = map(3 * MIB, MIB, 2, 0, 0);
        let e =
            fx.array.submit_write(&m, 0..3 * MIB, p.alloc(2 * MIB as usize).unwrap()).unwrap_err();
        assert!(e.to_string().contains("shorter than"), "{kind:?}: {e}");
        let e =
            fx.array.submit_read(&m, 100..3 * MIB, p.alloc(4 * MIB as usize).unwrap()).unwrap_err();
        assert!(matches!(e, Error::Layout(_)), "{kind:?}: {e}");
        // A map reaching past a device is refused before anything is written.
        let far = map(2 * MIB, MIB, 2, 0, 7 * MIB + MIB / 2);
        let e = fx
            .array
            .submit_write(&far, 0..2 * MIB, p.alloc(2 * MIB as usize).unwrap())
            .unwrap_err();
        assert!(e.to_string().contains("past the end"), "{kind:?}: {e}");
        assert_eq!(p.used_bytes(), 0, "rejected buffers went back to the pool");
    }
}

fn striped_round_trip(kind: Kind, size: u64, unit: u64, devices: u32) {
    let fx = open(kind, devices as usize, 64 * MIB, 16);
    let p = pool(256 * MIB);
    let m = map(size, unit, devices, 0, MIB);
    let data = pattern(size as usize, size ^ unit);
    let mut buf = p.alloc(m.padded_bytes() as usize).unwrap();
    buf[..size as usize].copy_from_slice(&data);
    let (buf, r) = fx.array.submit_write(&m, 0..size, buf).unwrap().wait();
    r.unwrap_or_else(|e| panic!("{kind:?} size {size}: {e}"));
    drop(buf);
    let mut back = p.alloc(m.padded_bytes() as usize).unwrap();
    back.fill(0xEE);
    let (back, r) = fx.array.submit_read(&m, 0..size, back).unwrap().wait();
    r.unwrap();
    assert!(back[..size as usize] == data[..], "{kind:?}: size {size} unit {unit} differs");
    // Every byte sits where the stripe map says: check a few through raw reads.
    for probe in [0, size / 3, size / 2, size - 1] {
        let (dev, off) = m.locate(probe).unwrap();
        let block = off / 4096 * 4096;
        let (raw, r) = fx.array.read_at(dev, block, p.alloc(4096).unwrap()).unwrap().wait();
        r.unwrap();
        assert_eq!(raw[(off - block) as usize], data[probe as usize], "{kind:?} byte {probe}");
    }
}

#[test]
fn striped_round_trips_of_odd_sizes() {
    let unit = 64 * 1024;
    for kind in all() {
        for size in [1, 4095, 4097, unit - 1, unit, unit + 1, 5 * unit + 12345, 3 * MIB + 1] {
            striped_round_trip(kind, size, unit, 4);
        }
        striped_round_trip(kind, 40 * MIB + 3, MIB, 3);
    }
}

#[test]
fn partial_ranges_of_a_tensor() {
    for kind in all() {
        let fx = open(kind, 4, 32 * MIB, 16);
        let p = pool(64 * MIB);
        let size = 10 * MIB + 100;
        let m = map(size, MIB, 4, 0, 0);
        let data = pattern(size as usize, 99);
        let mut buf = p.alloc(m.padded_bytes() as usize).unwrap();
        buf[..size as usize].copy_from_slice(&data);
        fx.array.submit_write(&m, 0..size, buf).unwrap().wait().1.unwrap();
        // The middle, crossing unit boundaries, and the tail.
        for range in [MIB / 2..3 * MIB + 4096, 9 * MIB..size] {
            let len =
                (m.padded_bytes().min(range.end.next_multiple_of(4096)) - range.start) as usize;
            let (back, r) =
                fx.array.submit_read(&m, range.clone(), p.alloc(len).unwrap()).unwrap().wait();
            r.unwrap();
            let n = (range.end - range.start) as usize;
            assert!(
                back[..n] == data[range.start as usize..range.end as usize],
                "{kind:?} {range:?}"
            );
        }
    }
}

#[test]
fn many_requests_in_flight() {
    for kind in all() {
        let fx = open(kind, 2, 32 * MIB, 8);
        let p = pool(64 * MIB);
        let n = 200u64;
        let tickets: Vec<_> = (0..n)
            .map(|i| {
                let mut b = p.alloc(64 * 1024).unwrap();
                b.copy_from_slice(&pattern(64 * 1024, i));
                fx.array.write_at((i % 2) as u32, (i / 2) * 64 * 1024, b).unwrap()
            })
            .collect();
        for t in tickets {
            t.wait().1.unwrap();
        }
        let tickets: Vec<_> = (0..n)
            .map(|i| {
                fx.array
                    .read_at((i % 2) as u32, (i / 2) * 64 * 1024, p.alloc(64 * 1024).unwrap())
                    .unwrap()
            })
            .collect();
        for (i, t) in tickets.into_iter().enumerate() {
            let (b, r) = t.wait();
            r.unwrap();
            assert!(b[..] == pattern(64 * 1024, i as u64)[..], "{kind:?}: request {i}");
        }
    }
}

#[test]
fn dropped_tickets_keep_their_buffers_alive() {
    for kind in all() {
        let fx = open(kind, 2, 32 * MIB, 8);
        if let Some(d) = fx.sims.first() {
            d.inject(teraio_engine::backend::sim::SimFault::Latency { min_us: 2000, max_us: 5000 });
        }
        let p = pool(64 * MIB);
        let m = map(8 * MIB, MIB, 2, 0, 0);
        let mut b = p.alloc(8 * MIB as usize).unwrap();
        b.copy_from_slice(&pattern(8 * MIB as usize, 5));
        let t = fx.array.submit_write(&m, 0..8 * MIB, b).unwrap();
        drop(t);
        for _ in 0..8 {
            let t = fx.array.read_at(1, 0, p.alloc(MIB as usize).unwrap()).unwrap();
            drop(t);
        }
        // Every buffer returns to the pool once its requests completed.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while p.used_bytes() != 0 {
            assert!(std::time::Instant::now() < deadline, "{kind:?}: buffers never came back");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let (back, r) = fx
            .array
            .submit_read(&m, 0..8 * MIB, p.alloc(8 * MIB as usize).unwrap())
            .unwrap()
            .wait();
        r.unwrap();
        assert!(back[..] == pattern(8 * MIB as usize, 5)[..], "{kind:?}: the dropped write landed");
    }
}

#[test]
fn ticket_reports_completion() {
    for kind in all() {
        let fx = open(kind, 1, 8 * MIB, 4);
        let p = pool(8 * MIB);
        let t = fx.array.write_at(0, 0, p.alloc(MIB as usize).unwrap()).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while !t.is_done() {
            assert!(std::time::Instant::now() < deadline, "{kind:?}: never completed");
            std::thread::yield_now();
        }
        assert!(t.completed_at().is_some());
        let (b, r) = t.wait();
        r.unwrap();
        assert_eq!(b.len(), MIB as usize);
    }
}

#[test]
fn dropping_the_array_with_io_in_flight_completes_it() {
    for kind in all() {
        let fx = open(kind, 2, 16 * MIB, 8);
        let p = pool(32 * MIB);
        let tickets: Vec<_> = (0..16)
            .map(|i| {
                fx.array
                    .write_at(i % 2, u64::from(i / 2) * MIB, p.alloc(MIB as usize).unwrap())
                    .unwrap()
            })
            .collect();
        let io_common::Fixture { array, sims, dir, .. } = fx;
        drop(array);
        for t in tickets {
            assert!(t.is_done(), "{kind:?}: the array waited for its requests");
            t.wait().1.unwrap();
        }
        drop((sims, dir));
    }
}

#[test]
fn completion_signal_counts_every_ticket() {
    for kind in all() {
        let fx = open(kind, 2, 8 * MIB, 8);
        let p = pool(16 * MIB);
        let signal = teraio_engine::array::CompletionSignal::new();
        let tickets: Vec<_> = (0..10u64)
            .map(|i| {
                let t = fx
                    .array
                    .write_at((i % 2) as u32, (i / 2) * 65536, p.alloc(65536).unwrap())
                    .unwrap();
                t.notify_on_completion(&signal);
                t
            })
            .collect();
        let mut seen = 0;
        while seen < 10 {
            seen = signal.wait_beyond(seen);
        }
        assert_eq!(signal.count(), 10, "{kind:?}: one signal per ticket");
        assert!(tickets.iter().all(|t| t.is_done()));
        // A ticket that already completed signals at once.
        let t = tickets.into_iter().next().unwrap();
        t.notify_on_completion(&signal);
        assert_eq!(signal.count(), 11);
    }
}

#[test]
fn ordinary_page_buffers_use_the_scattered_request_limit() {
    for kind in all() {
        let fx = open(kind, 2, 16 * MIB, 8);
        let a = &fx.array;
        assert!(
            a.max_io_scattered_bytes().is_power_of_two()
                || a.max_io_scattered_bytes() == a.max_io_bytes()
        );
        assert!(a.max_io_scattered_bytes() <= a.max_io_bytes());
        let p = teraio_engine::pool::BufferPool::new(teraio_engine::pool::PoolConfig {
            capacity_bytes: 16 * MIB,
            prefer_huge_pages: false,
        })
        .unwrap();
        assert_eq!(p.backing(), teraio_engine::pool::PageBacking::Normal);
        let size = 3 * MIB + 4096;
        let m = map(size, MIB, 2, 0, 0);
        let data = pattern(size as usize, 8);
        let mut b = p.alloc(size as usize).unwrap();
        b.copy_from_slice(&data);
        a.submit_write(&m, 0..size, b).unwrap().wait().1.unwrap();
        let (back, r) = a.submit_read(&m, 0..size, p.alloc(size as usize).unwrap()).unwrap().wait();
        r.unwrap();
        assert!(back[..] == data[..], "{kind:?}");
        if let [d0, d1] = &fx.sims[..] {
            // Units 0 and 2 (2 MiB) on device 0, unit 1 and the 4 KiB tail on device 1, in
            // requests of at most the scattered limit.
            let lim = a.max_io_scattered_bytes();
            assert_eq!(d0.stats().writes, (2 * MIB).div_ceil(lim), "{kind:?}");
            assert_eq!(d1.stats().writes, MIB.div_ceil(lim) + 1, "{kind:?}");
        }
    }
}
