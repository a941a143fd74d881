//! Caller memory, read in Rust: the address and length of a Python object's bytes, checked
//! (C-contiguous, writable where written, item sizes from the object, no arrays of Python
//! objects), and what keeps them alive. No call goes back into the `teraio` package.
//!
//! Host memory, in the order the package always took it:
//! 1. a `teraio.HostBuffer` (this module's [`NativeBuffer`](crate::NativeBuffer)): its memory;
//! 2. an object with `__array_interface__` (numpy, and anything that claims one), except
//!    `bytes`, `bytearray` and `memoryview`: the interface's dict, read here;
//! 3. anything else through the buffer protocol, taken through a `memoryview` of the object
//!    (that view holds the object's export for as long as the memory is used: a `bytearray`
//!    cannot be resized meanwhile).
//!
//! A C-contiguous export that is exactly a live engine buffer's memory (a numpy view of a
//! `HostBuffer`) names that buffer, so it moves without a copy.
//!
//! Device memory: a `teraio.DeviceMemory` ([`DeviceMemory`], a native class) or an object with
//! `__cuda_array_interface__` (a CUDA `torch.Tensor`, CuPy, Numba), read here.
//!
//! The extension targets the stable ABI of CPython 3.9 (abi3), whose limited API gained the
//! buffer protocol only in 3.11 (`Py_buffer` and `PyObject_GetBuffer` have not changed since
//! 3.3; 3.11 made them part of the stable ABI as they were). The two functions are declared
//! here and resolved from the interpreter when the module loads (Linux only, as the package).

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::{Arc, LazyLock, Weak};

use parking_lot::Mutex;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::ffi::{Py_ssize_t, PyObject};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyInt, PyList, PyMemoryView, PyString, PyTuple,
};
use teraio_bindings_core::{Error, HostBuffer as CoreBuffer, Result};

/// The buffer protocol of CPython (`Include/pybuffer.h`, unchanged since 3.3).
#[allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]
mod ffi {
    use super::{Py_ssize_t, PyObject, c_char, c_int, c_void};

    #[repr(C)]
    pub struct Py_buffer {
        pub buf: *mut c_void,
        pub obj: *mut PyObject,
        pub len: Py_ssize_t,
        pub itemsize: Py_ssize_t,
        pub readonly: c_int,
        pub ndim: c_int,
        pub format: *mut c_char,
        pub shape: *mut Py_ssize_t,
        pub strides: *mut Py_ssize_t,
        pub suboffsets: *mut Py_ssize_t,
        pub internal: *mut c_void,
    }

    /// `PyBUF_STRIDES | PyBUF_FORMAT` (`PyBUF_RECORDS_RO`): shape, strides and format, read only
    /// or writable, no suboffsets.
    pub const PyBUF_RECORDS_RO: c_int = 0x0010 | 0x0008 | 0x0004;

    unsafe extern "C" {
        pub fn PyObject_GetBuffer(obj: *mut PyObject, view: *mut Py_buffer, flags: c_int) -> c_int;
        pub fn PyBuffer_Release(view: *mut Py_buffer);
    }
}

/// `{what}: {the exception's message}` as an invalid argument.
fn invalid(py: Python<'_>, what: &str, e: &PyErr) -> Error {
    Error::InvalidArgument(format!("{what}: {}", e.value(py)))
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

// ---------------------------------------------------------------------------------------------
// Engine buffers by address

/// Live engine buffers by address: a view that covers one whole moves without a copy.
static ENGINE_BUFFERS: LazyLock<Mutex<HashMap<usize, Weak<CoreBuffer>>>> =
    LazyLock::new(Mutex::default);

/// A new engine buffer (a `teraio.HostBuffer` made it).
pub fn register(buf: &Arc<CoreBuffer>) {
    ENGINE_BUFFERS.lock().insert(buf.addr(), Arc::downgrade(buf));
}

/// The `teraio.HostBuffer` of `buf` is gone.
pub fn unregister(buf: &Arc<CoreBuffer>) {
    let mut m = ENGINE_BUFFERS.lock();
    if m.get(&buf.addr()).is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(buf))) {
        m.remove(&buf.addr());
    }
}

