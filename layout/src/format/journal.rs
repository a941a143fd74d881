//! The journal: batches of records appended, in whole blocks, to the journal region.

use super::codec::{
    COMMON_HEADER_BYTES, Reader, Writer, check_crc, check_magic_and_version, corrupt, seal,
    truncated,
};
use super::record::{RECORD_HEADER_BYTES, RecordBody};
use super::superblock::check_block_bytes;
use super::{FORMAT_VERSION, JOURNAL_BATCH_MAGIC};
use crate::{Error, Result};

const WHAT: &str = "journal batch";
const WHAT_JOURNAL: &str = "journal";

/// Bytes of a batch header; the records follow it.
pub const JOURNAL_BATCH_HEADER_BYTES: usize = 48;

/// One decoded batch of the journal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalBatch {
    /// Byte offset of the batch in the journal region (0 from [`decode_journal_batch`]).
    pub offset: u64,
    /// Length on disk: header, records and padding, a multiple of the block size.
    pub len_bytes: u64,
    /// Sequence number of the first record; record `i` has `seq_first + i`.
    pub seq_first: u64,
    /// The records, in order.
    pub records: Vec<RecordBody>,
}

impl JournalBatch {
    /// One past the last record's sequence number: the `seq_first` the next batch must have.
    pub fn seq_end(&self) -> u64 {
        self.seq_first + self.records.len() as u64
    }

    /// The records with their sequence numbers.
    pub fn records_with_seq(&self) -> impl Iterator<Item = (u64, &RecordBody)> + '_ {
        (self.seq_first..).zip(&self.records)
    }
}

/// Encode a batch of records with sequence numbers `seq_first, seq_first + 1, ...`, padded with
/// zeros to whole blocks of `block_bytes`.
///
/// Layout: a [`JOURNAL_BATCH_HEADER_BYTES`]-byte header (magic, version, crc32c, `seq_first`,
/// record count, payload length), the records, zero padding; the crc covers every byte of the
/// padded batch. Sequence numbers start at 1 (0 means "no record" in a checkpoint).
///
/// Errors: `InvalidArgument` for an invalid block size, `seq_first == 0`, sequence numbers
/// that would pass `u64::MAX`, or an invalid record (see [`TensorRecord`](super::TensorRecord)).
pub fn encode_journal_batch(
    seq_first: u64,
    records: &[RecordBody],
    block_bytes: u32,
) -> Result<Vec<u8>> {
    check_block_bytes(block_bytes).map_err(Error::InvalidArgument)?;
    if seq_first == 0 {
        return Err(Error::InvalidArgument("journal sequence numbers start at 1".to_owned()));
    }
    let count = u32::try_from(records.len())
        .map_err(|_| Error::InvalidArgument(format!("{} records in one batch", records.len())))?;
    if seq_first.checked_add(u64::from(count)).is_none() {
        return Err(Error::InvalidArgument(format!(
            "{count} records from seq {seq_first} pass the largest sequence number"
        )));
    }
    let mut w = Writer::with_capacity(block_bytes as usize);
    w.header(JOURNAL_BATCH_MAGIC, FORMAT_VERSION);
    w.u64(seq_first);
    w.u32(count);
    w.u32(0); // reserved
    w.u64(0); // payload length, patched below
    w.u64(0); // reserved
    debug_assert_eq!(w.buf.len(), JOURNAL_BATCH_HEADER_BYTES);
    for r in records {
        r.write(&mut w)?;
    }
    let payload = (w.buf.len() - JOURNAL_BATCH_HEADER_BYTES) as u64;
    w.patch_u64(32, payload);
    w.pad_to(block_bytes as usize);
    seal(&mut w.buf);
    Ok(w.buf)
}

