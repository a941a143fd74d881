//! Byte sizes for people: `4k`, `1M`, `1.5G`, `1GiB` (powers of 1024, as fio reads them) in
//! configurations and on command lines.

use serde::{Deserialize, Serialize};

/// What a size looks like, for error messages.
pub const SIZE_FORM: &str = "a whole number of bytes (1048576) or a number with a unit k, M, G or T (powers of 1024; \
     decimals allowed: 64M, 1.5G)";

/// Parse `4096`, `4k`, `1M`, `1.5G`, `0.5M`, `1GiB`, `2T` (suffixes are powers of 1024;
/// `B`/`iB` optional; a decimal with a unit is rounded to the nearest byte). Zero, negative
/// numbers, fractions of a byte and overflow are errors that say what a size looks like.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let t = t.strip_suffix('B').or_else(|| t.strip_suffix('b')).unwrap_or(t);
    let t = t.strip_suffix('i').unwrap_or(t);
    let (num, mult) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 1 << 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 1 << 30),
        Some('t' | 'T') => (&t[..t.len() - 1], 1 << 40),
        _ => (t, 1),
    };
    let num = num.trim();
    if num.starts_with('-') {
        return Err(format!("{text:?} is negative: a size must be positive ({SIZE_FORM})"));
    }
    let too_large = || format!("{text:?} is too large for a size (at most 16 EiB)");
    let zero = || format!("{text:?} is zero: a size must be positive ({SIZE_FORM})");
    if let Ok(n) = num.parse::<u64>() {
        let v = n.checked_mul(mult).ok_or_else(too_large)?;
        return if v == 0 { Err(zero()) } else { Ok(v) };
    }
    // A decimal: "1.5G", "0.5M", ".25T". Only digits and one point (no exponents, no "inf").
    let decimal = !num.is_empty()
        && num.chars().all(|c| c.is_ascii_digit() || c == '.')
        && num.chars().filter(|&c| c == '.').count() == 1
        && num != ".";
    let not_a_size = || format!("{text:?} is not a size: write {SIZE_FORM}");
    if !decimal {
        return Err(not_a_size());
    }
    let x: f64 = num.parse().map_err(|_| not_a_size())?;
    let v = (x * mult as f64).round();
    if v >= u64::MAX as f64 {
        return Err(too_large());
    }
    if v < 1.0 {
        return Err(if x == 0.0 {
            zero()
        } else {
            format!("{text:?} is less than one byte: a size must be at least 1 ({SIZE_FORM})")
        });
    }
    if mult == 1 && v != x {
        return Err(format!(
            "{text:?} is a fraction of a byte: write whole bytes, or a unit ({SIZE_FORM})"
        ));
    }
    Ok(v as u64)
}

/// `bytes` as a size a configuration reads back, to two decimals: `64G`, `1.5G`, `50.29G`,
/// `4k`, `100` (below a KiB: bytes).
pub fn display_size(bytes: u64) -> String {
    let units = [(1u64 << 40, "T"), (1 << 30, "G"), (1 << 20, "M"), (1 << 10, "k")];
    for (mult, unit) in units {
        if bytes >= mult {
            let v = format!("{:.2}", bytes as f64 / mult as f64);
            let v = v.trim_end_matches('0').trim_end_matches('.');
            return format!("{v}{unit}");
        }
    }
    bytes.to_string()
}

/// A byte count that a configuration file may write as a number (`1048576`) or a string
/// (`"1M"`, `"1.5G"`, `"0"`). Serialized as a number. A negative number, a fraction of a byte or
/// a string that is not a size is an error that says what a size looks like (the
/// configuration's reader adds the key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize)]
#[serde(transparent)]
pub struct ByteSize(pub u64);

struct ByteSizeVisitor;

