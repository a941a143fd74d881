//! Tensor records and journal record bodies: the variable-length payloads of journal batches
//! and checkpoints. They carry no header of their own; the enclosing structure's crc covers
//! them.

use super::codec::{Reader, Writer, corrupt};
use crate::{Error, Extent, Extents, Lane, Result, StripeMap};

const WHAT: &str = "tensor record";
const WHAT_BODY: &str = "journal record";

/// Longest tensor name, in bytes of UTF-8.
pub const MAX_TENSOR_NAME_BYTES: usize = 4096;
/// Most lanes (devices) a stripe map may have on disk.
pub const MAX_STRIPE_LANES: usize = 4096;
/// Largest tensor size on disk: 2^62 bytes (keeps every size computation far from overflow).
pub const MAX_TENSOR_BYTES: u64 = 1 << 62;

/// Fixed part of an encoded tensor record (before name, lanes and checksums).
const TENSOR_FIXED_BYTES: usize = 48;
/// Encoded size of a lane with no extents.
const LANE_FIXED_BYTES: usize = 8;
/// Encoded size of an extent.
const EXTENT_BYTES: usize = 16;

/// What the store persists about one tensor: identity, placement and content checksums.
///
/// `size_bytes` must equal `stripe.size_bytes()`. Checksums: `checksum_chunk_bytes == 0` means
/// the tensor carries none (`checksums` empty); otherwise `checksums[i]` is the crc32c of bytes
/// `[i * chunk, min((i + 1) * chunk, size_bytes))` and there are exactly
/// `size_bytes.div_ceil(checksum_chunk_bytes)` of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorRecord {
    /// Tensor id, unique in the array.
    pub id: u64,
    /// Human-readable name (UTF-8, at most [`MAX_TENSOR_NAME_BYTES`] bytes).
    pub name: String,
    /// Size in bytes (equal to `stripe.size_bytes()`).
    pub size_bytes: u64,
    /// Where the tensor's bytes live.
    pub stripe: StripeMap,
    /// Bytes covered by each checksum; 0 when the tensor has no checksums.
    pub checksum_chunk_bytes: u64,
    /// crc32c of each chunk, in order.
    pub checksums: Vec<u32>,
}

impl TensorRecord {
    /// The checks [`TensorRecord::encode`] applies, as a message.
    fn check(&self) -> std::result::Result<(), String> {
        if self.size_bytes != self.stripe.size_bytes() {
            return Err(format!(
                "tensor {} size {} differs from its stripe map's {}",
                self.id,
                self.size_bytes,
                self.stripe.size_bytes()
            ));
        }
        if self.size_bytes > MAX_TENSOR_BYTES {
            return Err(format!(
                "tensor {} of {} bytes exceeds the largest size, {MAX_TENSOR_BYTES}",
                self.id, self.size_bytes
            ));
        }
        if self.stripe.extents().try_fold(0u64, |sum, (_, e)| sum.checked_add(e.len)).is_none() {
            return Err(format!("tensor {} extents add up to more than 2^64 bytes", self.id));
        }
        if self.name.len() > MAX_TENSOR_NAME_BYTES {
            return Err(format!(
                "tensor {} name is {} bytes, at most {MAX_TENSOR_NAME_BYTES}",
                self.id,
                self.name.len()
            ));
        }
        if self.stripe.lanes().len() > MAX_STRIPE_LANES {
            return Err(format!(
                "tensor {} has {} lanes, at most {MAX_STRIPE_LANES}",
                self.id,
                self.stripe.lanes().len()
            ));
        }
        if self.stripe.lanes().iter().any(|l| l.extents.len() > u32::MAX as usize) {
            return Err(format!("tensor {} has a lane with more than 2^32 - 1 extents", self.id));
        }
        let expected = match self.checksum_chunk_bytes {
            0 => 0,
            chunk => self.size_bytes.div_ceil(chunk),
        };
        if self.checksums.len() as u64 != expected {
            return Err(format!(
                "tensor {} has {} checksums, {expected} expected for {} bytes in chunks of {}",
                self.id,
                self.checksums.len(),
                self.size_bytes,
                self.checksum_chunk_bytes
            ));
        }
        Ok(())
    }

    /// Bytes of the encoding.
    fn encoded_len(&self) -> usize {
        let lanes: usize = self
            .stripe
            .lanes()
            .iter()
            .map(|l| LANE_FIXED_BYTES + EXTENT_BYTES * l.extents.len())
            .sum();
        TENSOR_FIXED_BYTES + self.name.len() + lanes + 4 * self.checksums.len()
    }

