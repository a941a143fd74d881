//! The overwrite guard: targets holding a filesystem, a partition table or another teraio
//! array are refused unless the caller allows it, and the error says what was found.

mod io_common;

use std::io::{Seek, SeekFrom, Write};

use teraio_engine::Error;
use teraio_engine::array::{ArrayConfig, DeviceArray, ExistingData, Target};
use teraio_engine::backend::sim::SimDisk;
use teraio_engine::device::TERAIO_SUPERBLOCK_MAGIC;

fn file_with(bytes_at: &[(u64, &[u8])], size: u64) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("dev0");
    let mut f = std::fs::File::create(&path).unwrap();
    f.set_len(size).unwrap();
    for (off, b) in bytes_at {
        f.seek(SeekFrom::Start(*off)).unwrap();
        f.write_all(b).unwrap();
    }
    (dir, path)
}

fn open(
    path: &std::path::Path,
    existing: ExistingData,
) -> teraio_engine::Result<std::sync::Arc<DeviceArray>> {
    let mut c = ArrayConfig::new(vec![Target::Path(path.to_path_buf())]);
    c.existing = existing;
    DeviceArray::open(c)
}

#[test]
fn ext4_signature_is_refused() {
    let (_dir, path) = file_with(&[(1080, &[0x53, 0xEF])], 4 << 20);
    let e = open(&path, ExistingData::Refuse).unwrap_err();
    match &e {
        Error::OverwriteRefused { path: p, found } => {
            assert_eq!(p, &path);
            assert!(found.contains("ext2/3/4"), "{found}");
        }
        other => panic!("expected OverwriteRefused, got {other:?}"),
    }
    assert!(e.to_string().contains("refusing to overwrite"), "{e}");
    assert!(open(&path, ExistingData::AllowTeraio).is_err(), "a filesystem is not ours");
    let array = open(&path, ExistingData::AllowAnything).unwrap();
    assert_eq!(array.device_capacity(0), 4 << 20);
}

#[test]
fn the_same_bytes_elsewhere_are_not_a_signature() {
    let (_dir, path) = file_with(&[(1000, &[0x53, 0xEF])], 4 << 20);
    open(&path, ExistingData::Refuse).unwrap();
}

#[test]
fn another_teraio_array_needs_allow_teraio() {
    assert_eq!(TERAIO_SUPERBLOCK_MAGIC.to_le_bytes(), *b"TERAIOSB");
    let (_dir, path) = file_with(&[(0, b"TERAIOSB")], 4 << 20);
    let e = open(&path, ExistingData::Refuse).unwrap_err();
    assert!(e.to_string().contains("teraio array"), "{e}");
    open(&path, ExistingData::AllowTeraio).unwrap();
}

#[test]
fn partition_table_is_refused() {
    let (_dir, path) = file_with(&[(510, &[0x55, 0xAA]), (512, b"EFI PART")], 1 << 20);
    let e = open(&path, ExistingData::Refuse).unwrap_err();
    assert!(e.to_string().contains("GPT"), "{e}");
}

#[test]
fn sim_disks_are_guarded_too() {
    let d = SimDisk::new(1 << 20, 4096, 1);
    d.poke(0, b"XFSB");
    let mut c = ArrayConfig::new(vec![Target::Sim(d.clone())]);
    let e = DeviceArray::open(c.clone()).unwrap_err();
    assert!(e.to_string().contains("XFS") && e.to_string().contains("sim:0"), "{e}");
    c.existing = ExistingData::AllowAnything;
    DeviceArray::open(c).unwrap();
}

#[test]
fn a_target_listed_twice_is_refused() {
    let (_dir, path) = file_with(&[], 1 << 20);
    let c = ArrayConfig::new(vec![Target::Path(path.clone()), Target::Path(path.clone())]);
    let e = DeviceArray::open(c).unwrap_err();
    assert!(e.to_string().contains("listed twice"), "{e}");
}

#[test]
fn new_files_are_created_and_preallocated() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("fresh");
    let mut c = ArrayConfig::new(vec![Target::Path(path.clone())]);
    c.file_size_bytes = 8 << 20;
    let array = DeviceArray::open(c).unwrap();
    assert_eq!(array.device_capacity(0), 8 << 20);
    assert_eq!(array.device_name(0), path.display().to_string());
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
}
