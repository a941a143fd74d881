//! Panics stop at the boundary, silently: [`catch`] runs a call of a foreign caller and turns
//! a panic into [`Error::Internal`] (the message and where it happened), and a panic hook,
//! installed once, keeps the default hook from printing a message (and a backtrace) on the
//! caller's stderr for panics caught this way. The library never prints; a panic anywhere else
//! (outside a call in [`catch`]) goes to the hook that was installed before (the host
//! program's, or Rust's default).

use std::cell::{Cell, RefCell};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Once;

use crate::{Error, Result};

thread_local! {
    /// How many [`catch`] calls this thread is inside.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
    /// Where the last panic caught on this thread happened (`file:line`).
    static WHERE: RefCell<Option<String>> = const { RefCell::new(None) };
}

static HOOK: Once = Once::new();

/// Install the hook (once per process): silent for panics inside [`catch`], the previous hook
/// for every other.
fn install_hook() {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if DEPTH.with(Cell::get) > 0 {
                let at = info.location().map(|l| format!("{}:{}", l.file(), l.line()));
                WHERE.with(|w| *w.borrow_mut() = at);
            } else {
                previous(info);
            }
        }));
    });
}

/// Leaves the depth as it was however `catch` ends.
struct Depth;

impl Depth {
    fn enter() -> Depth {
        DEPTH.with(|d| d.set(d.get() + 1));
        Depth
    }
}

impl Drop for Depth {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// Run `f` (a call named `name`, e.g. `teraio_offload`); a panic becomes
/// [`Error::Internal`] naming the call, the panic's message and its location, and nothing is
/// printed.
pub fn catch<R>(name: &str, f: impl FnOnce() -> Result<R>) -> Result<R> {
    install_hook();
    let depth = Depth::enter();
    let r = catch_unwind(AssertUnwindSafe(f));
    drop(depth);
    r.unwrap_or_else(|panic| {
        let msg = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".into());
        let at = WHERE.with(|w| w.borrow_mut().take());
        let at = at.map(|a| format!(" (at {a})")).unwrap_or_default();
        Err(Error::Internal(format!("{name}: {msg}{at}")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_internal_error_naming_the_call_and_where() {
        let e = catch("teraio_test", || -> Result<()> { panic!("boom {}", 7) }).unwrap_err();
        assert_eq!(e.status(), crate::Status::Internal);
        let m = e.to_string();
        assert!(m.contains("teraio_test: boom 7") && m.contains("catch.rs:"), "{m}");
        assert_eq!(catch("ok", || Ok(3)).unwrap(), 3);
        // Nested calls and a panic in the inner one: the outer one goes on.
        let r = catch("outer", || {
            let inner = catch("inner", || -> Result<u8> { panic!("inner") });
            assert!(inner.is_err());
            Ok(1)
        });
        assert_eq!(r.unwrap(), 1);
        assert_eq!(DEPTH.with(Cell::get), 0);
    }

    /// Run as a child process (below): a caught panic prints nothing on stderr.
    #[test]
    fn child_panics_inside_catch() {
        if std::env::var_os("TERAIO_CATCH_CHILD").is_none() {
            return;
        }
        let e = catch("teraio_child", || -> Result<()> { panic!("silent panic") }).unwrap_err();
        assert!(e.to_string().contains("silent panic"));
    }

    #[test]
    fn a_caught_panic_prints_nothing_on_stderr() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "catch::tests::child_panics_inside_catch", "--nocapture"])
            .args(["--test-threads", "1"])
            .env("TERAIO_CATCH_CHILD", "1")
            .env("RUST_BACKTRACE", "1")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}\n{stderr}");
        assert!(stdout.contains("1 passed"), "the child ran the test: {stdout}");
        for text in [&stderr, &stdout] {
            assert!(!text.contains("panicked at") && !text.contains("silent panic"), "{text}");
        }
    }
}