/// The live, unreleased engine buffer that is exactly `[addr, addr + len)`.
fn whole_buffer(addr: usize, len: usize) -> Option<Arc<CoreBuffer>> {
    let b = ENGINE_BUFFERS.lock().get(&addr)?.upgrade()?;
    (b.len() == len && !b.is_released()).then_some(b)
}

// ---------------------------------------------------------------------------------------------
// Host memory

/// A caller's host memory: `len` bytes at `addr`, valid while `keep` lives.
pub struct HostExport {
    pub addr: usize,
    pub len: usize,
    /// The object, or the memoryview holding its buffer export.
    pub keep: Py<PyAny>,
    /// The engine buffer that is exactly this memory (it moves without a copy).
    pub engine: Option<Arc<CoreBuffer>>,
}

/// `obj`'s bytes (see the module's documentation); `writable`: they will be written. `what`
/// names the argument in errors.
pub fn host(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> Result<HostExport> {
    let py = obj.py();
    if let Ok(b) = obj.cast::<crate::NativeBuffer>() {
        let buf = b.get().buf.clone();
        if buf.is_released() {
            return Err(Error::InvalidArgument(format!(
                "{what}: the engine buffer at {:#x} was released",
                buf.addr()
            )));
        }
        let (addr, len) = (buf.addr(), buf.len());
        return Ok(HostExport { addr, len, keep: obj.clone().unbind(), engine: Some(buf) });
    }
    let plain = obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>()
        || obj.is_instance_of::<PyMemoryView>();
    if !plain {
        let ai = obj
            .getattr_opt(intern!(py, "__array_interface__"))
            .map_err(|e| invalid(py, what, &e))?;
        if let Some(ai) = ai
            && let Ok(d) = ai.cast::<PyDict>()
        {
            let hint = "pass a C-contiguous one (numpy.ascontiguousarray)";
            let (addr, len) = interface_span(d, writable, what, hint)?;
            if addr == 0 && len > 0 {
                return Err(Error::InvalidArgument(format!(
                    "{what}: a buffer of {len} bytes at address 0"
                )));
            }
            let engine = whole_buffer(addr, len);
            return Ok(HostExport { addr, len, keep: obj.clone().unbind(), engine });
        }
    }
    buffer_protocol(obj, writable, what)
}

/// A float32 buffer of the host optimizer: `len` elements at `addr`, valid while `keep` lives.
pub struct F32Export {
    pub addr: usize,
    pub len: usize,
    /// The object, or the memoryview holding its buffer export.
    pub keep: Py<PyAny>,
}

/// `obj` as a C-contiguous float32 buffer of the host optimizer (`writable`: it will be
/// written): a CPU `torch.Tensor` (read through `data_ptr` and `numel`, without importing
/// torch), a numpy array (its `__array_interface__` of typestr `<f4`), or any buffer-protocol
/// object of format `f`; then read as [`host`] reads it. `what` names the argument in errors.
/// An exception raised by the object's own attributes arrives as it was raised.
pub fn host_f32(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> PyResult<F32Export> {
    let py = obj.py();
    let fail = |m: String| crate::to_py(py, &Error::InvalidArgument(format!("{what}: {m}")));
    let has = |name: &Bound<'_, PyString>| obj.hasattr(name);
    if has(intern!(py, "data_ptr"))?
        && has(intern!(py, "is_contiguous"))?
        && has(intern!(py, "device"))?
    {
        let device = obj.getattr(intern!(py, "device"))?;
        let kind = match device.getattr_opt(intern!(py, "type"))? {
            Some(t) => t,
            None => device.str()?.into_any(),
        };
        if !kind.eq("cpu")? {
            return Err(fail(format!(
                "a tensor on {}; the host optimizer steps CPU tensors",
                device.str()?
            )));
        }
        let dtype = obj.getattr(intern!(py, "dtype"))?.str()?;
        if dtype.to_cow()? != "torch.float32" {
            return Err(fail(format!("a {dtype} tensor; the host optimizer steps float32")));
        }
        let sparse = obj.getattr_opt(intern!(py, "is_sparse"))?;
        if sparse.map(|s| s.is_truthy()).transpose()?.unwrap_or(false) {
            return Err(fail("a sparse tensor; the host optimizer steps dense ones".into()));
        }
        if !obj.call_method0(intern!(py, "is_contiguous"))?.is_truthy()? {
            let tuple = |o| py.get_type::<PyTuple>().call1((o,));
            let shape = tuple(obj.getattr(intern!(py, "shape"))?)?;
            let strides = tuple(obj.call_method0(intern!(py, "stride"))?)?;
            return Err(fail(format!(
                "a non-contiguous tensor (shape {}, strides {}); pass a contiguous one",
                shape.repr()?,
                strides.repr()?
            )));
        }
        let int = |name: &Bound<'_, PyString>| -> PyResult<usize> {
            py.get_type::<PyInt>().call1((obj.call_method0(name)?,))?.extract()
        };
        let addr = int(intern!(py, "data_ptr"))?;
        let len = int(intern!(py, "numel"))?;
        return Ok(F32Export { addr, len, keep: obj.clone().unbind() });
    }
    let plain = obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>()
        || obj.is_instance_of::<PyMemoryView>()
        || obj.is_instance_of::<crate::NativeBuffer>();
    let ai = if plain {
        None
    } else {
        match obj.getattr_opt(intern!(py, "__array_interface__")) {
            Err(e) if e.is_instance_of::<PyException>(py) => {
                return Err(fail(e.value(py).to_string())); // an interface property that fails
            }
            r => r?,
        }
    };
    if let Some(ai) = ai.as_ref().and_then(|ai| ai.cast::<PyDict>().ok()) {
        let native = if cfg!(target_endian = "little") { "<" } else { ">" };
        let typestr = ai.get_item("typestr")?;
        let text = typestr.as_ref().and_then(|t| t.cast::<PyString>().ok());
        let text = text.map(|t| t.to_cow().map(|c| c.into_owned())).transpose()?;
        if !matches!(text.as_deref(), Some(t) if t == format!("{native}f4") || t == "=f4") {
            let shown = typestr.map_or(Ok("None".into()), |t| t.repr().map(|r| r.to_string()))?;
            return Err(fail(format!(
                "an array of typestr {shown}; the host optimizer steps float32 ({native}f4): pass \
                 a.astype('float32') and copy the result back"
            )));
        }
    } else {
        let format = match PyMemoryView::from(obj) {
            Ok(mv) => Some(mv.getattr(intern!(py, "format"))?),
            Err(e)
                if e.is_instance_of::<PyTypeError>(py) || e.is_instance_of::<PyValueError>(py) =>
            {
                None
            }
            Err(e) => return Err(e),
        };
        if let Some(format) = format {
            let text = format.str()?;
            if text.to_cow()?.trim_start_matches(['@', '=', '<']) != "f" {
                return Err(fail(format!(
                    "a buffer of format {}; the host optimizer steps float32 (format 'f')",
                    format.repr()?
                )));
            }
        }
    }
    let x = host(obj, writable, what).map_err(|e| crate::to_py(py, &e))?;
    Ok(F32Export { addr: x.addr, len: x.len / 4, keep: x.keep })
}

/// A `Py_buffer` of ours, released when dropped (with the GIL: the caller holds it).
struct View(ffi::Py_buffer);

impl Drop for View {
    fn drop(&mut self) {
        // SAFETY: a view that PyObject_GetBuffer filled, released once, with the GIL held.
        unsafe { ffi::PyBuffer_Release(&mut self.0) }
    }
}

impl View {
    fn dims(&self) -> (&[Py_ssize_t], Option<&[Py_ssize_t]>) {
        let n = usize::try_from(self.0.ndim).unwrap_or(0);
        if n == 0 || self.0.shape.is_null() {
            return (&[], None);
        }
        // SAFETY: with PyBUF_STRIDES requested, shape and (when not NULL) strides hold ndim
        // entries that live as long as the view.
        unsafe {
            let shape = std::slice::from_raw_parts(self.0.shape, n);
            let strides =
                (!self.0.strides.is_null()).then(|| std::slice::from_raw_parts(self.0.strides, n));
            (shape, strides)
        }
    }

    /// CPython's `PyBuffer_IsContiguous(view, 'C')`.
    fn c_contiguous(&self) -> bool {
        let (shape, strides) = self.dims();
        let Some(strides) = strides else { return true };
        if self.0.len == 0 {
            return true;
        }
        let mut expected = self.0.itemsize;
        for (&dim, &stride) in shape.iter().zip(strides).rev() {
            if dim > 1 && stride != expected {
                return false;
            }
            expected = expected.saturating_mul(dim);
        }
        true
    }

    fn format(&self) -> String {
        if self.0.format.is_null() {
            return "B".into();
        }
        // SAFETY: a NUL-terminated struct format string that lives as long as the view.
        unsafe { CStr::from_ptr(self.0.format) }.to_string_lossy().into_owned()
    }
}

/// `obj`'s bytes through the buffer protocol, held by a memoryview of it.
fn buffer_protocol(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> Result<HostExport> {
    let py = obj.py();
    let mv = PyMemoryView::from(obj).map_err(|e| {
        if e.is_instance_of::<PyTypeError>(py) {
            Error::InvalidArgument(format!(
                "{what}: a buffer (numpy array, bytes, bytearray, memoryview, HostBuffer) is \
                 required, not {}",
                type_name(obj)
            ))
        } else {
            invalid(py, what, &e) // e.g. a released memoryview
        }
    })?;
    let mut raw = std::mem::MaybeUninit::<ffi::Py_buffer>::zeroed();
    // SAFETY: `mv` is a live object and `raw` room for a Py_buffer; on success the view is
    // ours to release (View's drop), on failure nothing was filled.
    let rc =
        unsafe { ffi::PyObject_GetBuffer(mv.as_ptr(), raw.as_mut_ptr(), ffi::PyBUF_RECORDS_RO) };
    if rc != 0 {
        let e = PyErr::take(py).unwrap_or_else(|| PyTypeError::new_err("no buffer"));
        return Err(invalid(py, what, &e));
    }
    // SAFETY: filled by the successful call above.
    let view = View(unsafe { raw.assume_init() });
    if !view.c_contiguous() {
        return Err(Error::InvalidArgument(format!("{what}: the buffer is not C-contiguous")));
    }
    let format = view.format();
    if format.contains('O') {
        return Err(Error::InvalidArgument(format!(
            "{what}: a buffer of Python objects (format {format:?}) holds pointers, not data"
        )));
    }
    let len = usize::try_from(view.0.len).unwrap_or(0);
    let keep = mv.into_any().unbind();
    if len == 0 {
        return Ok(HostExport { addr: 0, len: 0, keep, engine: None });
    }
    let readonly = view.0.readonly != 0;
    if readonly && writable {
        return Err(Error::InvalidArgument(format!(
            "{what}: a read-only buffer ({}); pass a writable one (bytearray, numpy array, \
             HostBuffer)",
            type_name(obj)
        )));
    }
    // The memoryview (`keep`) holds the object's export: its memory stays where it is after
    // our own view of the memoryview is released.
    let addr = view.0.buf as usize;
    let engine = if readonly { None } else { whole_buffer(addr, len) };
    Ok(HostExport { addr, len, keep, engine })
}

// ---------------------------------------------------------------------------------------------
// Array interfaces

/// A non-negative Python int, or None when `o` is not one (bools are not); `Some(None)`: larger
/// than `u128::MAX`.
fn non_negative(o: &Bound<'_, PyAny>) -> Option<Option<u128>> {
    if !o.is_instance_of::<PyInt>() || o.is_instance_of::<PyBool>() {
        return None;
    }
    match o.extract::<u128>() {
        Ok(v) => Some(Some(v)),
        Err(_) if o.lt(0).unwrap_or(true) => None,
        Err(_) => Some(None),
    }
}

/// Bytes per element of a typestr (`<f4`, `|S7`, `<U10` (4-byte code points), `<M8[ns]`,
/// `|V12`); None when larger than `u128::MAX`. Object arrays are refused.
fn typestr_itemsize(t: Option<&Bound<'_, PyAny>>, what: &str) -> Result<Option<u128>> {
    let text = t
        .and_then(|t| t.cast::<PyString>().ok())
        .and_then(|s| s.to_cow().ok().map(|c| c.into_owned()));
    let parsed = text.as_deref().and_then(|s| {
        let mut c = s.chars();
        let order = c.next()?;
        let kind = c.next()?;
        if !"<>|=".contains(order) || !kind.is_ascii_alphabetic() {
            return None;
        }
        let rest = c.as_str();
        let digits = rest.len() - rest.trim_start_matches(|ch: char| ch.is_ascii_digit()).len();
        let (count, unit) = rest.split_at(digits);
        let unit_ok = unit.is_empty()
            || (unit.len() > 2
                && unit.starts_with('[')
                && unit.ends_with(']')
                && unit[1..unit.len() - 1].chars().all(|ch| ch.is_alphanumeric() || ch == '_'));
        unit_ok.then_some((kind, count))
    });
    if let Some(('O', _)) = parsed {
        return Err(Error::InvalidArgument(format!(
            "{what}: an array of Python objects (dtype object) holds pointers, not data; convert \
             it to a numeric, bytes or string dtype first (e.g. a.astype(float))"
        )));
    }
    let Some((kind, count)) = parsed.filter(|(_, count)| !count.is_empty()) else {
        let shown = t.and_then(|t| t.repr().ok()).map_or("None".into(), |r| r.to_string());
        return Err(Error::InvalidArgument(format!(
            "{what}: the array interface's typestr {shown} is not of the form <kind><bytes> \
             (e.g. '<f4')"
        )));
    };
    let n = count.parse::<u128>().ok();
    Ok(if kind == 'U' { n.and_then(|n| n.checked_mul(4)) } else { n })
}

/// The items of a list or a tuple (subclasses included); None for anything else.
fn list_or_tuple<'py>(o: &Bound<'py, PyAny>) -> Option<Vec<Bound<'py, PyAny>>> {
    if let Ok(l) = o.cast::<PyList>() {
        Some(l.iter().collect())
    } else {
        o.cast::<PyTuple>().ok().map(|t| t.iter().collect())
    }
}

