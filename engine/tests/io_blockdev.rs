//! Raw block devices: a loop device stands in for an NVMe drive. Needs root and `losetup`;
//! where they are missing the test says so and checks nothing else.

mod io_common;

use std::path::{Path, PathBuf};
use std::process::Command;

use io_common::{pattern, pool};
use teraio_engine::Error;
use teraio_engine::array::{ArrayConfig, DeviceArray, ExistingData, Target};

struct Loop(PathBuf);

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
    }
}

fn attach(file: &Path) -> Option<Loop> {
    let out = Command::new("losetup").args(["-f", "--show"]).arg(file).output().ok()?;
    if !out.status.success() {
        eprintln!("skipped: losetup failed: {}", String::from_utf8_lossy(&out.stderr).trim());
        return None;
    }
    Some(Loop(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())))
}

#[test]
fn loop_device_guard_block_size_and_round_trip() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let backing = dir.path().join("disk.img");
    let f = std::fs::File::create(&backing).unwrap();
    f.set_len(16 << 20).unwrap();
    drop(f);
    // An ext4 superblock magic at byte 1080, as mkfs.ext4 leaves it.
    std::fs::write(&backing, {
        let mut head = vec![0u8; 4096];
        head[1080] = 0x53;
        head[1081] = 0xEF;
        head
    })
    .unwrap();
    std::fs::File::options().write(true).open(&backing).unwrap().set_len(16 << 20).unwrap();
    let Some(dev) = attach(&backing) else {
        eprintln!("skipped: no loop device available (needs root and losetup)");
        return;
    };
    let cfg = |existing| {
        let mut c = ArrayConfig::new(vec![Target::Path(dev.0.clone())]);
        c.existing = existing;
        c
    };
    match DeviceArray::open(cfg(ExistingData::Refuse)) {
        Err(Error::OverwriteRefused { found, path }) => {
            assert_eq!(path, dev.0);
            assert!(found.contains("ext2/3/4"), "{found}");
        }
        other => panic!("expected the guard to refuse {}: {other:?}", dev.0.display()),
    }
    let array = DeviceArray::open(cfg(ExistingData::AllowAnything)).unwrap();
    assert_eq!(array.device_capacity(0), 16 << 20);
    let block = array.geometry().block_bytes;
    assert!(block.is_power_of_two() && block >= 512, "logical block {block}");
    let p = pool(8 << 20);
    let data = pattern(1 << 20, 42);
    let mut buf = p.alloc(data.len()).unwrap();
    buf.copy_from_slice(&data);
    array.write_at(0, 0, buf).unwrap().wait().1.unwrap();
    array.sync().unwrap();
    let (back, r) = array.read_at(0, 0, p.alloc(1 << 20).unwrap()).unwrap().wait();
    r.unwrap();
    assert!(back[..] == data[..]);
    // Misaligned offsets are refused with a clear error, never a silent EINVAL.
    let e = array.read_at(0, u64::from(block) / 2, p.alloc(4096).unwrap()).unwrap_err();
    assert!(matches!(e, Error::Misaligned { .. }), "{e}");
    drop(array);
    drop(dev);
}
