//! Opening one target (a regular file or a raw block device): O_DIRECT, logical block size,
//! capacity, I/O size limits from sysfs, and the overwrite guard that recognises partition
//! tables, filesystems, volume managers and other teraio arrays.

use std::fs::OpenOptions;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::{Error, Result};

/// First 8 bytes (little-endian) of a teraio superblock at device offset 0 ("TERAIOSB").
pub const TERAIO_SUPERBLOCK_MAGIC: u64 = teraio_layout::format::SUPERBLOCK_MAGIC;

/// Bytes read from the start of a target to look for signatures (covers btrfs at 64 KiB).
pub const PROBE_BYTES: usize = 128 << 10;

/// Largest single I/O the engine issues when sysfs says nothing (and the cap on what it says).
pub const DEFAULT_MAX_IO_BYTES: u64 = 4 << 20;

/// What a target is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetKind {
    /// A regular file on some filesystem.
    File,
    /// A raw block device.
    BlockDevice,
}

/// An opened file or block device.
#[derive(Debug)]
pub struct OpenedDevice {
    /// The path it was opened from.
    pub path: PathBuf,
    /// File or block device.
    pub kind: TargetKind,
    /// The O_DIRECT descriptor (shared with the backend threads).
    pub fd: Arc<OwnedFd>,
    /// Whether O_DIRECT is in effect (false only where the filesystem refuses it).
    pub direct: bool,
    /// Logical block size: the alignment of offsets, lengths and buffers.
    pub block_bytes: u32,
    /// Usable capacity (rounded down to the block size).
    pub capacity_bytes: u64,
    /// Largest request the device takes whole (sysfs `max_sectors_kb`).
    pub max_io_bytes: u64,
    /// Memory segments one request may have (sysfs `max_segments`), when known.
    pub max_segments: Option<u32>,
    /// For a file: a second descriptor holding the exclusive `flock` that keeps other arrays
    /// off it; keep it as long as the array uses the file. (Not the I/O descriptor: io_uring
    /// keeps a registered file open until its ring is torn down, asynchronously, after close.)
    pub lock: Option<OwnedFd>,
}

fn os_err(context: String, source: std::io::Error) -> Error {
    Error::Os { context, source }
}

/// What the first bytes of a target hold, if they look like anything we must not overwrite.
///
/// Recognises a teraio superblock, MBR/GPT partition tables, ext2/3/4, XFS, btrfs, LVM2,
/// Linux md RAID (1.1/1.2), LUKS, swap, NTFS, FAT and ISO 9660. `head` may be shorter than
/// [`PROBE_BYTES`] (a small file); missing bytes count as zeros. Never panics.
pub fn detect_signature(head: &[u8]) -> Option<String> {
    let at = |off: usize, sig: &[u8]| head.get(off..off + sig.len()) == Some(sig);
    let u64_at =
        |off: usize| head.get(off..off + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap()));
    if u64_at(0) == Some(TERAIO_SUPERBLOCK_MAGIC) {
        return Some("a teraio array superblock".into());
    }
    if at(0x438, &[0x53, 0xEF]) {
        return Some("an ext2/3/4 filesystem (magic 0xEF53 at byte 1080)".into());
    }
    if at(0, b"XFSB") {
        return Some("an XFS filesystem".into());
    }
    if at(0x10040, b"_BHRfS_M") {
        return Some("a btrfs filesystem".into());
    }
    for sector in [512usize, 1024, 1536] {
        if at(sector, b"LABELONE") && at(sector + 24, b"LVM2") {
            return Some("an LVM2 physical volume".into());
        }
    }
    let md_magic = 0xa92b_4efcu32.to_le_bytes();
    if at(0, &md_magic) || at(4096, &md_magic) {
        return Some("a Linux md RAID member (superblock 1.x)".into());
    }
    if at(0, b"LUKS\xba\xbe") {
        return Some("a LUKS encrypted volume".into());
    }
    if at(4096 - 10, b"SWAPSPACE2") || at(4096 - 10, b"SWAP-SPACE") {
        return Some("a swap area".into());
    }
    if at(3, b"NTFS    ") {
        return Some("an NTFS filesystem".into());
    }
    if at(54, b"FAT") || at(82, b"FAT32") {
        return Some("a FAT filesystem".into());
    }
    if at(0x8001, b"CD001") {
        return Some("an ISO 9660 filesystem".into());
    }
    if at(512, b"EFI PART") || at(4096, b"EFI PART") {
        return Some("a GPT partition table".into());
    }
    if at(510, &[0x55, 0xAA]) {
        return Some("an MBR partition table (boot signature 0x55AA at byte 510)".into());
    }
    None
}