/// Decode the batch at the start of `bytes` (which may continue past it).
///
/// Errors: `BadMagic`, `UnsupportedVersion`, `ChecksumMismatch`, `Corruption` (truncated,
/// invalid records, non-zero reserved or padding bytes), `InvalidArgument` for an invalid
/// block size. Never panics; allocations are bounded by the input length.
pub fn decode_journal_batch(bytes: &[u8], block_bytes: u32) -> Result<JournalBatch> {
    check_block_bytes(block_bytes).map_err(Error::InvalidArgument)?;
    check_magic_and_version(bytes, WHAT, JOURNAL_BATCH_MAGIC, FORMAT_VERSION)?;
    let mut r = Reader::new(bytes, WHAT);
    r.skip(COMMON_HEADER_BYTES)?;
    let seq_first = r.u64()?;
    let count = r.u32()? as usize;
    r.reserved_u32("batch flags")?;
    let payload = r.u64()?;
    let reserved = r.u64()?;
    let room = bytes.len() - JOURNAL_BATCH_HEADER_BYTES;
    if payload > room as u64 {
        return Err(corrupt(
            WHAT,
            format!("truncated: payload of {payload} bytes, only {room} bytes follow the header"),
        ));
    }
    let payload = payload as usize;
    let len = (JOURNAL_BATCH_HEADER_BYTES + payload).div_ceil(block_bytes as usize)
        * block_bytes as usize;
    if len > bytes.len() {
        return Err(truncated(WHAT, len, bytes.len()));
    }
    let bytes = &bytes[..len];
    check_crc(bytes, WHAT)?;
    if reserved != 0 {
        return Err(corrupt(WHAT, format!("reserved header field is {reserved}")));
    }
    if seq_first == 0 || seq_first.checked_add(count as u64).is_none() {
        return Err(corrupt(
            WHAT,
            format!("{count} records from seq {seq_first} are outside 1..=u64::MAX"),
        ));
    }
    let payload_end = JOURNAL_BATCH_HEADER_BYTES + payload;
    let mut p = Reader::new(&bytes[JOURNAL_BATCH_HEADER_BYTES..payload_end], WHAT);
    if count.saturating_mul(RECORD_HEADER_BYTES) > payload {
        return Err(corrupt(WHAT, format!("{count} records cannot fit in {payload} bytes")));
    }
    let mut records = Vec::with_capacity(count);
    for _ in 0..count {
        records.push(RecordBody::read(&mut p)?);
    }
    p.finish()?;
    if bytes[payload_end..].iter().any(|&b| b != 0) {
        return Err(corrupt(WHAT, "padding after the records is not zero"));
    }
    Ok(JournalBatch { offset: 0, len_bytes: len as u64, seq_first, records })
}

/// Why [`scan_journal`] stopped. Every variant is a clean end of the journal: apart from
/// `End`, the scan has checked that no valid batch with the expected or a later sequence
/// number follows anywhere in the region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScanStop {
    /// The batches fill the region to its end (less than one block is left).
    End,
    /// The next block is all zeros: never written since the region was zeroed.
    Zeroed,
    /// The next block holds a valid batch whose `seq_first` is below the expected sequence
    /// number: left over from before the journal was last reset.
    Stale {
        /// The stale batch's first sequence number.
        seq_first: u64,
    },
    /// The next block does not hold a valid batch: a batch torn by a crash mid-append, or
    /// leftover bytes of an older batch.
    TornTail {
        /// Why the batch at `bytes_used` did not decode.
        error: Error,
    },
}

/// The result of [`scan_journal`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalScan {
    /// The valid batches, in order; their sequence numbers are consecutive.
    pub batches: Vec<JournalBatch>,
    /// Bytes of the region the batches occupy: where the next batch goes.
    pub bytes_used: u64,
    /// The sequence number the next record gets (the expected first seq if no batch was
    /// found).
    pub next_seq: u64,
    /// Why the scan stopped at `bytes_used`.
    pub stop: ScanStop,
}

impl JournalScan {
    /// Every record with its sequence number, in order.
    pub fn records(&self) -> impl Iterator<Item = (u64, &RecordBody)> + '_ {
        self.batches.iter().flat_map(JournalBatch::records_with_seq)
    }
}

