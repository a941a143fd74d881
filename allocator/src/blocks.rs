//! An ordered set of `u64` kept as a list of sorted blocks: a two-level B+-tree in flat vectors.
//!
//! Built for the exact-length bins of the size index, where the operations are "take the
//! smallest", "insert" and "remove a given value", on sets from one element to a few thousand
//! (and more on pathological free-space patterns). Everything is stored in descending order so
//! that the smallest element is at the end of the last block: taking it is a `pop`. That last
//! block is held in the set itself, and for most sets it is the only one. Insert and remove are
//! two binary searches (over the other blocks' smallest elements, then in one block) and a move
//! of at most [`BLOCK_MAX`] elements; a block that outgrows it splits in two. A set that keeps
//! emptying and filling again keeps its one block allocated. On the array bench this took
//! fewer instructions and less time than `std`'s `BTreeSet` (whose nodes hold 11 keys).

/// Largest block: 112 elements. A block made by a split gets one more slot (904 bytes), below
/// glibc's 1 KiB "large request" size, whose allocation would consolidate the fast bins.
const BLOCK_MAX: usize = 112;

/// See the module docs.
///
/// Most sets (the exact-length bins of a device) fit one block: that block, `tail`, is held in
/// the set itself, so taking, inserting or removing reads the set's 32 bytes and the block, with
/// no vector of blocks and no vector of block lows in between (on the array bench these were
/// a large share of the cache misses of a pair). Only a set that outgrows one block gets `upper`.
#[derive(Debug, Clone, Default)]
#[repr(align(32))]
pub(crate) struct BlockSet {
    /// The block of the smallest elements, in descending order: `pop_first` takes its last
    /// element. Non-empty iff the set is; kept allocated when the set empties, for reuse.
    tail: Vec<u64>,
    /// The blocks above `tail`, when there are any.
    upper: Option<Box<Upper>>,
}

/// The blocks of a [`BlockSet`] above its `tail`: every element above every element of `tail`.
#[derive(Debug, Clone, Default)]
struct Upper {
    /// Non-empty blocks, each in descending order, the blocks in descending order too.
    blocks: Vec<Vec<u64>>,
    /// `lows[i]` is the smallest (last) element of `blocks[i]`.
    lows: Vec<u64>,
    /// Elements held in `blocks`.
    len: usize,
}

/// Where an element is or would go: the set's `tail`, or block `i` of `upper`.
#[derive(Clone, Copy)]
enum Place {
    Tail,
    Upper(usize),
}