/// Read up to [`PROBE_BYTES`] from the start of `path` through the page cache.
pub fn read_head(path: &Path) -> Result<Vec<u8>> {
    let mut f = std::fs::File::open(path)
        .map_err(|e| os_err(format!("opening {} to check what it holds", path.display()), e))?;
    let mut head = Vec::with_capacity(PROBE_BYTES);
    (&mut f)
        .take(PROBE_BYTES as u64)
        .read_to_end(&mut head)
        .map_err(|e| os_err(format!("reading the start of {}", path.display()), e))?;
    Ok(head)
}

/// sysfs queue limits of the block device behind `dev` (a partition maps to its disk).
fn queue_limits(dev: libc::dev_t) -> (Option<u64>, Option<u32>) {
    // SAFETY: major/minor are pure arithmetic on a dev_t.
    let (maj, min) = (libc::major(dev), libc::minor(dev));
    let base = PathBuf::from(format!("/sys/dev/block/{maj}:{min}"));
    let queue =
        if base.join("queue").exists() { base.join("queue") } else { base.join("../queue") };
    let read = |name: &str| -> Option<u64> {
        std::fs::read_to_string(queue.join(name)).ok()?.trim().parse().ok()
    };
    (read("max_sectors_kb").map(|kb| kb * 1024), read("max_segments").map(|s| s as u32))
}

/// statx DIO alignment of an open descriptor (Linux 6.1+), if reported.
fn dio_alignment(fd: i32) -> Option<u32> {
    // SAFETY: an all-zero statx is a valid value to be filled in.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let empty = c"";
    // SAFETY: `stx` is a valid out-pointer, the path is an empty C string with AT_EMPTY_PATH.
    let rc = unsafe {
        libc::statx(fd, empty.as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, &mut stx)
    };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 || stx.stx_dio_offset_align == 0 {
        return None;
    }
    Some(stx.stx_dio_offset_align.max(stx.stx_dio_mem_align))
}

/// Open (creating if needed) one target for O_DIRECT I/O.
///
/// Files are created with mode 0600 and, when `file_size_bytes > 0`, extended to that size
/// with `fallocate` (never shrunk) and locked (`flock(LOCK_EX)`, held while the descriptor is
/// open), so two arrays (two teraio processes started in the same folder, say) never write the
/// same file: the second is refused. Block devices are opened with O_EXCL (refused while
/// mounted or held by another exclusive user). The overwrite guard is not applied here; see
/// [`detect_signature`].
///
/// A file this call created is removed again when the call fails (no space to preallocate, not
/// a file it can use); a file that existed is left as it was found, but for its size.
pub fn open_path(path: &Path, file_size_bytes: u64) -> Result<OpenedDevice> {
    let meta = std::fs::metadata(path);
    let created = meta.is_err();
    let opened = open_path_inner(path, file_size_bytes, meta);
    if opened.is_err() && created {
        let _ = std::fs::remove_file(path);
    }
    opened
}

