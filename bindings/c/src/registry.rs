//! Handles: what a C caller holds is never a Rust pointer but an id of a slot in a registry,
//! checked on every call. A handle's 64 bits are `generation << 32 | index << 8 | kind`, so
//! a null, made-up, already-freed or wrong-kind handle is recognized and refused with an error
//! code instead of being dereferenced. The C type is an opaque pointer (`teraio_engine *`)
//! whose value is that id; it is never dereferenced on either side.
//!
//! A slot's generation is bumped when its handle is freed, so an old handle stays stale even
//! after the slot is reused (until the 32-bit generation wraps, after 4 billion reuses of the
//! same slot).

use std::sync::Arc;

use parking_lot::Mutex;
use teraio_bindings_core::Error;

/// Index bits of a handle.
const INDEX_BITS: u32 = 24;
const INDEX_MAX: usize = (1 << INDEX_BITS) - 1;

/// The kinds of handles, as tagged in their low byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    Engine = 1,
    Op = 2,
    Buffer = 3,
    Trace = 4,
    Executor = 5,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Engine => "engine",
            Kind::Op => "operation",
            Kind::Buffer => "buffer",
            Kind::Trace => "trace",
            Kind::Executor => "executor",
        }
    }

    fn from_tag(tag: u8) -> Option<Kind> {
        [Kind::Engine, Kind::Op, Kind::Buffer, Kind::Trace, Kind::Executor]
            .into_iter()
            .find(|k| *k as u8 == tag)
    }
}

struct Slot<T> {
    generation: u32,
    value: Option<Arc<T>>,
}

struct Slots<T> {
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
}

/// One registry per kind of handle.
pub(crate) struct Registry<T> {
    kind: Kind,
    inner: Mutex<Slots<T>>,
}

impl<T> Registry<T> {
    pub(crate) const fn new(kind: Kind) -> Self {
        Registry { kind, inner: Mutex::new(Slots { slots: Vec::new(), free: Vec::new() }) }
    }

    /// Register `value`; its handle.
    pub(crate) fn insert(&self, value: T) -> Result<u64, Error> {
        let mut s = self.inner.lock();
        let index = match s.free.pop() {
            Some(i) => i,
            None => {
                if s.slots.len() > INDEX_MAX {
                    return Err(Error::InvalidState(format!(
                        "more than {INDEX_MAX} live {} handles; free some",
                        self.kind.name()
                    )));
                }
                s.slots.push(Slot { generation: 1, value: None });
                (s.slots.len() - 1) as u32
            }
        };
        let slot = &mut s.slots[index as usize];
        slot.value = Some(Arc::new(value));
        Ok(u64::from(slot.generation) << 32 | u64::from(index) << 8 | self.kind as u64)
    }

    /// The value behind `handle`.
    pub(crate) fn get(&self, handle: u64) -> Result<Arc<T>, Error> {
        let s = self.inner.lock();
        let (index, _) = self.check(&s, handle)?;
        Ok(s.slots[index].value.clone().expect("checked"))
    }

    /// Remove `handle`: later uses of it are refused.
    pub(crate) fn remove(&self, handle: u64) -> Result<Arc<T>, Error> {
        let mut s = self.inner.lock();
        let (index, _) = self.check(&s, handle)?;
        let slot = &mut s.slots[index];
        let v = slot.value.take().expect("checked");
        slot.generation = slot.generation.wrapping_add(1).max(1);
        s.free.push(index as u32);
        Ok(v)
    }

    fn check(&self, s: &Slots<T>, handle: u64) -> Result<(usize, u32), Error> {
        let what = self.kind.name();
        if handle == 0 {
            return Err(Error::InvalidHandle(format!("the {what} handle is NULL")));
        }
        let tag = (handle & 0xff) as u8;
        if tag != self.kind as u8 {
            return Err(Error::InvalidHandle(match Kind::from_tag(tag) {
                Some(k) => {
                    format!("a {} handle was passed where a {what} handle is needed", k.name())
                }
                None => format!("{handle:#x} is not a {what} handle"),
            }));
        }
        let index = ((handle >> 8) as usize) & INDEX_MAX;
        let generation = (handle >> 32) as u32;
        let Some(slot) = s.slots.get(index).filter(|_| generation != 0) else {
            return Err(Error::InvalidHandle(format!("{handle:#x} is not a {what} handle")));
        };
        if slot.value.is_some() && slot.generation == generation {
            Ok((index, generation))
        } else if generation < slot.generation {
            Err(self.stale(handle))
        } else {
            Err(Error::InvalidHandle(format!("{handle:#x} is not a {what} handle")))
        }
    }

    fn stale(&self, handle: u64) -> Error {
        match self.kind {
            Kind::Engine => Error::Closed(format!("the engine handle {handle:#x} was closed")),
            k => Error::InvalidHandle(format!(
                "the {} handle {handle:#x} was already freed",
                k.name()
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use teraio_bindings_core::Status;

    #[test]
    fn handles_are_checked_for_kind_liveness_and_reuse() {
        let r: Registry<u32> = Registry::new(Kind::Op);
        let a = r.insert(10).unwrap();
        assert_eq!(*r.get(a).unwrap(), 10);
        assert_eq!(r.get(0).unwrap_err().status(), Status::InvalidHandle);
        assert_eq!(r.get(a ^ 0xff).unwrap_err().status(), Status::InvalidHandle, "wrong kind");
        assert_eq!(r.get(a + (1 << 8)).unwrap_err().status(), Status::InvalidHandle);
        assert_eq!(*r.remove(a).unwrap(), 10);
        let e = r.get(a).unwrap_err();
        assert_eq!(e.status(), Status::InvalidHandle);
        assert!(e.to_string().contains("already freed"), "{e}");
        assert!(r.remove(a).is_err(), "double free");
        let b = r.insert(20).unwrap();
        assert_ne!(a, b, "a reused slot gets a new generation");
        assert!(r.get(a).is_err(), "the old handle stays stale after reuse");
        assert_eq!(*r.get(b).unwrap(), 20);
        let engines: Registry<u32> = Registry::new(Kind::Engine);
        let e = engines.insert(1).unwrap();
        engines.remove(e).unwrap();
        assert_eq!(engines.get(e).unwrap_err().status(), Status::Closed);
        assert_eq!(engines.get(b).unwrap_err().status(), Status::InvalidHandle);
    }
}
