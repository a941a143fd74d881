//! Byte sizes for people: `4k`, `1M`, `1GiB` (powers of 1024, as fio reads them) in
//! configurations and on command lines.

use serde::{Deserialize, Serialize};

/// Parse `4096`, `4k`, `1M`, `1G`, `1GiB`, `2T` (suffixes are powers of 1024; `B`/`iB`
/// optional). Zero and overflow are errors.
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
    let n: u64 =
        num.trim().parse().map_err(|_| format!("{text:?} is not a size (e.g. 4k, 1M, 1G)"))?;
    n.checked_mul(mult).filter(|&v| v > 0).ok_or_else(|| format!("{text:?} is zero or too large"))
}

/// A byte count that a configuration file may write as a number (`1048576`) or a string
/// (`"1M"`, `"0"`). Serialized as a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize)]
#[serde(transparent)]
pub struct ByteSize(pub u64);

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(n) => Ok(ByteSize(n)),
            Raw::Text(s) if s.trim() == "0" => Ok(ByteSize(0)),
            Raw::Text(s) => parse_bytes(&s).map(ByteSize).map_err(serde::de::Error::custom),
        }
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
        assert!(parse_bytes("1.5G").is_err());
        assert!(parse_bytes("99999999T").is_err());
        assert!(parse_bytes("").is_err());
    }

    #[test]
    fn byte_sizes_read_numbers_and_strings() {
        let v: Vec<ByteSize> = serde_json::from_str(r#"[5, "1k", "0"]"#).unwrap();
        assert_eq!(v, vec![ByteSize(5), ByteSize(1024), ByteSize(0)]);
        assert!(serde_json::from_str::<ByteSize>(r#""x""#).is_err());
        assert!(serde_json::from_str::<ByteSize>("-1").is_err());
    }
}
