//! What both ports' connections share: the node's state and options, how long a connection may
//! wait before its Open and between reads and writes, its frame size limit, reading and sending
//! frames, and how an engine error is answered. The storage port (`server`) and the admin port
//! (`admin`) both use it; it uses neither.
use crate::engine::error::Error;
use crate::engine::storage::Storage;
use crate::node::protocol::{FailureKind, FrameBuf};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};

#[derive(Clone, Debug)]
pub struct NodeOptions {
    pub max_frame: usize,
    /// Upper bounds a record or header list response never exceeds, whatever is asked.
    pub max_list_count: usize,
    pub max_list_bytes: usize,
    /// An admin connection that sends nothing for this long is closed, and so is any connection
    /// that reads none of its answers for this long. An opened storage connection may stay silent
    /// (TCP keepalive finds a peer that is gone); one not opened has at most `OPEN_DEADLINE`.
    pub idle_timeout: Duration,
    /// Appends of one connection queued before the node waits for their sync and answers them.
    pub max_in_flight: usize,
    /// Mutual TLS on both ports (`crate::node::tls::server_config`); None serves plaintext.
    pub tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
    /// Connections open at once on each port; one more is closed as soon as it is accepted.
    /// A storage connection costs a thread and three file descriptors.
    pub max_connections: usize,
    /// How often the retention thread applies the standing orders (`node::retention`).
    pub retention_interval: Duration,
    /// Bytes per second retention frees at most (None: unpaced), so that appends' fdatasyncs do
    /// not queue behind the journal work of a large deletion (`Partition::drop_segments_paced`).
    pub retention_rate: Option<u64>,
    /// Per-role shared secrets a peer must give in its Hello (empty: none asked).
    pub role_secrets: crate::node::secrets::RoleSecrets,
}

/// Retention's default freeing rate: well above what a node ingests on one disk, low enough
/// that a large deletion leaves the appends' p99 alone (docs/performance.md, "Retention").
pub const DEFAULT_RETENTION_RATE: u64 = 64 << 20;

impl Default for NodeOptions {
    fn default() -> Self {
        NodeOptions {
            max_frame: crate::node::protocol::DEFAULT_MAX_FRAME,
            max_list_count: 10_000,
            max_list_bytes: 16 << 20,
            idle_timeout: Duration::from_secs(300),
            max_in_flight: 1024,
            tls: None,
            max_connections: 4096,
            retention_interval: Duration::from_secs(1),
            retention_rate: Some(DEFAULT_RETENTION_RATE),
            role_secrets: Default::default(),
        }
    }
}

#[derive(Default, Debug)]
pub struct NodeStats {
    pub connections: AtomicU64,
    pub requests: AtomicU64,
    pub failures: AtomicU64,
    pub closed_bad_frames: AtomicU64,
    pub appended_records: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub tls_handshake_failures: AtomicU64,
    /// TLS peers refused after the handshake: their certificate has no role the port admits.
    pub tls_role_refusals: AtomicU64,
    /// Peers refused at Hello: no role secret, a wrong one, or one of a role the port does not admit.
    pub secret_refusals: AtomicU64,
    /// Requests refused because the peer did not prove the role they need (a storage-port
    /// Restart Log from anyone but a server).
    pub role_request_refusals: AtomicU64,
    /// Connections closed on accept because `max_connections` were open on their port.
    pub refused_connections: AtomicU64,
    /// Failures answered, indexed by FailureKind code.
    pub failures_by_kind: [AtomicU64; 18],
}

pub(super) struct Shared {
    pub(super) storage: Arc<Storage>,
    pub(super) opts: NodeOptions,
    /// Newest session id seen per partition.
    pub(super) fences: Mutex<HashMap<i32, i64>>,
    /// (readable, writable) per partition, set through the admin port; absent means both.
    pub(super) availability: Mutex<HashMap<i32, (bool, bool)>>,
    pub(super) stats: NodeStats,
    /// Set once the node stops: every connection thread ends at its next wait.
    pub(super) stopping: tokio::sync::watch::Sender<bool>,
    /// Connection threads still running, for `stop` to wait on.
    pub(super) live: (Mutex<usize>, std::sync::Condvar),
    /// Connections open on the storage and on the admin port, against `max_connections`.
    pub(super) storage_open: Arc<AtomicUsize>,
    pub(super) admin_open: Arc<AtomicUsize>,
    /// Connections not opened yet (TLS handshake, Hello, Open) on each port, against their own cap.
    pub(super) storage_unopened: Arc<AtomicUsize>,
    pub(super) admin_unopened: Arc<AtomicUsize>,
    /// Connections refused since the last warning about them, and when that was.
    pub(super) refused: Mutex<(u64, Option<Instant>)>,
    /// The store sessions' retention orders and the deletion thread's stop signal.
    pub(super) retention: crate::node::retention::Retention,
}