    pub(crate) fn write(&self, w: &mut Writer) -> Result<()> {
        self.check().map_err(Error::InvalidArgument)?;
        let map = &self.stripe;
        w.u64(self.id);
        w.u64(self.size_bytes);
        w.u64(self.checksum_chunk_bytes);
        w.u64(map.unit_bytes());
        w.u32(map.block_bytes());
        w.u32(self.name.len() as u32);
        w.u32(map.lanes().len() as u32);
        w.u32(self.checksums.len() as u32);
        w.bytes(self.name.as_bytes());
        for lane in map.lanes() {
            w.u32(lane.device);
            w.u32(lane.extents.len() as u32);
            for e in &lane.extents {
                w.u64(e.offset);
                w.u64(e.len);
            }
        }
        for c in &self.checksums {
            w.u32(*c);
        }
        Ok(())
    }

    /// Encode the record alone (the bytes journal and checkpoint payloads embed).
    ///
    /// Errors: `InvalidArgument` when the record breaks a rule of [`TensorRecord`] (size vs
    /// stripe map, name length, lane count, checksum count).
    pub fn encode(&self) -> Result<Vec<u8>> {
        let mut w = Writer::with_capacity(self.encoded_len());
        self.write(&mut w)?;
        Ok(w.buf)
    }

    /// Decode a record that occupies all of `bytes` (as written by [`TensorRecord::encode`]).
    ///
    /// The stripe map is rebuilt with [`StripeMap::new`], so it is validated. Errors:
    /// `Corruption` (truncated, trailing bytes, bad UTF-8, invalid stripe map, wrong checksum
    /// count). Never panics; allocations are bounded by the input length.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader::new(bytes, WHAT);
        let rec = Self::read(&mut r)?;
        r.finish()?;
        Ok(rec)
    }

    pub(crate) fn read(r: &mut Reader<'_>) -> Result<Self> {
        let id = r.u64()?;
        let size_bytes = r.u64()?;
        let checksum_chunk_bytes = r.u64()?;
        let unit_bytes = r.u64()?;
        let block_bytes = r.u32()?;
        let name_len = r.u32()? as usize;
        let lane_count = r.u32()? as usize;
        let checksum_count = r.u32()? as usize;
        if name_len > MAX_TENSOR_NAME_BYTES {
            return Err(corrupt(
                WHAT,
                format!("name of {name_len} bytes, at most {MAX_TENSOR_NAME_BYTES}"),
            ));
        }
        if lane_count > MAX_STRIPE_LANES {
            return Err(corrupt(WHAT, format!("{lane_count} lanes, at most {MAX_STRIPE_LANES}")));
        }
        let name = std::str::from_utf8(r.bytes(name_len)?)
            .map_err(|e| corrupt(WHAT, format!("tensor {id} name is not UTF-8: {e}")))?
            .to_owned();
        if lane_count.saturating_mul(LANE_FIXED_BYTES) > r.remaining() {
            return Err(corrupt(
                WHAT,
                format!("{lane_count} lanes cannot fit in {} bytes", r.remaining()),
            ));
        }
        let mut lanes = Vec::with_capacity(lane_count);
        let mut total_bytes: u64 = 0;
        for _ in 0..lane_count {
            let device = r.u32()?;
            let n = r.count("extent count", EXTENT_BYTES)?;
            // One extent (the common case) is held inline, with no heap block.
            let mut extents = Extents::new();
            for _ in 0..n {
                let e = Extent { offset: r.u64()?, len: r.u64()? };
                if e.offset.checked_add(e.len).is_none() {
                    return Err(corrupt(
                        WHAT,
                        format!("extent {e:?} on device {device} overflows"),
                    ));
                }
                total_bytes = total_bytes.checked_add(e.len).ok_or_else(|| {
                    corrupt(WHAT, format!("tensor {id} extents add up to more than 2^64 bytes"))
                })?;
                extents.push(e);
            }
            lanes.push(Lane { device, extents });
        }
        // StripeMap::new assumes the size fits its lanes before it checks each lane; check the
        // total first so that its arithmetic cannot overflow on hostile input.
        if size_bytes > total_bytes || size_bytes > MAX_TENSOR_BYTES {
            return Err(corrupt(
                WHAT,
                format!(
                    "tensor {id} of {size_bytes} bytes exceeds its {total_bytes} bytes of extents \
                     or the largest size, {MAX_TENSOR_BYTES}"
                ),
            ));
        }
        let stripe = StripeMap::new(size_bytes, unit_bytes, block_bytes, lanes)
            .map_err(|e| corrupt(WHAT, format!("tensor {id} has an invalid stripe map: {e}")))?;
        let expected = match checksum_chunk_bytes {
            0 => 0,
            chunk => size_bytes.div_ceil(chunk),
        };
        if checksum_count as u64 != expected {
            return Err(corrupt(
                WHAT,
                format!(
                    "tensor {id} has {checksum_count} checksums, {expected} expected for \
                     {size_bytes} bytes in chunks of {checksum_chunk_bytes}"
                ),
            ));
        }
        if checksum_count.saturating_mul(4) > r.remaining() {
            return Err(corrupt(
                WHAT,
                format!("{checksum_count} checksums cannot fit in {} bytes", r.remaining()),
            ));
        }
        let checksums = (0..checksum_count).map(|_| r.u32()).collect::<Result<Vec<_>>>()?;
        Ok(Self { id, name, size_bytes, stripe, checksum_chunk_bytes, checksums })
    }
}