impl BlockSet {
    /// Number of elements.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.tail.len() + self.upper.as_ref().map_or(0, |up| up.len)
    }

    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.tail.is_empty()
    }

    /// The smallest element.
    #[inline]
    pub(crate) fn first(&self) -> Option<u64> {
        self.tail.last().copied()
    }

    /// Remove and return the smallest element.
    #[inline]
    pub(crate) fn pop_first(&mut self) -> Option<u64> {
        let value = self.tail.pop()?;
        if self.tail.is_empty() {
            self.refill_tail();
        }
        Some(value)
    }

    /// `tail` just became empty: the lowest block of `upper`, if any, becomes the tail.
    fn refill_tail(&mut self) {
        debug_assert!(self.tail.is_empty());
        let Some(up) = self.upper.as_deref_mut() else { return };
        let block = up.blocks.pop().expect("an upper part holds at least one block");
        up.lows.pop();
        up.len -= block.len();
        if up.blocks.is_empty() {
            self.upper = None;
        }
        self.tail = block;
    }

    /// The block that holds `value` or where it would go: the first upper block whose smallest
    /// element is `<= value`, else the tail.
    #[inline]
    fn place_of(&self, value: u64) -> Place {
        match self.upper.as_deref() {
            None => Place::Tail, // most sets: one block
            Some(up) => {
                let i = up.lows.partition_point(|&low| low > value);
                if i < up.blocks.len() { Place::Upper(i) } else { Place::Tail }
            }
        }
    }

    /// Insert `value`; false if it was present already.
    #[inline]
    pub(crate) fn insert(&mut self, value: u64) -> bool {
        match self.place_of(value) {
            Place::Tail => {
                let tail = &mut self.tail;
                let pos = tail.partition_point(|&v| v > value);
                if tail.get(pos) == Some(&value) {
                    return false;
                }
                tail.insert(pos, value);
                if tail.len() > BLOCK_MAX {
                    self.split_tail();
                }
            }
            Place::Upper(i) => {
                let up = self.upper.as_deref_mut().expect("placed in an upper block");
                let block = &mut up.blocks[i];
                let pos = block.partition_point(|&v| v > value);
                if block.get(pos) == Some(&value) {
                    return false;
                }
                block.insert(pos, value);
                up.lows[i] = *block.last().expect("just inserted");
                up.len += 1;
                if block.len() > BLOCK_MAX {
                    let mut low_half = Vec::with_capacity(BLOCK_MAX + 1);
                    low_half.extend_from_slice(&block[BLOCK_MAX / 2..]);
                    block.truncate(BLOCK_MAX / 2);
                    let low = *block.last().expect("half a block");
                    let half_low = *low_half.last().expect("half a block");
                    up.lows[i] = low;
                    up.blocks.insert(i + 1, low_half);
                    up.lows.insert(i + 1, half_low);
                }
            }
        }
        true
    }

    /// The tail outgrew a block: its upper half becomes the lowest upper block.
    fn split_tail(&mut self) {
        let mut low_half = Vec::with_capacity(BLOCK_MAX + 1);
        low_half.extend_from_slice(&self.tail[BLOCK_MAX / 2..]);
        self.tail.truncate(BLOCK_MAX / 2);
        let high_half = std::mem::replace(&mut self.tail, low_half);
        let up = self.upper.get_or_insert_with(Box::default);
        up.len += high_half.len();
        up.lows.push(*high_half.last().expect("half a block"));
        up.blocks.push(high_half);
    }

    /// Remove `value`; false if it was absent.
    #[inline]
    pub(crate) fn remove(&mut self, value: u64) -> bool {
        match self.place_of(value) {
            Place::Tail => {
                let pos = self.tail.partition_point(|&v| v > value);
                if self.tail.get(pos) != Some(&value) {
                    return false;
                }
                self.tail.remove(pos);
                if self.tail.is_empty() {
                    self.refill_tail();
                }
            }
            Place::Upper(i) => {
                let up = self.upper.as_deref_mut().expect("placed in an upper block");
                let block = &mut up.blocks[i];
                let pos = block.partition_point(|&v| v > value);
                if block.get(pos) != Some(&value) {
                    return false;
                }
                block.remove(pos);
                up.len -= 1;
                match block.last() {
                    Some(&low) => up.lows[i] = low,
                    None => {
                        up.blocks.remove(i);
                        up.lows.remove(i);
                        if up.blocks.is_empty() {
                            self.upper = None;
                        }
                    }
                }
            }
        }
        true
    }

    /// Whether `value` is present.
    pub(crate) fn contains(&self, value: u64) -> bool {
        let block = match self.place_of(value) {
            Place::Tail => &self.tail,
            Place::Upper(i) => &self.upper.as_deref().expect("placed in an upper block").blocks[i],
        };
        block.get(block.partition_point(|&v| v > value)) == Some(&value)
    }

    /// Remove every element (keeping the tail's buffer for reuse).
    pub(crate) fn clear(&mut self) {
        self.tail.clear();
        self.upper = None;
    }

    /// Number of blocks (the tail counts as one).
    #[cfg(test)]
    fn block_count(&self) -> usize {
        1 + self.upper.as_ref().map_or(0, |up| up.blocks.len())
    }

    /// The structure's own invariants; a description of the first violation.
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.tail.len() > BLOCK_MAX {
            return Err(format!("a tail block of {} elements", self.tail.len()));
        }
        let mut above = None::<u64>;
        let mut in_order = |v: u64| {
            let ok = above.is_none_or(|a| a > v);
            above = Some(v);
            ok
        };
        if let Some(up) = self.upper.as_deref() {
            if self.tail.is_empty() {
                return Err("upper blocks above an empty tail".into());
            }
            if up.blocks.is_empty() || up.blocks.len() != up.lows.len() {
                return Err(format!(
                    "{} upper blocks and {} block lows",
                    up.blocks.len(),
                    up.lows.len()
                ));
            }
            let held: usize = up.blocks.iter().map(Vec::len).sum();
            if held != up.len {
                return Err(format!(
                    "upper blocks hold {held} elements, the count says {}",
                    up.len
                ));
            }
            for (block, &low) in up.blocks.iter().zip(&up.lows) {
                if block.is_empty() || block.len() > BLOCK_MAX {
                    return Err(format!("an upper block of {} elements", block.len()));
                }
                if block.last() != Some(&low) {
                    return Err(format!("block low {low} is not its smallest element"));
                }
                if let Some(&v) = block.iter().find(|&&v| !in_order(v)) {
                    return Err(format!("element {v} out of descending order"));
                }
            }
        }
        if let Some(&v) = self.tail.iter().find(|&&v| !in_order(v)) {
            return Err(format!("element {v} out of descending order"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::{BLOCK_MAX, BlockSet};

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64),
        Remove(u64),
        PopFirst,
    }

    fn arbitrary_op() -> impl Strategy<Value = Op> {
        // A narrow value range so that removes and duplicate inserts hit.
        prop_oneof![
            4 => (0u64..1500).prop_map(Op::Insert),
            3 => (0u64..1500).prop_map(Op::Remove),
            1 => Just(Op::PopFirst),
        ]
    }

    proptest! {
        #[test]
        fn block_set_matches_btreeset(ops in prop::collection::vec(arbitrary_op(), 0..2500)) {
            let mut sut = BlockSet::default();
            let mut reference = BTreeSet::new();
            for op in ops {
                match op {
                    Op::Insert(v) => prop_assert_eq!(sut.insert(v), reference.insert(v)),
                    Op::Remove(v) => prop_assert_eq!(sut.remove(v), reference.remove(&v)),
                    Op::PopFirst => prop_assert_eq!(sut.pop_first(), reference.pop_first()),
                }
                prop_assert_eq!(sut.first(), reference.first().copied());
                prop_assert_eq!(sut.len(), reference.len());
                prop_assert_eq!(sut.check(), Ok(()));
            }
            prop_assert_eq!(sut.check(), Ok(()));
            for v in 0..1500 {
                prop_assert_eq!(sut.contains(v), reference.contains(&v));
            }
            sut.clear();
            prop_assert_eq!(sut.check(), Ok(()));
            prop_assert_eq!(sut.first(), None);
        }
    }

    #[test]
    fn large_sets_split_into_bounded_blocks() {
        let mut set = BlockSet::default();
        for v in (0..10_000u64).map(|i| i * 7919 % 10_007) {
            assert!(set.insert(v));
        }
        assert_eq!(set.check(), Ok(()));
        assert!(set.block_count() >= 10_000 / BLOCK_MAX);
        assert_eq!(set.first(), Some(0));
        for v in (0..10_000u64).map(|i| i * 7919 % 10_007).rev() {
            assert!(set.remove(v));
            assert!(!set.contains(v));
        }
        assert_eq!(set.check(), Ok(()));
        assert_eq!((set.len(), set.first(), set.block_count()), (0, None, 1));
    }
}