/// Scan a journal region from its start.
///
/// `first_seq` is the sequence number the first batch must start with: the newest
/// checkpoint's `journal_seq + 1` (1 on a fresh array). Batches are read in order while each
/// is valid and starts exactly at the expected sequence number. The scan stops cleanly
/// ([`ScanStop`]) at the end of the region, at a zeroed block, at a valid batch with a lower
/// sequence number (stale), or at a block that is not a valid batch (torn tail). Before
/// stopping anywhere but the end, the rest of the region is searched, block by block, for a
/// valid batch whose `seq_first` is at least the expected sequence number: finding one means
/// records in the middle of the journal were lost (a damaged, zeroed or lost-write batch), and
/// the scan fails with `Corruption` instead.
///
/// Errors: `InvalidArgument` for an invalid block size; `Corruption` for lost records as
/// above, or a valid batch that skips sequence numbers. Never panics.
pub fn scan_journal(bytes: &[u8], block_bytes: u32, first_seq: u64) -> Result<JournalScan> {
    check_block_bytes(block_bytes).map_err(Error::InvalidArgument)?;
    let block = block_bytes as usize;
    let mut batches = Vec::new();
    let mut pos = 0usize;
    let mut expected = first_seq;
    let stop = loop {
        if bytes.len() - pos < block {
            // Nothing can follow the end of the region.
            break ScanStop::End;
        }
        let stop = if bytes[pos..pos + block].iter().all(|&b| b == 0) {
            ScanStop::Zeroed
        } else {
            match decode_journal_batch(&bytes[pos..], block_bytes) {
                Ok(batch) if batch.seq_first < expected => {
                    ScanStop::Stale { seq_first: batch.seq_first }
                }
                Ok(batch) if batch.seq_first > expected => {
                    return Err(corrupt(
                        WHAT_JOURNAL,
                        format!(
                            "batch at offset {pos} starts at seq {}, expected {expected}: records \
                             {expected}..{} are missing",
                            batch.seq_first, batch.seq_first
                        ),
                    ));
                }
                Ok(mut batch) => {
                    batch.offset = pos as u64;
                    expected = batch.seq_end();
                    pos += batch.len_bytes as usize;
                    batches.push(batch);
                    continue;
                }
                Err(error) => ScanStop::TornTail { error },
            }
        };
        // Nothing valid and newer may follow a clean end: if something does, the records of
        // the batch that stood at `pos` were lost.
        if let Some((at, seq)) = newer_batch_after(bytes, block_bytes, pos + block, expected) {
            let found = match &stop {
                ScanStop::Zeroed => "a zeroed block".to_owned(),
                ScanStop::Stale { seq_first } => format!("an older batch (seq {seq_first})"),
                ScanStop::TornTail { error } => format!("a damaged batch ({error})"),
                ScanStop::End => "the end of the region".to_owned(),
            };
            return Err(corrupt(
                WHAT_JOURNAL,
                format!(
                    "offset {pos} holds {found} where seq {expected} was expected, but a valid \
                     batch with seq {seq} follows at offset {at}: records were lost"
                ),
            ));
        }
        break stop;
    };
    Ok(JournalScan { batches, bytes_used: pos as u64, next_seq: expected, stop })
}

/// The first block-aligned offset at or after `from` holding a valid batch with
/// `seq_first >= expected`, with that seq.
fn newer_batch_after(
    bytes: &[u8],
    block_bytes: u32,
    from: usize,
    expected: u64,
) -> Option<(usize, u64)> {
    let magic = JOURNAL_BATCH_MAGIC.to_le_bytes();
    (from..bytes.len()).step_by(block_bytes as usize).find_map(|at| {
        if !bytes[at..].starts_with(&magic) {
            return None;
        }
        match decode_journal_batch(&bytes[at..], block_bytes) {
            Ok(b) if b.seq_first >= expected => Some((at, b.seq_first)),
            _ => None,
        }
    })
}