/// A connection's place among its port's `max_connections` (or its unopened
/// connections), given back when it ends, however.
pub(super) struct Slot(pub(super) Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a peer proved about its role: the roles its TLS certificate carries (none in plaintext
/// mode), and the role whose secret it gave in its Hello.
#[derive(Clone, Debug, Default)]
pub(super) struct PeerRole {
    pub(super) roles: Vec<String>,
    /// Why the port does not admit the peer's certificate: its Hello is answered with a Failure
    /// saying so, then the connection closes (a silent close left readers retrying for their
    /// whole timeout, unable to tell a refusal from a connection limit).
    pub(super) refused: Option<String>,
}

/// Checks a Hello's credential against the node's role secrets (`crate::node::secrets`); on a
/// refusal, counts and warns, and gives the message for the peer. The proven role is added to
/// `role`.
pub(super) fn check_credential(
    shared: &Shared,
    port: &str,
    peer: std::net::SocketAddr,
    credential: Option<&crate::node::protocol::Credential>,
    role: &mut PeerRole,
) -> Result<(), String> {
    if let Some(why) = &role.refused {
        return Err(why.clone()); // counted and logged at the handshake
    }
    match shared.opts.role_secrets.check(credential, crate::node::tls::NODE_PORT_ROLES) {
        Ok(proven) => {
            role.roles.extend(proven);
            Ok(())
        }
        Err(why) => {
            shared.stats.secret_refusals.fetch_add(1, Ordering::Relaxed);
            log::warn!("{port} connection from {peer} refused at Hello: {why}");
            Err(why)
        }
    }
}

impl PeerRole {
    /// The roles a TLS peer's leaf certificate carries.
    pub(super) fn of_certificates(certs: Option<&[rustls_pki_types::CertificateDer<'_>]>) -> PeerRole {
        PeerRole {
            roles: certs.and_then(|c| c.first()).map(crate::node::tls::roles).unwrap_or_default(),
            refused: crate::node::tls::refuse_role(certs, crate::node::tls::NODE_PORT_ROLES),
        }
    }

    pub(super) fn is_admin(&self) -> bool {
        self.roles.iter().any(|r| r == "admin")
    }

    pub(super) fn is(&self, role: &str) -> bool {
        self.roles.iter().any(|r| r == role)
    }
}

pub(super) fn failure_kind(e: &Error) -> FailureKind {
    match e {
        Error::ClusterKeyMismatch { .. } => FailureKind::ClusterKeyMismatch,
        Error::PartitionCountMismatch { .. } => FailureKind::PartitionCountMismatch,
        Error::NonDenseAppend { .. } => FailureKind::NonDenseAppend,
        Error::RecordTooLarge { .. } => FailureKind::RecordTooLarge,
        Error::BelowLogStart { .. } => FailureKind::BelowLogStart,
        Error::PartitionFailed { .. } => FailureKind::PartitionFailed,
        Error::AppendTruncated { .. } => FailureKind::AppendTruncated,
        Error::PartitionNotFound { .. } | Error::PartitionOutOfRange { .. } => FailureKind::PartitionNotAssigned,
        Error::Corruption { .. } => FailureKind::Corruption,
        Error::Io { .. } => FailureKind::Io,
        Error::InvalidArgument(_) => FailureKind::BadRequest,
        _ => FailureKind::Internal,
    }
}

/// A peer must have sent Hello and an Open that succeeded within this (or `idle_timeout`, when
/// shorter), else it is closed: a connection costs a thread and file descriptors, and a flood of
/// silent ones ran the node out of descriptors until a segment roll failed.
const OPEN_DEADLINE: Duration = Duration::from_secs(10);

/// Largest frame taken before Open succeeded (Hello and Open are a few dozen bytes): a peer that
/// proved nothing yet must not make the node buffer `max_frame` bytes.
const PRE_OPEN_MAX_FRAME: usize = 64 << 10;

/// What a connection's next read (and the write before it) may wait for.
#[derive(Clone, Copy)]
pub(super) enum Wait {
    /// Not opened yet: every wait ends at this instant (`OPEN_DEADLINE`).
    OpenBy(tokio::time::Instant),
    /// An opened admin connection: reads wait `idle_timeout` at most.
    Idle,
    /// An opened storage connection: silence is a quiet partition, not a dead peer (keepalive
    /// finds those). Closing it cost the store session its replicas at its next append.
    Forever,
}

/// A connection's Hello must have arrived this soon after it was accepted (or its TLS handshake
/// ended): clients send it at once, and silent connections held a thread each for the whole
/// `OPEN_DEADLINE`, filling `max_connections` without any key (issue 34).
const HELLO_DEADLINE: Duration = Duration::from_secs(2);

fn open_deadline(shared: &Shared) -> Duration {
    OPEN_DEADLINE.min(shared.opts.idle_timeout)
}

/// When a connection accepted now must have sent its Hello, and its successful Open.
pub(super) fn greet_and_open_deadlines(shared: &Shared) -> (tokio::time::Instant, tokio::time::Instant) {
    let now = tokio::time::Instant::now();
    let open_by = now + open_deadline(shared);
    (open_by.min(now + HELLO_DEADLINE), open_by)
}

fn not_opened(shared: &Shared) -> String {
    format!("no Hello within {HELLO_DEADLINE:?} or no successful Open within {:?}", open_deadline(shared))
}

/// The frame size limit of a connection opened or not.
pub(super) fn frame_limit(shared: &Shared, opened: bool) -> usize {
    if opened {
        shared.opts.max_frame
    } else {
        PRE_OPEN_MAX_FRAME.min(shared.opts.max_frame)
    }
}

/// Why the bytes in `buf` are not a frame: a TLS client on this plaintext port gets a reason
/// that says so rather than a frame length.
pub(super) fn bad_frame(what: &str, buf: &[u8], e: impl std::fmt::Display) -> String {
    if crate::node::tls::looks_like_client_hello(buf) {
        format!("{what}: the client speaks TLS but this node has no [tls] configured")
    } else {
        format!("{what}: {e}")
    }
}

/// Sends the gathered answers. A peer that takes nothing for the idle timeout is gone or
/// hostile; one not opened yet has until its Open deadline. The timeout runs from the last bytes
/// the peer took, not from the start: a slow reader that keeps reading gets a whole list. The
/// flush is free on TCP; TLS may hold encrypted bytes back until it.
pub(super) async fn send<S: AsyncWrite + Unpin>(
    stream: &mut S,
    out: &mut Vec<u8>,
    shared: &Shared,
    wait: Wait,
) -> Result<(), String> {
    if out.is_empty() {
        return Ok(());
    }
    let idle = shared.opts.idle_timeout;
    let next_deadline = || match wait {
        Wait::OpenBy(t) => t,
        Wait::Idle | Wait::Forever => tokio::time::Instant::now() + idle,
    };
    let why = || match wait {
        Wait::OpenBy(_) => not_opened(shared),
        Wait::Idle | Wait::Forever => format!("it read nothing for {idle:?}"),
    };
    let mut sent = 0;
    let r = loop {
        if sent == out.len() {
            break match tokio::time::timeout_at(next_deadline(), stream.flush()).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(_)) => Err(String::new()),
                Err(_) => Err(why()),
            };
        }
        match tokio::time::timeout_at(next_deadline(), stream.write(&out[sent..])).await {
            Ok(Ok(0)) | Ok(Err(_)) => break Err(String::new()), // the peer went away: nothing to warn about
            Ok(Ok(n)) => sent += n,
            Err(_) => break Err(why()),
        }
    };
    out.clear();
    r
}

/// Appends what the peer sends next to `buf`. Err ends the connection: an empty reason for a
/// clean close, else why (a read error, or a wait `wait` does not allow).
pub(super) async fn read_more(
    rd: &mut (impl AsyncReadExt + Unpin),
    buf: &mut FrameBuf,
    shared: &Shared,
    wait: Wait,
) -> Result<(), String> {
    // Straight into the buffer's spare room: a zeroed 64 KiB stack chunk per read, copied over,
    // cost a memset and a copy per request.
    let buf = buf.writable();
    buf.reserve(64 << 10);
    let read = rd.read_buf(buf);
    let idle = shared.opts.idle_timeout;
    let r = match wait {
        Wait::OpenBy(t) => tokio::time::timeout_at(t, read).await.map_err(|_| not_opened(shared))?,
        Wait::Idle => tokio::time::timeout(idle, read).await.map_err(|_| format!("idle for {idle:?}"))?,
        Wait::Forever => read.await,
    };
    match r {
        Ok(0) => Err(String::new()),
        Ok(n) => {
            shared.stats.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
            Ok(())
        }
        Err(e) => Err(format!("read failed: {e}")),
    }
}