fn open_path_inner(
    path: &Path,
    file_size_bytes: u64,
    meta: std::io::Result<std::fs::Metadata>,
) -> Result<OpenedDevice> {
    let is_block = matches!(&meta, Ok(m) if m.file_type().is_block_device());
    let open = |direct: bool| {
        let mut o = OpenOptions::new();
        o.read(true).write(true);
        let mut flags = libc::O_CLOEXEC;
        if direct {
            flags |= libc::O_DIRECT;
        }
        if is_block {
            flags |= libc::O_EXCL;
        } else {
            o.create(true).mode(0o600);
        }
        o.custom_flags(flags).open(path)
    };
    let (file, direct) = match open(true) {
        Ok(f) => (f, true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) && !is_block => {
            crate::notice::info(format!(
                "{} does not support O_DIRECT; using buffered I/O",
                path.display()
            ));
            (open(false).map_err(|e| os_err(format!("opening {}", path.display()), e))?, false)
        }
        Err(e) if is_block && e.raw_os_error() == Some(libc::EBUSY) => {
            return Err(Error::OverwriteRefused {
                path: path.to_path_buf(),
                found: "a device in use (mounted, or held open exclusively by another program)"
                    .into(),
            });
        }
        Err(e) => return Err(os_err(format!("opening {}", path.display()), e)),
    };
    let fd = file.as_raw_fd();
    let lock = if is_block { None } else { Some(lock_file(path)?) };
    let meta = file.metadata().map_err(|e| os_err(format!("stat of {}", path.display()), e))?;
    let kind = if is_block { TargetKind::BlockDevice } else { TargetKind::File };
    if kind == TargetKind::File && !meta.file_type().is_file() {
        return Err(Error::InvalidArgument(format!(
            "{} is neither a regular file nor a block device",
            path.display()
        )));
    }
    let mut block_bytes = 0u32;
    if is_block {
        let mut ssz: libc::c_int = 0;
        // SAFETY: BLKSSZGET writes one int through a valid pointer.
        if unsafe { libc::ioctl(fd, libc::BLKSSZGET, &mut ssz) } == 0 && ssz > 0 {
            block_bytes = ssz as u32;
        }
    }
    if block_bytes == 0 {
        block_bytes = dio_alignment(fd).unwrap_or(teraio_layout::geometry::DEFAULT_BLOCK_BYTES);
    }
    if !block_bytes.is_power_of_two() || block_bytes < 512 {
        block_bytes = teraio_layout::geometry::DEFAULT_BLOCK_BYTES;
    }
    let capacity_bytes = if is_block {
        // SAFETY: lseek on a descriptor we own.
        let end = unsafe { libc::lseek(fd, 0, libc::SEEK_END) };
        if end < 0 {
            return Err(os_err(
                format!("size of {}", path.display()),
                std::io::Error::last_os_error(),
            ));
        }
        end as u64
    } else {
        if file_size_bytes > meta.len() {
            // SAFETY: fallocate on a descriptor we own; no memory is involved.
            let rc = unsafe { libc::fallocate(fd, 0, 0, file_size_bytes as libc::off_t) };
            if rc != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::ENOSPC) {
                    // A partial preallocation is given back (a file this call created is
                    // removed by the caller).
                    let _ = file.set_len(meta.len());
                    let folder = path.parent().unwrap_or(Path::new("."));
                    let free = free_bytes(folder).map_or_else(
                        |_| "unknown".to_string(),
                        |f| format!("{f} bytes ({})", crate::units::display_size(f)),
                    );
                    return Err(Error::NoSpace(format!(
                        "cannot preallocate {file_size_bytes} bytes ({}) for {}: its filesystem \
                         has {free} free; lower file_size (--file-size) or put the array on a \
                         disk with room",
                        crate::units::display_size(file_size_bytes),
                        path.display()
                    )));
                }
                // Filesystems without fallocate: extend with a sparse ftruncate.
                file.set_len(file_size_bytes)
                    .map_err(|e| os_err(format!("extending {}", path.display()), e))?;
            }
        }
        file.metadata().map_err(|e| os_err(format!("stat of {}", path.display()), e))?.len()
    };
    let capacity_bytes = capacity_bytes / u64::from(block_bytes) * u64::from(block_bytes);
    let dev = if is_block { meta.rdev() } else { meta.dev() };
    let (max_sectors, max_segments) = queue_limits(dev);
    let max_io_bytes = max_sectors
        .unwrap_or(DEFAULT_MAX_IO_BYTES)
        .clamp(u64::from(block_bytes), DEFAULT_MAX_IO_BYTES);
    let max_io_bytes = max_io_bytes / u64::from(block_bytes) * u64::from(block_bytes);
    Ok(OpenedDevice {
        path: path.to_path_buf(),
        kind,
        fd: Arc::new(OwnedFd::from(file)),
        direct,
        block_bytes,
        capacity_bytes,
        max_io_bytes,
        max_segments,
        lock,
    })
}

