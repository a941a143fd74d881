//! A bit set with summary levels: word-wise range updates and nearest-set-bit searches in
//! O(log64 n) words.
//!
//! Level 0 holds the bits. Bit `j` of level `i + 1` is set iff word `j` of level `i` is non-zero,
//! up to a top level of one word. A search for the nearest set bit looks at one word per level
//! going up until it finds a non-zero masked word, then one word per level going down. Bits past
//! `len` (the padding of the last word of each level) are always clear.

/// See the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LevelBits {
    len: u64,
    /// `levels[0]` are the bits; the last level has exactly one word.
    levels: Vec<Vec<u64>>,
}

/// Mask of bits `lo..64` of a word (`lo < 64`).
#[inline]
fn from_bit(lo: u64) -> u64 {
    u64::MAX << lo
}

/// Mask of bits `0..=hi` of a word (`hi < 64`).
#[inline]
fn through_bit(hi: u64) -> u64 {
    u64::MAX >> (63 - hi)
}

impl LevelBits {
    /// `len` clear bits.
    pub(crate) fn new(len: u64) -> Self {
        let words = usize::try_from(len.div_ceil(64).max(1)).expect("bit count fits in memory");
        Self::from_words(len, vec![0; words])
    }

    /// Bits from level-0 words (`ceil(len / 64)` of them, at least one); bits past `len` must be
    /// clear.
    pub(crate) fn from_words(len: u64, words: Vec<u64>) -> Self {
        assert_eq!(
            words.len() as u64,
            len.div_ceil(64).max(1),
            "{len} bits in {} words",
            words.len()
        );
        let mut levels = vec![words];
        while levels.last().is_some_and(|l| l.len() > 1) {
            let below = levels.last().expect("at least one level");
            let mut up = vec![0u64; below.len().div_ceil(64)];
            for (j, &word) in below.iter().enumerate() {
                up[j / 64] |= u64::from(word != 0) << (j % 64);
            }
            levels.push(up);
        }
        let this = Self { len, levels };
        debug_assert_eq!(this.check(), Ok(()));
        this
    }

    /// Number of bits.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// The level-0 words.
    pub(crate) fn words(&self) -> &[u64] {
        &self.levels[0]
    }

    /// Bit `i`.
    #[inline]
    pub(crate) fn get(&self, i: u64) -> bool {
        debug_assert!(i < self.len);
        self.levels[0][(i / 64) as usize] >> (i % 64) & 1 == 1
    }

    /// Set the bits `start..end`, then the summary bits of the words that became non-zero,
    /// level by level, stopping where nothing changes.
    #[inline]
    pub(crate) fn set_range(&mut self, start: u64, end: u64) {
        debug_assert!(start < end && end <= self.len);
        let (mut a, mut b) = (start, end - 1); // inclusive bit range at this level
        for level in &mut self.levels {
            let (w0, w1) = ((a / 64) as usize, (b / 64) as usize);
            let (first, last) = (from_bit(a % 64), through_bit(b % 64));
            if w0 == w1 {
                let was = level[w0];
                level[w0] = was | (first & last);
                if was != 0 {
                    return; // its summary bit is set already
                }
            } else {
                let settled = w1 == w0 + 1 && level[w0] != 0 && level[w1] != 0;
                level[w0] |= first;
                level[w0 + 1..w1].fill(u64::MAX);
                level[w1] |= last;
                if settled {
                    return;
                }
            }
            (a, b) = (w0 as u64, w1 as u64);
        }
    }

    /// Clear the bits `start..end`, then the summary bits of the words that became zero, level
    /// by level, stopping where nothing changes.
    #[inline]
    pub(crate) fn clear_range(&mut self, start: u64, end: u64) {
        debug_assert!(start < end && end <= self.len);
        let (mut a, mut b) = (start, end - 1); // inclusive bit range at this level
        for level in &mut self.levels {
            let (w0, w1) = ((a / 64) as usize, (b / 64) as usize);
            let (first, last) = (from_bit(a % 64), through_bit(b % 64));
            if w0 == w1 {
                level[w0] &= !(first & last);
                if level[w0] != 0 {
                    return;
                }
                (a, b) = (w0 as u64, w0 as u64);
            } else {
                level[w0] &= !first;
                level[w0 + 1..w1].fill(0);
                level[w1] &= !last;
                // The inner words are zero now; the end words only if nothing else is left.
                let lo = w0 as u64 + u64::from(level[w0] != 0);
                let hi = w1 as u64 - u64::from(level[w1] != 0);
                if lo > hi {
                    return;
                }
                (a, b) = (lo, hi);
            }
        }
    }