/// Whether a structured dtype's `descr` (`[(name, typestr or descr[, shape]), ...]`) has an
/// object field anywhere.
fn descr_has_objects(descr: &Bound<'_, PyAny>) -> bool {
    let Some(fields) = list_or_tuple(descr) else { return false };
    fields.iter().any(|field| {
        let Some(t) = list_or_tuple(field).and_then(|parts| parts.into_iter().nth(1)) else {
            return false;
        };
        let object = t
            .cast::<PyString>()
            .ok()
            .and_then(|s| s.to_cow().ok().map(|s| s.chars().nth(1) == Some('O')))
            .unwrap_or(false);
        object || descr_has_objects(&t)
    })
}

/// The items of an iterable, or the error's repr.
fn items<'py>(o: &Bound<'py, PyAny>) -> std::result::Result<Vec<Bound<'py, PyAny>>, String> {
    let err = |e: PyErr| e.value(o.py()).repr().map_or_else(|_| "?".into(), |r| r.to_string());
    o.try_iter().map_err(err)?.collect::<PyResult<Vec<_>>>().map_err(err)
}

/// (address, bytes) of an `__array_interface__` / `__cuda_array_interface__` dict, checked
/// C-contiguous (and writable when asked). Never more than `isize::MAX` bytes, never past the
/// end of the address space; object arrays are refused.
pub fn interface_span(
    ai: &Bound<'_, PyDict>,
    writable: bool,
    what: &str,
    hint: &str,
) -> Result<(usize, usize)> {
    let py = ai.py();
    let malformed =
        |e: &str| Error::InvalidArgument(format!("{what}: a malformed array interface ({e})"));
    let get = |k: &str| ai.get_item(k).map_err(|e| invalid(py, what, &e));
    let data = get("data")?.ok_or_else(|| malformed("KeyError('data')"))?;
    let data = items(&data).map_err(|e| malformed(&e))?;
    let [addr, readonly] = &data[..] else {
        return Err(malformed(&format!(
            "'data' has {} items, not (address, read_only)",
            data.len()
        )));
    };
    let shape = get("shape")?.ok_or_else(|| malformed("KeyError('shape')"))?;
    let shape = items(&shape).map_err(|e| malformed(&e))?;
    let repr = |o: &Bound<'_, PyAny>| o.repr().map_or_else(|_| "?".into(), |r| r.to_string());
    let shape_repr = || PyTuple::new(py, &shape).map_or_else(|_| "?".into(), |t| repr(t.as_any()));
    let Some(address) = non_negative(addr) else {
        return Err(Error::InvalidArgument(format!(
            "{what}: the array interface's address {} is not an int >= 0",
            repr(addr)
        )));
    };
    let Some(dims) = shape.iter().map(non_negative).collect::<Option<Vec<_>>>() else {
        return Err(Error::InvalidArgument(format!(
            "{what}: the array interface's shape {} is not of ints >= 0",
            shape_repr()
        )));
    };
    let itemsize = typestr_itemsize(get("typestr")?.as_ref(), what)?;
    if let Some(d) = get("descr")?
        && descr_has_objects(&d)
    {
        return Err(Error::InvalidArgument(format!(
            "{what}: a structured array with object fields holds pointers, not data"
        )));
    }
    // Bytes in all (None: more than u128::MAX); any zero factor makes it 0.
    let factors = || std::iter::once(itemsize).chain(dims.iter().copied());
    let nbytes: Option<u128> = if factors().any(|f| f == Some(0)) {
        Some(0)
    } else {
        factors().try_fold(1u128, |acc, f| acc.checked_mul(f?))
    };
    let end = match (address, nbytes) {
        (Some(a), Some(n)) => a.checked_add(n),
        _ => None,
    };
    let fits = nbytes.is_some_and(|n| n <= isize::MAX as u128)
        && end.is_some_and(|e| e <= usize::MAX as u128);
    if !fits {
        let n = nbytes.map_or("more than 2**128".into(), |n| n.to_string());
        return Err(Error::InvalidArgument(format!(
            "{what}: the array claims {n} bytes at {}, more than any memory object (at most {} \
             bytes)",
            address.map_or_else(|| repr(addr), |a| format!("{a:#x}")),
            isize::MAX
        )));
    }
    let (address, nbytes) = (address.unwrap_or(0) as usize, nbytes.unwrap_or(0) as usize);
    if let Some(strides) = get("strides")?.filter(|s| !s.is_none()) {
        let Some(list) = list_or_tuple(&strides)
            .filter(|l| l.len() == dims.len() && l.iter().all(|x| x.is_instance_of::<PyInt>()))
        else {
            return Err(Error::InvalidArgument(format!(
                "{what}: the array interface's strides {} do not match its shape",
                repr(&strides)
            )));
        };
        let mut expected = itemsize;
        let mut contiguous = true;
        for (dim, stride) in dims.iter().zip(&list).rev() {
            if dim.is_none_or(|d| d > 1) {
                let s = stride.extract::<i128>().ok();
                let same = matches!((s, expected), (Some(s), Some(e)) if s >= 0 && s as u128 == e);
                if !same {
                    contiguous = false;
                    break;
                }
            }
            expected = match (expected, dim) {
                (Some(e), Some(d)) => e.checked_mul(*d),
                _ => None,
            };
        }
        if !contiguous {
            let strides = PyTuple::new(py, &list).map_or_else(|_| "?".into(), |t| repr(t.as_any()));
            return Err(Error::InvalidArgument(format!(
                "{what}: a non-contiguous array (shape {}, strides {strides}); {hint}",
                shape_repr()
            )));
        }
    }
    if writable && readonly.is_truthy().map_err(|e| invalid(py, what, &e))? {
        return Err(Error::InvalidArgument(format!("{what}: the array is read-only")));
    }
    Ok((address, nbytes))
}