/// Bytes an unprivileged process may still allocate on the filesystem holding `path` (an
/// existing file or folder): statvfs's `f_bavail * f_frsize`.
pub fn free_bytes(path: &Path) -> Result<u64> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| Error::InvalidArgument(format!("{} contains a NUL byte", path.display())))?;
    // SAFETY: an all-zero statvfs is a valid value to be filled in.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid out-pointer.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(os_err(
            format!("free space of the filesystem holding {}", path.display()),
            std::io::Error::last_os_error(),
        ));
    }
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Take the exclusive lock that keeps a second array off the file at `path`.
fn lock_file(path: &Path) -> Result<OwnedFd> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| os_err(format!("opening {} to lock it", path.display()), e))?;
    // A lock released a moment ago can still be held by a child that another thread of this
    // process forked while the old descriptor was open: the child shares it until it execs
    // (O_CLOEXEC closes it then). Such a holder goes within milliseconds; an array that is
    // really open elsewhere does not, so a short bounded retry tells the two apart.
    let deadline = std::time::Instant::now() + LOCK_RETRY;
    let mut pause = std::time::Duration::from_millis(1);
    loop {
        // SAFETY: flock takes no pointers; the descriptor is the one just opened.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(OwnedFd::from(f));
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) && std::time::Instant::now() < deadline {
            std::thread::sleep(pause);
            pause = (pause * 2).min(std::time::Duration::from_millis(20));
            continue;
        }
        let why = if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            format!(
                "locking {}: it is in use by another array (another teraio process, or one still \
                 open in this process)",
                path.display()
            )
        } else {
            format!("locking {}", path.display())
        };
        return Err(os_err(why, e));
    }
}

