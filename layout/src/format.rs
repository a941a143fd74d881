//! On-disk format (superblock, metadata records). Filled in by the format work.
