//! The boundary itself: every entry point runs inside [`guard`] (a panic becomes
//! `TERAIO_ERR_INTERNAL`, never an unwind into C), errors become a status code plus the
//! thread-local last-error message, and C strings and out-parameters are checked here.

use std::cell::RefCell;
use std::collections::HashSet;
use std::ffi::{CStr, CString, c_char};

use parking_lot::Mutex;
use teraio_bindings_core::{Error, Result, Status};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Record `e` as this thread's last error; its status code.
pub(crate) fn fail(e: &Error) -> i32 {
    let text = e.to_string().replace('\0', " ");
    let c = CString::new(text).expect("NUL bytes were replaced");
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
    e.status().code()
}

/// This thread's last error message (valid until the next failing call on this thread).
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

/// Run one entry point: its result as a status, panics caught (and not printed: see
/// [`teraio_bindings_core::catch`]).
pub(crate) fn guard(name: &str, f: impl FnOnce() -> Result<Status>) -> i32 {
    match teraio_bindings_core::catch(name, f) {
        Ok(s) => s.code(),
        Err(e) => fail(&e),
    }
}

/// A required C string argument, as UTF-8.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string that lives for the call.
pub(crate) unsafe fn arg_str<'a>(p: *const c_char, what: &str) -> Result<&'a str> {
    if p.is_null() {
        return Err(Error::InvalidArgument(format!("`{what}` is NULL")));
    }
    // SAFETY: non-null, and the caller guarantees a NUL-terminated string alive for the call.
    let c = unsafe { CStr::from_ptr(p) };
    c.to_str().map_err(|_| Error::InvalidArgument(format!("`{what}` is not valid UTF-8")))
}

/// An optional C string argument (NULL: `None`).
///
/// # Safety
/// As [`arg_str`].
pub(crate) unsafe fn opt_str<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: forwarded contract.
    unsafe { arg_str(p, what) }.map(Some)
}

/// Write an out-parameter.
///
/// # Safety
/// `out` is null or valid for a write of `T` (any alignment: a misaligned pointer is written
/// byte-wise, never undefined behaviour).
pub(crate) unsafe fn put<T>(out: *mut T, what: &str, value: T) -> Result<()> {
    if out.is_null() {
        return Err(Error::InvalidArgument(format!("`{what}` (the result pointer) is NULL")));
    }
    // SAFETY: non-null; the caller guarantees it is valid for a write of T; write_unaligned
    // needs no alignment.
    unsafe { out.write_unaligned(value) };
    Ok(())
}

/// Check an out-parameter before doing work whose result would be lost without it.
pub(crate) fn need<T>(out: *mut T, what: &str) -> Result<()> {
    if out.is_null() {
        Err(Error::InvalidArgument(format!("`{what}` (the result pointer) is NULL")))
    } else {
        Ok(())
    }
}

/// Strings handed to C, so `teraio_string_free` refuses anything else (and double frees).
static STRINGS: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

/// Hand `text` to C through `out` (freed with `teraio_string_free`).
///
/// # Safety
/// As [`put`].
pub(crate) unsafe fn put_string(out: *mut *mut c_char, what: &str, text: String) -> Result<()> {
    need(out, what)?;
    let c = CString::new(text.replace('\0', " ")).expect("NUL bytes were replaced");
    let p = c.into_raw();
    STRINGS.lock().get_or_insert_with(HashSet::new).insert(p as usize);
    // SAFETY: checked non-null above; the caller guarantees validity.
    unsafe { put(out, what, p) }
}

/// Take back a string handed out by [`put_string`].
pub(crate) fn free_string(p: *mut c_char) -> Result<()> {
    if p.is_null() {
        return Ok(());
    }
    let known = STRINGS.lock().as_mut().is_some_and(|s| s.remove(&(p as usize)));
    if !known {
        return Err(Error::InvalidHandle(format!(
            "{p:p} is not a string returned by teraio (or was already freed)"
        )));
    }
    // SAFETY: `p` came from CString::into_raw in put_string and was not freed since (it was
    // still registered, and is unregistered now, so this happens once).
    drop(unsafe { CString::from_raw(p) });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last() -> String {
        // SAFETY: last_error_ptr points to this thread's NUL-terminated message.
        unsafe { CStr::from_ptr(last_error_ptr()) }.to_string_lossy().into_owned()
    }

    #[test]
    fn a_panic_becomes_an_internal_error_with_its_message() {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let s = guard("teraio_test", || panic!("boom {}", 42));
        std::panic::set_hook(prev);
        assert_eq!(s, Status::Internal.code());
        let m = last();
        assert!(m.contains("teraio_test") && m.contains("boom 42"), "{m}");
        assert_eq!(guard("ok", || Ok(Status::Pending)), 1);
        assert_eq!(last(), m, "a success leaves the last error alone");
    }
}
