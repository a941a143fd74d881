//! pread/pwrite (`preadv`/`pwritev`) on a pool of threads: the portable backend, chosen when
//! io_uring is not available (old kernel, seccomp) or by configuration.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::Sender;

use super::{Backend, IoDirection, IoFailure, IoRequest, IoVec, advance_iovecs, bad_device};

/// Largest iovec count one `preadv`/`pwritev` call takes (Linux IOV_MAX).
const IOV_MAX: usize = 1024;

/// Backend that runs each request with blocking vectored system calls on one of `threads`
/// worker threads. The number of threads is the queue depth the devices see.
pub struct PsyncBackend {
    files: Vec<Arc<OwnedFd>>,
    tx: Option<Sender<IoRequest>>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for PsyncBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PsyncBackend")
            .field("files", &self.files.len())
            .field("threads", &self.workers.len())
            .finish()
    }
}

impl PsyncBackend {
    /// A backend over open files (request device `i` is `files[i]`) with `threads` workers.
    pub fn new(files: Vec<Arc<OwnedFd>>, threads: usize) -> io::Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<IoRequest>();
        let mut workers = Vec::new();
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            let files = files.clone();
            workers.push(std::thread::Builder::new().name(format!("teraio-psync-{i}")).spawn(
                move || {
                    for req in rx.iter() {
                        run_request(&files, req);
                    }
                },
            )?);
        }
        Ok(Self { files, tx: Some(tx), workers })
    }
}

fn run_request(files: &[Arc<OwnedFd>], req: IoRequest) {
    let Some(fd) = files.get(req.device()).map(|f| f.as_raw_fd()) else {
        let (d, n) = (req.device(), files.len());
        return req.complete(Err(bad_device(d, n)));
    };
    let total = req.len();
    let mut iov: Vec<IoVec> = req.iovecs().to_vec();
    let mut done = 0u64;
    let result = loop {
        if iov.is_empty() {
            break Ok(());
        }
        let n_iov = iov.len().min(IOV_MAX);
        let raw: Vec<libc::iovec> = iov[..n_iov]
            .iter()
            .map(|v| libc::iovec { iov_base: v.ptr.cast(), iov_len: v.len })
            .collect();
        let off = (req.offset() + done) as libc::off_t;
        // SAFETY: the iovecs name memory kept valid until the request completes (contract of
        // IoRequest::new); `raw` lives across the call.
        let rc = unsafe {
            match req.kind() {
                IoDirection::Read => libc::preadv(fd, raw.as_ptr(), n_iov as i32, off),
                IoDirection::Write => libc::pwritev(fd, raw.as_ptr(), n_iov as i32, off),
            }
        };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EAGAIN)) {
                continue;
            }
            break Err(IoFailure::Os(e));
        }
        if rc == 0 {
            break Err(IoFailure::Short { done, len: total });
        }
        done += rc as u64;
        advance_iovecs(&mut iov, rc as usize);
    };
    req.complete(result);
}

impl Backend for PsyncBackend {
    fn name(&self) -> &'static str {
        "psync"
    }

    fn submit(&self, request: IoRequest) {
        let closed = || IoFailure::Os(io::Error::other("psync backend shut down"));
        match &self.tx {
            Some(tx) => {
                if let Err(e) = tx.send(request) {
                    e.0.complete(Err(closed()));
                }
            }
            None => request.complete(Err(closed())),
        }
    }

    fn flush(&self, device: usize) -> io::Result<()> {
        let fd = self.files.get(device).ok_or_else(|| io::Error::other("no such device"))?;
        fdatasync(fd.as_raw_fd())
    }
}

/// fdatasync, retried on EINTR.
pub(crate) fn fdatasync(fd: i32) -> io::Result<()> {
    loop {
        // SAFETY: fdatasync on a descriptor the caller keeps open.
        if unsafe { libc::fdatasync(fd) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

impl Drop for PsyncBackend {
    fn drop(&mut self) {
        self.tx = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
