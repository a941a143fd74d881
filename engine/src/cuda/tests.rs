//! CUDA tests. The first runs everywhere (CI has no GPU: it checks the missing-library path);
//! the others need a GPU and are `#[ignore]`d: `scripts/gpu-check.sh` runs them on the GPU
//! machine with `--ignored`.

use rand::{Rng, SeedableRng};

use super::*;

#[test]
fn without_a_gpu_every_entry_point_is_a_clear_error_not_a_panic() {
    match CudaDevice::open(0) {
        Ok(d) => assert!(device_count() >= 1, "opened {d:?} although no device was counted"),
        Err(Error::Unsupported(m)) => {
            assert_eq!(device_count(), 0);
            assert!(m.contains("libcuda") || m.contains("cuInit"), "{m}");
        }
        Err(e) => panic!("expected Unsupported, got {e}"),
    }
    // An ordinal that does not exist is an error on every machine.
    assert!(CudaDevice::open(4096).is_err());
}

fn gpu() -> Arc<CudaDevice> {
    CudaDevice::open(0).expect("a GPU")
}

fn dev(m: &TensorMem) -> &dyn DeviceMemory {
    m.device().expect("device memory")
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn gpu_crc32c_equals_the_cpu_crc32c_for_random_odd_sizes() {
    let d = gpu();
    let tier = CudaTier::new(d.clone(), 1 << 30).unwrap();
    let total = (64 << 20) + 4096;
    let mut m = tier.alloc(total).unwrap();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    let mut host = vec![0u8; total as usize];
    rng.fill(&mut host[..]);
    m.fill_from_host(&host).unwrap();
    let base = dev(&m).device_ptr();
    let mut cases: Vec<(u64, u64, u64)> = vec![
        (0, 1, 1 << 20),
        (0, 4095, 1 << 20),
        (0, 64 << 20, 1 << 20),
        (3, (5 << 20) + 77, 1 << 20),
        (8, 1_000_003, 65_536),
        (1, 12_345, 4096),
        (0, (64 << 20) - 1, 4 << 20),
    ];
    for _ in 0..20 {
        let shift = rng.gen_range(0..64u64);
        let len = rng.gen_range(1..(32u64 << 20));
        let unit = [4096u64, 65_536, 1 << 20, 777_777][rng.gen_range(0..4)];
        cases.push((shift, len, unit));
    }
    for (shift, len, unit) in cases {
        // SAFETY: inside the live allocation `m` (shift + len <= total).
        let gpu = unsafe { d.crc32c_units(base + shift, len, unit).unwrap() };
        let bytes = &host[shift as usize..(shift + len) as usize];
        let cpu: Vec<u32> = bytes.chunks(unit as usize).map(crc32c::crc32c).collect();
        assert_eq!(gpu, cpu, "{len} bytes at +{shift}, units of {unit}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn the_tier_caches_freed_allocations_and_keeps_its_budget() {
    let tier = CudaTier::new(gpu(), 64 << 20).unwrap();
    let a = tier.alloc(10 << 20).unwrap();
    let ptr = dev(&a).device_ptr();
    drop(a);
    assert_eq!(tier.cached_bytes(), 10 << 20);
    let b = tier.alloc((10 << 20) - 5).unwrap();
    assert_eq!(dev(&b).device_ptr(), ptr, "the freed allocation is reused");
    assert_eq!(tier.driver_calls(), (1, 0), "one cuMemAlloc, no cuMemFree");
    assert!(matches!(tier.alloc(60 << 20), Err(Error::NoSpace(_))));
    drop(b);
    let c = tier.alloc(60 << 20).unwrap();
    assert_eq!(tier.driver_calls(), (2, 1), "the cached 10 MiB was freed to make room");
    drop(c);
    tier.trim();
    assert_eq!(tier.cached_bytes(), 0);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn foreign_pointers_are_checked() {
    let d = gpu();
    let tier = CudaTier::new(d.clone(), 64 << 20).unwrap();
    let m = tier.alloc(1 << 20).unwrap();
    let p = dev(&m).device_ptr();
    assert!(CudaMem::wrap_foreign(&d, p, 1 << 20).is_ok());
    assert!(matches!(CudaMem::wrap_foreign(&d, p + 1, 100), Err(Error::Misaligned { .. })));
    let host = vec![0u8; 4096];
    let e = CudaMem::wrap_foreign(&d, host.as_ptr() as u64 & !15, 64).unwrap_err();
    assert!(e.to_string().contains("not CUDA device memory"), "{e}");
    let e = CudaMem::wrap_foreign(&d, p, (1 << 20) + 4096 * 4).unwrap_err();
    assert!(e.to_string().contains("past their allocation"), "{e}");
    assert!(CudaMem::wrap_foreign(&d, p, 0).is_err());
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine (scripts/gpu-check.sh)"]
fn copies_fences_and_stream_waits() {
    let d = gpu();
    let tier = CudaTier::new(d.clone(), 64 << 20).unwrap();
    let mut m = tier.alloc(3 << 20).unwrap();
    let src: Vec<u8> = (0..3 << 20).map(|i| (i % 251) as u8).collect();
    m.fill_from_host(&src).unwrap();
    let mut back = vec![0u8; 3 << 20];
    m.read_to_host(&mut back).unwrap();
    assert!(back == src);
    let f = d.record_on_stream(0).unwrap();
    f.wait().unwrap();
    assert!(f.is_done());
    f.wait_on_stream(0).unwrap();
}
