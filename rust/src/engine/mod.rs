//! The storage engine: the on-disk format (records, segments, index, control file), the
//! partition's append and recovery, and the file-system seam faults are injected through.
pub mod batch;
pub mod clock;
pub mod control;
pub mod crc;
pub mod error;
pub mod format;
pub mod fs;
pub mod index;
pub mod inspect;
pub mod partition;
pub mod record;
pub mod retention;
pub mod segment;
pub mod storage;
