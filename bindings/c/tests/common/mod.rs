//! Helpers the C ABI's integration tests share (each test file is its own crate and uses some).
#![allow(dead_code)]

use std::ffi::{CStr, CString, c_char};

use teraio::*;

/// A C string of `s`.
pub fn cs(s: &str) -> CString {
    CString::new(s).unwrap()
}

/// The calling thread's last error message.
pub fn last_error() -> String {
    // SAFETY: teraio_last_error_message returns a valid NUL-terminated string.
    unsafe { CStr::from_ptr(teraio_last_error_message()) }.to_string_lossy().into_owned()
}

/// A string teraio returned, freed with `teraio_string_free`.
pub fn take_string(p: *mut c_char) -> String {
    assert!(!p.is_null());
    // SAFETY: p is a string teraio returned.
    let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    assert_eq!(teraio_string_free(p), TERAIO_OK);
    s
}