/// One journal record: a change to the persistent tensor table.
#[derive(Debug, Clone, PartialEq, Eq)]
#[expect(
    clippy::large_enum_variant,
    reason = "a stripe map holds its first lanes in place (no heap block per map); most records \
              are puts, which boxing would only give one more heap block"
)]
pub enum RecordBody {
    /// Create or replace a tensor (its data is durable before this record is written).
    PutTensor(TensorRecord),
    /// Forget a tensor; its extents become free.
    DeleteTensor {
        /// The tensor's id.
        id: u64,
    },
    /// A checkpoint of `generation` was written to checkpoint slot `slot` (0 or 1).
    Checkpoint {
        /// The checkpoint's generation.
        generation: u64,
        /// The slot it was written to.
        slot: u32,
    },
}

/// Record kinds on disk.
const TAG_PUT_TENSOR: u32 = 1;
const TAG_DELETE_TENSOR: u32 = 2;
const TAG_CHECKPOINT: u32 = 3;
/// Bytes of a record's tag and length.
pub(crate) const RECORD_HEADER_BYTES: usize = 8;

impl RecordBody {
    /// Append `u32 tag, u32 body length, body`.
    pub(crate) fn write(&self, w: &mut Writer) -> Result<()> {
        let tag = match self {
            Self::PutTensor(_) => TAG_PUT_TENSOR,
            Self::DeleteTensor { .. } => TAG_DELETE_TENSOR,
            Self::Checkpoint { .. } => TAG_CHECKPOINT,
        };
        w.u32(tag);
        let len_at = w.buf.len();
        w.u32(0);
        let start = w.buf.len();
        match self {
            Self::PutTensor(t) => t.write(w)?,
            Self::DeleteTensor { id } => w.u64(*id),
            Self::Checkpoint { generation, slot } => {
                if *slot > 1 {
                    return Err(Error::InvalidArgument(format!(
                        "checkpoint slot {slot} (there are two: 0 and 1)"
                    )));
                }
                w.u64(*generation);
                w.u32(*slot);
                w.u32(0);
            }
        }
        let len = u32::try_from(w.buf.len() - start)
            .map_err(|_| Error::InvalidArgument("journal record longer than 4 GiB".to_owned()))?;
        w.patch_u32(len_at, len);
        Ok(())
    }

    /// Read one record (tag, length, body).
    pub(crate) fn read(r: &mut Reader<'_>) -> Result<Self> {
        let tag = r.u32()?;
        let len = r.u32()? as usize;
        let mut body = Reader::new(r.bytes(len)?, WHAT_BODY);
        let rec = match tag {
            TAG_PUT_TENSOR => Self::PutTensor(TensorRecord::read(&mut body)?),
            TAG_DELETE_TENSOR => Self::DeleteTensor { id: body.u64()? },
            TAG_CHECKPOINT => {
                let generation = body.u64()?;
                let slot = body.u32()?;
                body.reserved_u32("checkpoint record padding")?;
                if slot > 1 {
                    return Err(corrupt(
                        WHAT_BODY,
                        format!("checkpoint slot {slot} is not 0 or 1"),
                    ));
                }
                Self::Checkpoint { generation, slot }
            }
            other => return Err(corrupt(WHAT_BODY, format!("unknown record kind {other}"))),
        };
        body.finish()?;
        Ok(rec)
    }
}