    /// Whether every bit of `start..end` is set (`start < end <= len`).
    pub(crate) fn all_set(&self, start: u64, end: u64) -> bool {
        self.none_after(start, end, |w| !w)
    }

    /// Whether every bit of `start..end` is clear (`start < end <= len`).
    pub(crate) fn all_clear(&self, start: u64, end: u64) -> bool {
        self.none_after(start, end, |w| w)
    }

    /// True when `f(word) & mask == 0` for every word of `start..end`, masked to the range.
    #[inline]
    fn none_after(&self, start: u64, end: u64, f: impl Fn(u64) -> u64) -> bool {
        debug_assert!(start < end && end <= self.len);
        let words = &self.levels[0];
        let (w0, w1) = ((start / 64) as usize, ((end - 1) / 64) as usize);
        let (first, last) = (from_bit(start % 64), through_bit((end - 1) % 64));
        if w0 == w1 {
            return f(words[w0]) & first & last == 0;
        }
        f(words[w0]) & first == 0
            && words[w0 + 1..w1].iter().all(|&w| f(w) == 0)
            && f(words[w1]) & last == 0
    }

    /// The first set bit at or after `from`, if any.
    #[inline]
    pub(crate) fn next_set(&self, from: u64) -> Option<u64> {
        let mut pos = from;
        let mut level = 0;
        // Up: find the first non-zero masked word at some level.
        loop {
            let words = self.levels.get(level)?;
            let w = (pos / 64) as usize;
            let word = *words.get(w)? & from_bit(pos % 64);
            if word != 0 {
                pos = w as u64 * 64 + u64::from(word.trailing_zeros());
                break;
            }
            // The next candidate word of this level is bit `w + 1` of the level above.
            pos = w as u64 + 1;
            level += 1;
        }
        // Down: the lowest set bit of each word the summary points at.
        while level > 0 {
            level -= 1;
            let word = self.levels[level][pos as usize];
            debug_assert_ne!(word, 0, "summary bit set over a zero word");
            pos = pos * 64 + u64::from(word.trailing_zeros());
        }
        Some(pos)
    }

    /// The last set bit before `before`, if any.
    #[inline]
    pub(crate) fn prev_set(&self, before: u64) -> Option<u64> {
        let mut end = before.min(self.len);
        let mut level = 0;
        loop {
            let words = self.levels.get(level)?;
            let idx = end.checked_sub(1)?;
            let w = (idx / 64) as usize;
            let word = words[w] & through_bit(idx % 64);
            if word != 0 {
                end = w as u64 * 64 + 63 - u64::from(word.leading_zeros());
                break;
            }
            end = w as u64;
            level += 1;
        }
        while level > 0 {
            level -= 1;
            let word = self.levels[level][end as usize];
            debug_assert_ne!(word, 0, "summary bit set over a zero word");
            end = end * 64 + 63 - u64::from(word.leading_zeros());
        }
        Some(end)
    }

    /// The first clear bit at or after `from` (below `len`), if any. A linear scan of level 0:
    /// for whole-bitmap walks, not for the hot path.
    pub(crate) fn next_clear(&self, from: u64) -> Option<u64> {
        if from >= self.len {
            return None;
        }
        let words = &self.levels[0];
        let mut w = (from / 64) as usize;
        let mut word = !words[w] & from_bit(from % 64);
        while word == 0 {
            w += 1;
            word = !*words.get(w)?;
        }
        let pos = w as u64 * 64 + u64::from(word.trailing_zeros());
        (pos < self.len).then_some(pos)
    }