impl serde::de::Visitor<'_> for ByteSizeVisitor {
    type Value = ByteSize;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(SIZE_FORM)
    }

    fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<ByteSize, E> {
        Ok(ByteSize(n))
    }

    fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<ByteSize, E> {
        u64::try_from(n).map(ByteSize).map_err(|_| {
            E::custom(format!("{n} is negative: a size must be positive (or 0 where 0 means \"none\"); write {SIZE_FORM}"))
        })
    }

    fn visit_f64<E: serde::de::Error>(self, x: f64) -> Result<ByteSize, E> {
        if x < 0.0 {
            return Err(E::custom(format!(
                "{x} is negative: a size must be positive; write {SIZE_FORM}"
            )));
        }
        if x.fract() != 0.0 || !x.is_finite() || x >= u64::MAX as f64 {
            return Err(E::custom(format!(
                "{x} is not a whole number of bytes; write {SIZE_FORM} (as a string: \"1.5G\")"
            )));
        }
        Ok(ByteSize(x as u64))
    }

    fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<ByteSize, E> {
        if s.trim() == "0" {
            return Ok(ByteSize(0));
        }
        parse_bytes(s).map(ByteSize).map_err(E::custom)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ByteSizeVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("4k"), Ok(4096));
        assert_eq!(parse_bytes("1M"), Ok(1 << 20));
        assert_eq!(parse_bytes(" 3GiB "), Ok(3 << 30));
        assert_eq!(parse_bytes("2T"), Ok(2 << 40));
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("99999999T").is_err());
        assert!(parse_bytes("").is_err());
    }

    #[test]
    fn decimal_sizes_are_sizes() {
        assert_eq!(parse_bytes("1.5G"), Ok(3 << 29));
        assert_eq!(parse_bytes("0.5M"), Ok(512 << 10));
        assert_eq!(parse_bytes(".25T"), Ok(256 << 30));
        assert_eq!(parse_bytes("1.5 GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("0.1k"), Ok(102), "rounded to the nearest byte");
        assert_eq!(parse_bytes("2.0"), Ok(2));
        for bad in ["1.5", "1..5G", "1.5.0G", ".G", "1e3", "inf", "NaN", "0.0G", "0.0001k"] {
            let e = parse_bytes(bad).unwrap_err();
            assert!(e.contains(bad) && e.contains("1.5G"), "{bad}: {e}");
        }
        let e = parse_bytes("-1").unwrap_err();
        assert!(e.contains("-1") && e.contains("negative") && e.contains("positive"), "{e}");
        let e = parse_bytes("-1.5G").unwrap_err();
        assert!(e.contains("negative"), "{e}");
    }

    #[test]
    fn sizes_display_as_they_are_written() {
        assert_eq!(display_size(64 << 30), "64G");
        assert_eq!(display_size(3 << 29), "1.5G");
        assert_eq!(display_size(4096), "4k");
        assert_eq!(display_size(100), "100");
        assert_eq!(parse_bytes(&display_size(3 << 29)), Ok(3 << 29));
    }

    #[test]
    fn byte_sizes_read_numbers_and_strings() {
        let v: Vec<ByteSize> =
            serde_json::from_str(r#"[5, "1k", "0", "1.5G", 4096.0, 0]"#).unwrap();
        assert_eq!(
            v,
            vec![
                ByteSize(5),
                ByteSize(1024),
                ByteSize(0),
                ByteSize(3 << 29),
                ByteSize(4096),
                ByteSize(0)
            ]
        );
        let e = serde_json::from_str::<ByteSize>(r#""x""#).unwrap_err().to_string();
        assert!(e.contains("\"x\" is not a size"), "{e}");
        let e = serde_json::from_str::<ByteSize>("-1").unwrap_err().to_string();
        assert!(e.contains("-1 is negative") && e.contains("positive"), "{e}");
        assert!(!e.contains("untagged"), "{e}");
        let e = serde_json::from_str::<ByteSize>("1.5").unwrap_err().to_string();
        assert!(e.contains("whole number of bytes"), "{e}");
        let e = serde_json::from_str::<ByteSize>("true").unwrap_err().to_string();
        assert!(e.contains("1.5G"), "what a size looks like: {e}");
        let t: std::collections::BTreeMap<String, ByteSize> =
            toml::from_str("a = \"1.5G\"\nb = 7\n").unwrap();
        assert_eq!(t["a"], ByteSize(3 << 29));
        assert_eq!(t["b"], ByteSize(7));
        assert!(
            toml::from_str::<std::collections::BTreeMap<String, ByteSize>>("a = -1\n").is_err()
        );
    }
}
