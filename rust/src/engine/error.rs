//! One error type for the whole engine; the bindings map each variant to one Python exception.
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("corruption in {path} at offset {offset}: {reason}")]
    Corruption { path: PathBuf, offset: u64, reason: String },

    /// The keys are kept for the caller, out of the message: logs must not carry them (issue 34).
    #[error("cluster key mismatch: {path} belongs to another cluster than the key given")]
    ClusterKeyMismatch { path: PathBuf, expected: String, found: String },

    #[error("partition count mismatch: {path} has {found} partitions, expected {expected}")]
    PartitionCountMismatch { path: PathBuf, expected: i32, found: i32 },

    #[error("transaction id {got} does not continue partition {partition}: expected {expected}")]
    NonDenseAppend { partition: i32, expected: i64, got: i64 },

    #[error("record of {size} bytes exceeds the maximum record size of {max} bytes")]
    RecordTooLarge { size: usize, max: usize },

    #[error("transaction {txid} of partition {partition} is below the partition's first transaction id {first}")]
    BelowLogStart { partition: i32, txid: i64, first: i64 },

    #[error("an append to partition {partition} was cut by a truncation before it was acknowledged")]
    AppendTruncated { partition: i32 },

    #[error("partition {partition} refuses appends until it is reopened: {reason}")]
    PartitionFailed { partition: i32, reason: String },

    #[error("partition {partition} is not in this storage directory")]
    PartitionNotFound { partition: i32 },

    #[error("partition {partition} is out of range: the storage has {count} partitions")]
    PartitionOutOfRange { partition: i32, count: i32 },

    #[error("storage directory {path} is already initialised")]
    AlreadyExists { path: PathBuf },

    #[error("{path} is not a Waltz storage directory (no control file)")]
    NotInitialised { path: PathBuf },

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    #[error("partition {partition} is closed")]
    Closed { partition: i32 },

    #[error("the storage directory was opened read-only")]
    ReadOnly,

    #[error("{path} is in use by another process (or another open Storage in this one)")]
    Locked { path: PathBuf },

    #[error("storage {path} was closed")]
    StorageClosed { path: PathBuf },

    /// An invariant of the engine failed: a bug. The partition stops rather than write wrongly.
    #[error("internal invariant violated in partition {partition}: {what}")]
    Invariant { partition: i32, what: String },
}

pub type Result<T> = std::result::Result<T, Error>;

/// Attaches the file path to an I/O error so every message names the file it is about.
pub trait IoContext<T> {
    fn at(self, path: &std::path::Path) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn at(self, path: &std::path::Path) -> Result<T> {
        self.map_err(|source| Error::Io { path: path.to_path_buf(), source })
    }
}

impl Error {
    pub fn corruption(path: &std::path::Path, offset: u64, reason: impl Into<String>) -> Self {
        Error::Corruption { path: path.to_path_buf(), offset, reason: reason.into() }
    }
}