    /// Number of set bits.
    pub(crate) fn count_ones(&self) -> u64 {
        self.levels[0].iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// Verify the summary levels and the clear padding; a description of the first mismatch.
    pub(crate) fn check(&self) -> Result<(), String> {
        let words0 = self.len.div_ceil(64).max(1);
        if self.levels[0].len() as u64 != words0 {
            return Err(format!("{} bits held in {} words", self.len, self.levels[0].len()));
        }
        if !self.len.is_multiple_of(64)
            && self.levels[0][words0 as usize - 1] & from_bit(self.len % 64) != 0
        {
            return Err(format!("padding bits past bit {} are set", self.len));
        }
        for (i, pair) in self.levels.windows(2).enumerate() {
            let (below, up) = (&pair[0], &pair[1]);
            if up.len() != below.len().div_ceil(64) {
                return Err(format!(
                    "summary level {} has {} words for {}",
                    i + 1,
                    up.len(),
                    below.len()
                ));
            }
            for (j, &word) in below.iter().enumerate() {
                if (up[j / 64] >> (j % 64) & 1 == 1) != (word != 0) {
                    return Err(format!("summary level {} bit {j} disagrees with word {j}", i + 1));
                }
            }
            let tail = below.len() % 64;
            if tail != 0 && up[up.len() - 1] & from_bit(tail as u64) != 0 {
                return Err(format!("summary level {} has padding bits set", i + 1));
            }
        }
        if self.levels.last().map(Vec::len) != Some(1) {
            return Err("the top level is not one word".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::LevelBits;

    /// Naive reference: one bool per bit.
    fn naive_next(bits: &[bool], from: u64) -> Option<u64> {
        (from as usize..bits.len()).find(|&i| bits[i]).map(|i| i as u64)
    }

    fn naive_prev(bits: &[bool], before: u64) -> Option<u64> {
        (0..(before as usize).min(bits.len())).rev().find(|&i| bits[i]).map(|i| i as u64)
    }

    fn arbitrary_ops() -> impl Strategy<Value = (u64, Vec<(bool, u64, u64)>)> {
        // Up to 3 levels: 64^2 < 9000.
        (1u64..9000).prop_flat_map(|len| {
            let op = (any::<bool>(), 0..len, 1u64..2000)
                .prop_map(move |(set, start, n)| (set, start, (start + n).min(len)));
            (Just(len), prop::collection::vec(op, 0..40))
        })
    }

    proptest! {
        #[test]
        fn level_bits_match_a_bool_per_bit((len, ops) in arbitrary_ops(), probes in prop::collection::vec(0u64..9100, 16)) {
            let mut sut = LevelBits::new(len);
            let mut naive = vec![false; len as usize];
            for (set, start, end) in ops {
                if set { sut.set_range(start, end) } else { sut.clear_range(start, end) }
                naive[start as usize..end as usize].fill(set);
                prop_assert_eq!(sut.check(), Ok(()));
                prop_assert_eq!(sut.all_set(start, end), set);
                prop_assert_eq!(sut.all_clear(start, end), !set);
            }
            prop_assert_eq!(sut.count_ones(), naive.iter().filter(|b| **b).count() as u64);
            for p in probes {
                prop_assert_eq!(sut.next_set(p), naive_next(&naive, p), "next_set({})", p);
                prop_assert_eq!(sut.prev_set(p), naive_prev(&naive, p), "prev_set({})", p);
                let clear = (p as usize..naive.len()).find(|&i| !naive[i]).map(|i| i as u64);
                prop_assert_eq!(sut.next_clear(p), clear, "next_clear({})", p);
                if p < len {
                    prop_assert_eq!(sut.get(p), naive[p as usize]);
                    let end = (p + 100).min(len);
                    let all = naive[p as usize..end as usize].iter().all(|b| *b);
                    let none = naive[p as usize..end as usize].iter().all(|b| !*b);
                    prop_assert_eq!(sut.all_set(p, end), all);
                    prop_assert_eq!(sut.all_clear(p, end), none);
                }
            }
            let rebuilt = LevelBits::from_words(len, sut.words().to_vec());
            prop_assert_eq!(rebuilt, sut);
        }
    }

    #[test]
    fn check_finds_a_stale_summary_bit() {
        let mut bits = LevelBits::new(200);
        bits.set_range(70, 71);
        assert_eq!(bits.check(), Ok(()));
        bits.levels[0][1] = 0; // bit 70 cleared behind the summary's back
        assert!(bits.check().unwrap_err().contains("summary level 1 bit 1"));
    }
}
