//! GPUDirect Storage: a thin layer of our own over `cudarc::cufile::sys`. cudarc's `safe`
//! module is not used (its buffer registration passes an element count as bytes, its async
//! calls point at stack values, its Drop unwraps), nor `result::read`/`write` (they transmute
//! any negative return into an enum).
//!
//! One cuFile handle per array device, opened O_DIRECT on the device's path; calls are
//! blocking and thread-safe, the store issues many at once (`store::gpu`). The CUDA context
//! exists (and is current) before cuFileDriverOpen, which cuFile needs.

use std::ffi::{CString, c_void};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use cudarc::cufile::sys as cf;

use super::{CudaDevice, CudaMem};
use crate::tier::{DeviceMemory, DirectMode, DirectStorage};
use crate::{Error, Result};

struct FileHandle {
    path: PathBuf,
    handle: cf::CUfileHandle_t,
    _fd: OwnedFd,
}

/// cuFile on the array's devices.
pub struct GdsIo {
    device: Arc<CudaDevice>,
    files: Vec<FileHandle>,
    mode: DirectMode,
}

// SAFETY: cuFile handles may be used from any thread (cuFile's API is thread-safe); the fds are
// owned and only closed in Drop.
unsafe impl Send for GdsIo {}
// SAFETY: as above.
unsafe impl Sync for GdsIo {}

/// How cuFile reaches the disk on this machine: peer to peer when the nvidia-fs kernel module
/// is loaded (and compatibility mode is not forced), its POSIX compatibility mode otherwise.
pub fn cufile_mode() -> DirectMode {
    let forced = std::env::var("CUFILE_FORCE_COMPAT_MODE").is_ok_and(|v| v == "true");
    if Path::new("/proc/driver/nvidia-fs").exists() && !forced {
        DirectMode::P2p
    } else {
        DirectMode::Compat
    }
}

fn driver_open(device: &CudaDevice) -> Result<()> {
    static OPEN: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    OPEN.get_or_init(|| {
        if !super::cufile_present() {
            return Err("libcufile.so is not installed or not on the loader path (it ships \
                        with the CUDA toolkit and the nvidia-cufile wheels)"
                .into());
        }
        // The CUDA context must exist and be current before cuFileDriverOpen.
        device.bind().map_err(|e| e.to_string())?;
        // SAFETY: the library is present; no preconditions beyond the context.
        let r = std::panic::catch_unwind(|| unsafe { cf::cuFileDriverOpen() })
            .map_err(|_| "libcufile.so lacks cuFileDriverOpen".to_string())?;
        if r.err != cf::CUfileOpError::CU_FILE_SUCCESS {
            return Err(format!("cuFileDriverOpen failed: {:?} (CUDA {:?})", r.err, r.cu_err));
        }
        Ok(())
    })
    .clone()
    .map_err(Error::Unsupported)
}

