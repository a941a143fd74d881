//! Fault injection on a store's simulated disks (fault-injection tests and `teraio run --fault
//! corrupt`). Here, not in `backend::sim`: the disks know nothing of the store above them.

use std::sync::Arc;

use super::{TensorKey, TensorStore};
use crate::backend::sim::SimDisk;

impl TensorStore {
    /// Flip the bytes of the first block of tensor `id`'s SSD copy on `disks` (the disks of
    /// this store's array, in array order), as silent corruption on a drive would: the next
    /// read of the copy fails its checksum. Returns the device corrupted, or `None` when the
    /// tensor has no SSD copy.
    pub fn corrupt_ssd_copy(
        &self,
        disks: &[Arc<SimDisk>],
        id: impl Into<TensorKey>,
    ) -> Option<u32> {
        let id = id.into();
        let map = self.info(id)?.stripe_map?;
        let (device, extent) = map.extents().next()?;
        let disk = disks.get(device as usize)?;
        let len = extent.len.min(u64::from(disk.block_bytes())) as usize;
        let mut block = vec![0u8; len];
        disk.peek(extent.offset, &mut block);
        for b in &mut block {
            *b ^= 0xff;
        }
        disk.poke(extent.offset, &block);
        Some(device)
    }
}