/// How long [`lock_file`] waits for a lock held by a forked child that has not yet exec'd.
const LOCK_RETRY: std::time::Duration = std::time::Duration::from_millis(200);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeros_hold_nothing() {
        assert_eq!(detect_signature(&vec![0; PROBE_BYTES]), None);
        assert_eq!(detect_signature(&[]), None);
        assert_eq!(detect_signature(&[1, 2, 3]), None);
    }

    #[test]
    fn recognises_signatures() {
        let mut h = vec![0u8; PROBE_BYTES];
        h[0x438] = 0x53;
        h[0x439] = 0xEF;
        assert!(detect_signature(&h).unwrap().contains("ext2/3/4"));
        let mut h = vec![0u8; PROBE_BYTES];
        h[..8].copy_from_slice(&TERAIO_SUPERBLOCK_MAGIC.to_le_bytes());
        assert!(detect_signature(&h).unwrap().contains("teraio"));
        let mut h = vec![0u8; PROBE_BYTES];
        h[512..520].copy_from_slice(b"EFI PART");
        h[510] = 0x55;
        h[511] = 0xAA;
        assert!(detect_signature(&h).unwrap().contains("GPT"));
        let mut h = vec![0u8; 4096];
        h[510] = 0x55;
        h[511] = 0xAA;
        assert!(detect_signature(&h).unwrap().contains("MBR"));
        let mut h = vec![0u8; PROBE_BYTES];
        h[0x10040..0x10048].copy_from_slice(b"_BHRfS_M");
        assert!(detect_signature(&h).unwrap().contains("btrfs"));
    }

    #[test]
    fn opens_a_file_with_mode_0600_and_preallocates() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dev0");
        let d = open_path(&p, 8 << 20).unwrap();
        assert_eq!(d.kind, TargetKind::File);
        assert_eq!(d.capacity_bytes, 8 << 20);
        assert!(d.block_bytes.is_power_of_two() && d.block_bytes >= 512);
        assert!(d.max_io_bytes >= u64::from(d.block_bytes));
        let mode = std::fs::metadata(&p).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let blocks = std::fs::metadata(&p).unwrap().blocks();
        assert!(blocks * 512 >= 8 << 20, "fallocate reserved the space ({blocks} blocks)");
    }

    /// A small tmpfs mounted for one test, unmounted when dropped.
    struct SmallFs(tempfile::TempDir);

    impl SmallFs {
        /// `None` (and why) where this process may not mount (not root, no mount namespace).
        fn mount(size: &str) -> Result<SmallFs, String> {
            let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
            let out = std::process::Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
                .arg(dir.path())
                .output()
                .map_err(|e| format!("running mount: {e}"))?;
            if !out.status.success() {
                return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
            }
            Ok(SmallFs(dir))
        }
    }

    impl Drop for SmallFs {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(self.0.path()).status();
        }
    }

    #[test]
    fn no_space_to_preallocate_leaves_no_file_behind_and_names_the_sizes() {
        let fs = match SmallFs::mount("16m") {
            Ok(fs) => fs,
            Err(why) => {
                // A mount needs root; the engine's tests of the free-space check run anywhere.
                eprintln!("skipped: cannot mount a 16 MiB tmpfs here ({why})");
                return;
            }
        };
        let p = fs.0.path().join("dev0");
        let e = open_path(&p, 64 << 20).unwrap_err();
        assert!(matches!(e, Error::NoSpace(_)), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("dev0") && e.contains(&(64u64 << 20).to_string()), "{e}");
        assert!(e.contains("free") && e.contains("file_size"), "{e}");
        assert!(!p.exists(), "the file it created is removed");
        // A file that was there keeps its size and gives back what was preallocated.
        std::fs::write(&p, vec![1u8; 1 << 20]).unwrap();
        assert!(open_path(&p, 64 << 20).is_err());
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 1 << 20);
        assert!(free_bytes(fs.0.path()).unwrap() >= 14 << 20, "the partial allocation is freed");
    }

    #[test]
    fn a_file_open_in_one_array_is_refused_to_another() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dev0");
        let first = open_path(&p, 1 << 20).unwrap();
        let e = open_path(&p, 1 << 20).unwrap_err();
        assert!(e.to_string().contains("in use by another array"), "{e}");
        drop(first);
        open_path(&p, 1 << 20).expect("the lock goes with the descriptor");
    }

    #[test]
    fn a_lock_held_by_a_forked_child_for_a_moment_does_not_refuse_the_file() {
        // What CI saw: another test's `Command` forked while the first array was open, so the
        // child shared the locked descriptor until it exec'd and the reopen was refused.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dev0");
        let first = open_path(&p, 1 << 20).unwrap();
        // SAFETY: the child calls only async-signal-safe functions (usleep, _exit).
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork: {}", std::io::Error::last_os_error());
        if child == 0 {
            // SAFETY: as above; the child holds the inherited descriptors for 50 ms and exits.
            unsafe {
                libc::usleep(50_000);
                libc::_exit(0);
            }
        }
        drop(first);
        let reopened = open_path(&p, 1 << 20);
        let mut status = 0;
        // SAFETY: `child` is this process's child; `status` is a valid out-pointer.
        unsafe { libc::waitpid(child, &mut status, 0) };
        reopened.expect("a lock the child held for a moment is taken once the child is gone");
    }
}
