//! The store's key type and its two key spaces (the executor's, its callers').

use serde::Serialize;
use teraio_scheduler::TensorId;

/// A tensor's key in the store: a number its caller chooses. Two users share one store without
/// colliding by keeping to two key spaces:
///
/// - the executor's ([`crate::executor`]): a trace's tensor `t` (a [`TensorId`], its index in
///   the trace, a `u32`) has key `t` ([`TensorKey::of_trace`]), always below
///   [`TensorKey::CALLER_FIRST`];
/// - its caller's own: the bindings' `tensor_id` and the PyTorch pager's storages (`teraio.torch`
///   counts its keys from `CALLER_FIRST`, `1 << 40`, so a session's executor and pager run on
///   one engine).
///
/// At the C and Python ABI a key is the `u64` it holds (`From<u64>` and back); it prints as that
/// number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct TensorKey(pub u64);

impl TensorKey {
    /// The first key of the callers' own space (the pager's first key): every key of the
    /// executor's space is below it.
    pub const CALLER_FIRST: TensorKey = TensorKey(1 << 40);

    /// The key of a trace's tensor `t` in the executor's space.
    pub const fn of_trace(t: TensorId) -> Self {
        TensorKey(t.0 as u64)
    }

    /// The trace tensor this key stands for, when it is in the executor's space.
    pub fn trace_tensor(self) -> Option<TensorId> {
        u32::try_from(self.0).ok().map(TensorId)
    }

    /// The number it holds (what the ABIs pass).
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl From<u64> for TensorKey {
    fn from(key: u64) -> Self {
        TensorKey(key)
    }
}

impl From<TensorId> for TensorKey {
    fn from(t: TensorId) -> Self {
        TensorKey::of_trace(t)
    }
}

impl From<TensorKey> for u64 {
    fn from(key: TensorKey) -> Self {
        key.0
    }
}

impl std::fmt::Display for TensorKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_keys_stay_below_the_callers_space_and_round_trip() {
        for t in [0u32, 1, 4096, u32::MAX] {
            let k = TensorKey::of_trace(TensorId(t));
            assert!(k < TensorKey::CALLER_FIRST, "trace tensor {t}");
            assert_eq!(k.trace_tensor(), Some(TensorId(t)));
            assert_eq!(TensorKey::from(TensorId(t)), k);
        }
        assert_eq!(TensorKey::CALLER_FIRST.trace_tensor(), None);
        assert_eq!(TensorKey::CALLER_FIRST.get(), 1 << 40);
    }

    #[test]
    fn at_the_boundary_a_key_is_its_number() {
        let k = TensorKey::from(123_456_789_012u64);
        assert_eq!(u64::from(k), 123_456_789_012);
        assert_eq!(k.to_string(), "123456789012");
        assert_eq!(serde_json::to_string(&k).unwrap(), "123456789012");
    }
}