impl GdsIo {
    /// Open cuFile (once per process) and a handle on every path.
    pub fn open(device: Arc<CudaDevice>, paths: &[PathBuf]) -> Result<GdsIo> {
        driver_open(&device)?;
        let mut files = Vec::with_capacity(paths.len());
        for path in paths {
            let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| {
                Error::InvalidArgument(format!("{} has a NUL byte", path.display()))
            })?;
            // SAFETY: a NUL-terminated path; the fd is owned below.
            let fd =
                unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_DIRECT | libc::O_CLOEXEC) };
            if fd < 0 {
                return Err(Error::Os {
                    context: format!("opening {} O_DIRECT for cuFile", path.display()),
                    source: std::io::Error::last_os_error(),
                });
            }
            // SAFETY: a fresh fd nobody else owns.
            let owned = unsafe { OwnedFd::from_raw_fd(fd) };
            let mut descr = cf::CUfileDescr_t {
                type_: cf::CUfileFileHandleType::CU_FILE_HANDLE_TYPE_OPAQUE_FD,
                handle: cf::CUfileDescr_t__bindgen_ty_1 { fd },
                fs_ops: std::ptr::null(),
            };
            let mut handle: cf::CUfileHandle_t = std::ptr::null_mut();
            // SAFETY: valid out pointer and descriptor of an open O_DIRECT fd.
            let r = unsafe { cf::cuFileHandleRegister(&mut handle, &mut descr) };
            if r.err != cf::CUfileOpError::CU_FILE_SUCCESS {
                return Err(Error::Unsupported(format!(
                    "cuFileHandleRegister({}) failed: {:?} (CUDA {:?}); on a VM without a udev \
                     database cuFile cannot classify the disk (docs/BENCHMARKS.md, GPU section, \
                     has the one-line fix)",
                    path.display(),
                    r.err,
                    r.cu_err
                )));
            }
            files.push(FileHandle { path: path.clone(), handle, _fd: owned });
        }
        Ok(GdsIo { device, files, mode: cufile_mode() })
    }

    fn file(&self, file: u32) -> Result<&FileHandle> {
        self.files.get(file as usize).ok_or_else(|| {
            Error::InvalidArgument(format!("device {file} of {} for cuFile", self.files.len()))
        })
    }

    fn fail(&self, op: &'static str, file: u32, r: isize) -> Error {
        let f = &self.files[file as usize];
        if r == -1 {
            Error::Io {
                device: file,
                path: f.path.clone(),
                source: std::io::Error::last_os_error(),
            }
        } else {
            Error::Cuda(format!("cuFile{op} on {}: cuFile error {}", f.path.display(), -r))
        }
    }
}

impl Drop for GdsIo {
    fn drop(&mut self) {
        for f in &self.files {
            // SAFETY: registered in `open`, deregistered once; no I/O is in flight (the store's
            // threads are joined before the GdsIo is dropped).
            unsafe { cf::cuFileHandleDeregister(f.handle) };
        }
    }
}

impl DirectStorage for GdsIo {
    fn mode(&self) -> DirectMode {
        self.mode
    }

    fn bind_thread(&self) -> Result<()> {
        self.device.bind()
    }

    fn prepare(&self, mem: &dyn DeviceMemory) {
        if let Some(m) = mem.as_any().downcast_ref::<CudaMem>() {
            self.device.cufile_register(m.device_ptr(), m.registered_len());
        }
    }

    unsafe fn write(
        &self,
        file: u32,
        base: u64,
        buf_offset: u64,
        len: usize,
        offset: u64,
    ) -> Result<()> {
        let fh = self.file(file)?.handle;
        let mut done = 0usize;
        while done < len {
            // SAFETY: the caller guarantees the device range; `fh` is a registered handle.
            let r = unsafe {
                cf::cuFileWrite(
                    fh,
                    base as *const c_void,
                    len - done,
                    (offset + done as u64) as cf::off_t,
                    (buf_offset + done as u64) as cf::off_t,
                )
            };
            if r < 0 {
                return Err(self.fail("Write", file, r));
            }
            if r == 0 {
                return Err(Error::ShortTransfer {
                    op: "write",
                    device: file,
                    offset,
                    done: done as u64,
                    len: len as u64,
                });
            }
            done += r as usize;
        }
        Ok(())
    }

    unsafe fn read(
        &self,
        file: u32,
        base: u64,
        buf_offset: u64,
        len: usize,
        offset: u64,
    ) -> Result<()> {
        let fh = self.file(file)?.handle;
        let mut done = 0usize;
        while done < len {
            // SAFETY: the caller guarantees the device range; `fh` is a registered handle.
            let r = unsafe {
                cf::cuFileRead(
                    fh,
                    base as *mut c_void,
                    len - done,
                    (offset + done as u64) as cf::off_t,
                    (buf_offset + done as u64) as cf::off_t,
                )
            };
            if r < 0 {
                return Err(self.fail("Read", file, r));
            }
            if r == 0 {
                return Err(Error::ShortTransfer {
                    op: "read",
                    device: file,
                    offset,
                    done: done as u64,
                    len: len as u64,
                });
            }
            done += r as usize;
        }
        Ok(())
    }
}