// ---------------------------------------------------------------------------------------------
// Device memory

/// `nbytes` of GPU memory at device address `ptr` that the caller owns (`owner`, e.g. the
/// PyTorch storage, is kept alive with it). Accepted wherever device memory is: the executor's
/// `attach` and its allocator's `alloc`, `Engine.offload_device`, `Engine.prefetch_device`.
/// Objects with `__cuda_array_interface__` (a CUDA `torch.Tensor`, CuPy, Numba) are accepted
/// too. On an engine whose GPU is the host-memory emulation
/// (`gpu={"device": 0, "emulated": True}`), `ptr` is host memory: the device data paths run on
/// any machine.
#[pyclass(frozen, module = "teraio", name = "DeviceMemory")]
pub struct DeviceMemory {
    #[pyo3(get)]
    ptr: u64,
    #[pyo3(get)]
    nbytes: u64,
    #[pyo3(get)]
    owner: Py<PyAny>,
}

#[pymethods]
impl DeviceMemory {
    #[new]
    #[pyo3(signature = (ptr, nbytes, owner=None))]
    fn new(
        ptr: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
        owner: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let py = ptr.py();
        let positive = |o: &Bound<'_, PyAny>| {
            o.is_instance_of::<PyInt>()
                .then(|| o.extract::<u64>().ok())
                .flatten()
                .filter(|&v| v > 0)
        };
        let Some(p) = positive(ptr) else {
            let e = Error::InvalidArgument(format!(
                "DeviceMemory: a device address > 0 is required, not {}",
                ptr.repr()?
            ));
            return Err(crate::to_py(py, &e));
        };
        let Some(n) = positive(nbytes) else {
            let e = Error::InvalidArgument(format!(
                "DeviceMemory: nbytes must be > 0, not {}",
                nbytes.repr()?
            ));
            return Err(crate::to_py(py, &e));
        };
        Ok(DeviceMemory { ptr: p, nbytes: n, owner: owner.unwrap_or_else(|| py.None()) })
    }

    fn __repr__(&self) -> String {
        format!("DeviceMemory({} bytes at {:#x})", self.nbytes, self.ptr)
    }
}

/// (device address, bytes) of device memory, or None for anything else (host buffers).
pub fn device(obj: &Bound<'_, PyAny>, what: &str) -> Result<Option<(u64, u64)>> {
    if let Ok(d) = obj.cast::<DeviceMemory>() {
        let d = d.get();
        return Ok(Some((d.ptr, d.nbytes)));
    }
    let py = obj.py();
    // e.g. a CUDA tensor that requires grad raises here
    let cai = obj
        .getattr_opt(intern!(py, "__cuda_array_interface__"))
        .map_err(|e| invalid(py, what, &e))?;
    let Some(cai) = cai else { return Ok(None) };
    let Ok(d) = cai.cast::<PyDict>() else { return Ok(None) };
    let (addr, nbytes) = interface_span(d, true, what, "pass a contiguous one (.contiguous())")?;
    if nbytes == 0 || addr == 0 {
        return Err(Error::InvalidArgument(format!("{what}: empty device memory")));
    }
    Ok(Some((addr as u64, nbytes as u64)))
}
