//! The storage node's network loop: the storage and admin protocols over TCP on tokio, outside
//! Python, so storage work never waits on the GIL.
//!
//! Each storage-protocol connection is served on a thread of its own (a single-threaded runtime):
//! it decodes the frames that arrived, queues their appends into the partition in arrival order,
//! then waits on that same thread for the one fdatasync that covers them all, and answers them in
//! order with one write. No request crosses to another thread on its way, which a tokio worker
//! handing each append's wait to the blocking pool and back cost (two thread wake-ups and about
//! a third of the node's CPU per append; `docs/performance.md`). The connections of one
//! partition are few (one per store session and replica), so threads stay few too. Truncate and
//! Set Low-water Mark finish before the next request is read.
//!
//! With TLS configured, both ports accept only mutual TLS: a connection is served once its
//! handshake (client certificate checked against the CA) succeeded; a failed one is logged and
//! dropped on its own task, so it never holds up the accept loop or another connection.
//!
//! Fencing: each partition remembers the newest session id seen; a request with an older one
//! fails as stale. The fence starts, after a restart, from the session recorded in the control
//! file, which every store session writes first (Set Low-water Mark).
use super::admin::serve_admin;
use super::connection::{
    bad_frame, check_credential, failure_kind, frame_limit, greet_and_open_deadlines, read_more, send, PeerRole,
    Shared, Slot, Wait,
};
pub use super::connection::{NodeOptions, NodeStats};
use crate::engine::error::Error;
use crate::engine::partition::{lock, Partition};
use crate::engine::record::NewRecord;
use crate::engine::storage::Storage;
use crate::node::protocol::{
    split_frame, FailureKind, FrameBuf, MsgHeader, Request, Response, WireRecord, MAGIC_STORAGE, VERSION,
};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

pub struct NodeHandle {
    pub addr: SocketAddr,
    pub admin_addr: Option<SocketAddr>,
    shared: Arc<Shared>,
    shutdown: Arc<Notify>,
    thread: Option<std::thread::JoinHandle<()>>,
    retention: Option<std::thread::JoinHandle<()>>,
}

impl NodeHandle {
    pub fn stats(&self) -> &NodeStats {
        &self.shared.stats
    }

    /// Stops accepting, closes connections and waits for the runtime to wind down.
    pub fn stop(&mut self) {
        self.shutdown.notify_one();
        self.shared.retention.stop();
        if let Some(t) = self.retention.take() {
            let _ = t.join();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for NodeHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Starts serving the storage protocol on `bind` and, when given, the admin protocol on
/// `admin_bind` (host:port; port 0 picks a free one).
pub fn start(
    storage: Arc<Storage>,
    bind: &str,
    admin_bind: Option<&str>,
    opts: NodeOptions,
) -> std::io::Result<NodeHandle> {
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name("waltz-node").enable_all().build()?;
    let listener = rt.block_on(TcpListener::bind(bind))?;
    let addr = listener.local_addr()?;
    let admin = match admin_bind {
        Some(b) => Some(rt.block_on(TcpListener::bind(b))?),
        None => None,
    };
    let admin_addr = admin.as_ref().map(|l| l.local_addr()).transpose()?;
    let shared = Arc::new(Shared {
        storage,
        opts,
        fences: Mutex::new(HashMap::new()),
        availability: Mutex::new(HashMap::new()),
        stats: NodeStats::default(),
        stopping: tokio::sync::watch::channel(false).0,
        live: (Mutex::new(0), std::sync::Condvar::new()),
        storage_open: Arc::default(),
        storage_unopened: Arc::default(),
        admin_open: Arc::default(),
        admin_unopened: Arc::default(),
        refused: Mutex::new((0, None)),
        retention: Default::default(),
    });
    let retention = Some(crate::node::retention::spawn(&shared, shared.opts.retention_interval)?);
    let shutdown = Arc::new(Notify::new());
    let (sh, stop, conns) = (shared.clone(), shutdown.clone(), shared.clone());
    let acceptor = shared.opts.tls.clone().map(crate::node::tls::TlsAcceptor::from);
    let thread = std::thread::Builder::new().name("waltz-node-accept".into()).spawn(move || {
        rt.block_on(async move {
            let admin_accept = async {
                match admin {
                    Some(l) => loop {
                        match l.accept().await {
                            Ok((stream, peer)) => {
                                let Some(slot) = admit(&sh, &stream, peer, "admin", &sh.admin_open) else { continue };
                                let Some(unopened) = admit_unopened(&sh, peer, "admin", &sh.admin_unopened) else {
                                    continue;
                                };
                                let sh = sh.clone();
                                match acceptor.clone() {
                                    None => tokio::spawn(async move {
                                        let _slot = slot;
                                        serve_admin(stream, peer, sh, unopened, PeerRole::default()).await
                                    }),
                                    Some(a) => tokio::spawn(async move {
                                        let _slot = slot;
                                        if let Some((s, role)) = handshake(&a, stream, peer, "admin", &sh).await {
                                            serve_admin(s, peer, sh, unopened, role).await;
                                        }
                                    }),
                                };
                            }
                            Err(e) => {
                                log::warn!("admin accept failed: {e}");
                                tokio::time::sleep(Duration::from_millis(100)).await;
                            }
                        }
                    },
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::pin!(admin_accept);
            loop {
                tokio::select! {
                    _ = stop.notified() => break,
                    _ = &mut admin_accept => {}
                    accepted = listener.accept() => match accepted {
                        Ok((stream, peer)) => {
                            sh.stats.connections.fetch_add(1, Ordering::Relaxed);
                            let Some(slot) = admit(&sh, &stream, peer, "storage", &sh.storage_open) else { continue };
                            let Some(unopened) = admit_unopened(&sh, peer, "storage", &sh.storage_unopened) else {
                                continue;
                            };
                            let _ = stream.set_nodelay(true);
                            serve_on_own_thread(stream, peer, sh.clone(), acceptor.clone(), (slot, unopened));
                        }
                        Err(e) => {
                            // Out of file descriptors, say: back off instead of spinning.
                            log::warn!("accept failed: {e}");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    },
                }
            }
        });
        // Connection threads finish the fsync they are in (appends already queued) and end.
        stop_connections(&conns, Duration::from_secs(10));
        rt.shutdown_timeout(Duration::from_secs(10));
    })?;
    Ok(NodeHandle { addr, admin_addr, shared, shutdown, thread: Some(thread), retention })
}

fn fail(h: MsgHeader, kind: FailureKind, message: impl Into<String>) -> Response {
    Response::Failure { h, kind, message: message.into() }
}

fn count_response(stats: &NodeStats, bytes: &[u8]) {
    stats.bytes_out.fetch_add(bytes.len() as u64, Ordering::Relaxed);
    // Frame type is at offset 7; a Failure's kind follows its 20-byte message header.
    if bytes.len() > 30 && bytes[7] == crate::node::protocol::msg::FAILURE {
        let kind = u16::from_be_bytes([bytes[28], bytes[29]]) as usize;
        stats.failures.fetch_add(1, Ordering::Relaxed);
        if let Some(c) = stats.failures_by_kind.get(kind) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn encoded(r: &Response) -> Vec<u8> {
    let mut b = Vec::new();
    r.encode(&mut b);
    b
}

/// A request's answer as `handle` gives it: bytes to send, or an append queued into its
/// partition that may be acknowledged once the partition's syncs cover `seq`.
enum Answer {
    Now(Vec<u8>),
    Durable { h: MsgHeader, part: Arc<Partition>, seq: u64 },
}

fn now(r: Response) -> Answer {
    Answer::Now(encoded(&r))
}

/// A panic in engine work becomes an Internal failure of request `h` instead of ending the
/// connection's thread.
fn guarded(h: MsgHeader, f: impl FnOnce() -> Response) -> Response {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|_| fail(h, FailureKind::Internal, "request task panicked"))
}

/// Runs engine work (reads, truncation, marks) right here, on the connection's own thread.
fn blocking(shared: &Arc<Shared>, h: MsgHeader, f: impl FnOnce(&Shared) -> Response) -> Answer {
    now(guarded(h, || f(shared)))
}

/// The acknowledgement of a queued append: waits (blocking this connection's thread) until a sync
/// covers it. Durable is not enough to acknowledge: if a newer session was served meanwhile (its
/// recovery may have read the log without this batch), the old session must not count this
/// replica, so the answer is StaleSession.
fn settle(shared: &Shared, answer: Answer) -> Vec<u8> {
    match answer {
        Answer::Now(bytes) => bytes,
        Answer::Durable { h, part, seq } => encoded(&guarded(h, || match part.wait_durable_now(seq) {
            Ok(()) => gated(&shared.storage, h, || Response::Success { h }),
            Err(e) => fail(h, failure_kind(&e), e.to_string()),
        })),
    }
}

/// StaleSession if a session newer than the request's has been seen; call it holding the
/// partition's fence gate (shared), so the answer stays true until the gate is released.
fn fenced_out(storage: &Storage, h: MsgHeader) -> Option<Response> {
    match storage.fence(h.partition_id) {
        Ok(newest) if newest > h.session_id => Some(stale(h, newest)),
        Ok(_) => None,
        Err(e) => Some(fail(h, failure_kind(&e), e.to_string())),
    }
}

/// Runs a mutation under the partition's fence gate, after checking the session is current.
fn gated(storage: &Storage, h: MsgHeader, f: impl FnOnce() -> Response) -> Response {
    let gate = storage.fence_gate(h.partition_id);
    let _shared = gate.read().unwrap_or_else(|e| e.into_inner());
    fenced_out(storage, h).unwrap_or_else(f)
}

/// `gated` for a server's Truncate or Set Low-water Mark: refused, too, when an admin marked the
/// partition not writable. Checked under the gate, which Set Availability takes exclusively, so
/// none of them passes the check before that answer and runs after it (recover-partition's copy).
fn gated_mutation(shared: &Shared, h: MsgHeader, f: impl FnOnce() -> Response) -> Response {
    gated(&shared.storage, h, || not_writable(shared, h).unwrap_or_else(f))
}

/// Answers gathered beyond this many bytes are sent before the next request is handled: a peer
/// that pipelines record-list reads holds at most one list (up to `max_list_bytes`) plus this.
const FLUSH_BYTES: usize = 1 << 20;

/// A slow or silent peer may hold a task this long, never more, before its handshake is given up.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Probes a connection that has been silent a minute, so a storage connection (never closed for
/// silence once opened) of a peer that vanished ends within about two minutes.
const KEEPALIVE: socket2::TcpKeepalive = socket2::TcpKeepalive::new()
    .with_time(Duration::from_secs(60))
    .with_interval(Duration::from_secs(10))
    .with_retries(6);

/// Connections refused over `max_connections` are warned about at most this often: a flood of
/// them must not flood the log too.
const REFUSED_WARN_EVERY: Duration = Duration::from_secs(10);

/// Connections not opened yet on a port, at most: `max_connections / 8` (1 to 256). Each costs a
/// thread (storage) or a task and a descriptor (admin) until its Open deadline; silent ones filled
/// `max_connections` without any key (issue 34), and this keeps the rest of the places for
/// connections that opened.
fn max_unopened(shared: &Shared) -> usize {
    (shared.opts.max_connections / 8).clamp(1, 256)
}

/// A place among a port's connections not opened yet (`open` counts them); None (the
/// connection is then closed, counted and warned about like one over `max_connections`) when
/// they are all taken.
fn admit_unopened(shared: &Shared, peer: SocketAddr, port: &str, open: &Arc<AtomicUsize>) -> Option<Slot> {
    let max = max_unopened(shared);
    if open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1)).is_err() {
        refused(shared, || {
            format!(
                "{port} connection from {peer} closed: {max} connections are waiting for their Hello and Open \
                 (an eighth of [node] max_connections)"
            )
        });
        return None;
    }
    Some(Slot(open.clone()))
}

/// Counts a refused connection, and warns about it unless a warning went out within
/// `REFUSED_WARN_EVERY`.
fn refused(shared: &Shared, what: impl FnOnce() -> String) {
    shared.stats.refused_connections.fetch_add(1, Ordering::Relaxed);
    let mut refused = lock(&shared.refused);
    refused.0 += 1;
    if refused.1.is_none_or(|t| t.elapsed() >= REFUSED_WARN_EVERY) {
        let n = std::mem::take(&mut refused.0);
        log::warn!("{}; {n} refused since the last such warning", what());
        refused.1 = Some(Instant::now());
    }
}

/// A place under `max_connections` for a connection just accepted, with TCP keepalive on; None
/// when the port is full (the stream is then dropped, which closes it).
fn admit(shared: &Shared, stream: &TcpStream, peer: SocketAddr, port: &str, open: &Arc<AtomicUsize>) -> Option<Slot> {
    let max = shared.opts.max_connections;
    if open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1)).is_err() {
        refused(shared, || {
            format!("{port} connection from {peer} closed: {max} connections are open on that port ([node] max_connections)")
        });
        return None;
    }
    let slot = Slot(open.clone());
    if let Err(e) = socket2::SockRef::from(stream).set_tcp_keepalive(&KEEPALIVE) {
        log::warn!("{port} connection from {peer}: cannot enable TCP keepalive: {e}");
    }
    Some(slot)
}

/// The TLS handshake of an accepted connection and the roles the peer's certificate proves; a
/// failed handshake is one warning line and the connection is dropped.
async fn handshake(
    acceptor: &crate::node::tls::TlsAcceptor,
    stream: TcpStream,
    peer: SocketAddr,
    port: &str,
    shared: &Shared,
) -> Option<(tokio_rustls::server::TlsStream<TcpStream>, PeerRole)> {
    let why = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(s)) => {
            // Any certificate of the CA passes the handshake; only servers and operators may
            // use either port (a client's certificate must not set availability or truncate).
            // A refused peer's Hello is answered with the reason (`check_credential`).
            let role = PeerRole::of_certificates(s.get_ref().1.peer_certificates());
            if let Some(why) = &role.refused {
                shared.stats.tls_role_refusals.fetch_add(1, Ordering::Relaxed);
                log::warn!("{port} connection from {peer} refused: {why}");
            }
            return Some((s, role));
        }
        Ok(Err(e)) => crate::node::tls::describe(&e),
        Err(_) => format!("no handshake within {HANDSHAKE_TIMEOUT:?}"),
    };
    shared.stats.tls_handshake_failures.fetch_add(1, Ordering::Relaxed);
    log::warn!("TLS handshake with {port} client {peer} failed: {why}");
    None
}

/// Serves one storage-protocol connection on a new thread with a single-threaded runtime of its
/// own (TLS handshake included), so that its appends' fsyncs run where its frames are decoded. A
/// node out of threads drops the connection with a warning; the peer reconnects.
fn serve_on_own_thread(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<crate::node::tls::TlsAcceptor>,
    (slot, unopened): (Slot, Slot),
) {
    let stream = match stream.into_std() {
        Ok(s) => s,
        Err(e) => return log::warn!("connection from {peer} dropped: {e}"),
    };
    let mut stopping = shared.stopping.subscribe();
    *lock(&shared.live.0) += 1;
    let sh = shared.clone();
    let spawned = std::thread::Builder::new().name("waltz-conn".into()).spawn(move || {
        let _slot = slot;
        let _live = LiveConnection(sh.clone());
        let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt,
            Err(e) => return log::warn!("connection from {peer} dropped: no runtime for it ({e})"),
        };
        rt.block_on(async move {
            let work = async {
                let stream = match TcpStream::from_std(stream) {
                    Ok(s) => s,
                    Err(e) => return log::warn!("connection from {peer} dropped: {e}"),
                };
                match acceptor {
                    None => serve(stream, peer, sh, unopened, PeerRole::default()).await,
                    Some(a) => {
                        if let Some((s, role)) = handshake(&a, stream, peer, "storage", &sh).await {
                            serve(s, peer, sh, unopened, role).await;
                        }
                    }
                }
            };
            tokio::select! {
                _ = work => {}
                _ = stopping.wait_for(|stop| *stop) => {}
            }
        });
    });
    if let Err(e) = spawned {
        *lock(&shared.live.0) -= 1;
        shared.live.1.notify_all();
        log::warn!("connection from {peer} dropped: no thread for it ({e})");
    }
}

/// Counts a connection thread as live until it ends, however it ends.
struct LiveConnection(Arc<Shared>);

impl Drop for LiveConnection {
    fn drop(&mut self) {
        let (count, ended) = &self.0.live;
        *lock(count) -= 1;
        ended.notify_all();
    }
}

/// Tells every connection thread to end, and waits (at most `timeout`) until they have.
fn stop_connections(shared: &Shared, timeout: Duration) {
    shared.stopping.send_replace(true);
    let (count, ended) = &shared.live;
    let left = ended
        .wait_timeout_while(lock(count), timeout, |n| *n > 0)
        .map(|(n, _)| *n)
        .unwrap_or_else(|e| *e.into_inner().0);
    if left > 0 {
        log::warn!("{left} connection(s) still busy {timeout:?} after the node stopped (a sync that does not return?)");
    }
}

/// One connection, one task: decode every frame that has arrived, queue appends, then settle the
/// answers in order (the first append's wait makes its partition's sync leader, whose one
/// fdatasync covers every append queued here) and send them with one write. Any other request
/// settles the appends before it first, so answers keep request order and no more than
/// `max_in_flight` appends or about `FLUSH_BYTES` of answers are ever held.
async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    peer: SocketAddr,
    shared: Arc<Shared>,
    unopened: Slot,
    role: PeerRole,
) {
    let mut conn = Conn { peer, greeted: false, opened: false, refused: None, role };
    let mut unopened = Some(unopened);
    let (greet_by, open_by) = greet_and_open_deadlines(&shared);
    let wait = |conn: &Conn| match (conn.greeted, conn.opened) {
        (_, true) => Wait::Forever,
        (false, _) => Wait::OpenBy(greet_by),
        (true, false) => Wait::OpenBy(open_by),
    };
    let mut buf = FrameBuf::with_capacity(64 << 10);
    let mut waiting: Vec<Answer> = Vec::new();
    let mut out: Vec<u8> = Vec::new();
    // A send that failed may have left a frame half written: nothing may follow it.
    let mut send_failed = false;
    let reason = 'conn: loop {
        loop {
            let (size, req) = match split_frame(buf.pending(), MAGIC_STORAGE, frame_limit(&shared, conn.opened)) {
                Ok(Some(f)) => (f.size, Request::decode(&f)),
                Ok(None) => break,
                Err(e) => {
                    break 'conn bad_frame(
                        if conn.opened { "bad frame" } else { "bad frame before Open" },
                        buf.pending(),
                        e,
                    )
                }
            };
            buf.consume(size);
            let req = match req {
                Ok(r) => r,
                Err(e) => break 'conn format!("bad frame: {e}"),
            };
            shared.stats.requests.fetch_add(1, Ordering::Relaxed);
            if !matches!(req, Request::Append { .. }) || waiting.len() >= shared.opts.max_in_flight {
                settle_all(&shared, &mut waiting, &mut out);
            }
            match handle(&shared, &mut conn, req) {
                Ok(answer @ Answer::Durable { .. }) => waiting.push(answer),
                Ok(answer) if !waiting.is_empty() => waiting.push(answer),
                Ok(Answer::Now(bytes)) => push_answer(&shared, &mut out, bytes),
                Err(why) => break 'conn why,
            }
            if let Some(why) = conn.refused.take() {
                break 'conn why; // its answer is sent before the connection closes
            }
            if conn.opened {
                unopened.take(); // its place among the unopened goes back once, at its first Open
            }
            if out.len() >= FLUSH_BYTES {
                if let Err(why) = send(&mut stream, &mut out, &shared, wait(&conn)).await {
                    send_failed = true;
                    break 'conn why;
                }
            }
        }
        settle_all(&shared, &mut waiting, &mut out);
        if let Err(why) = send(&mut stream, &mut out, &shared, wait(&conn)).await {
            send_failed = true;
            break why;
        }
        if let Err(why) = read_more(&mut stream, &mut buf, &shared, wait(&conn)).await {
            break why;
        }
    };
    // What was accepted before the connection ended is still settled (synced), and answered
    // unless the connection can no longer carry a whole frame.
    settle_all(&shared, &mut waiting, &mut out);
    if !send_failed {
        let _ = send(&mut stream, &mut out, &shared, wait(&conn)).await;
    }
    if !reason.is_empty() {
        shared.stats.closed_bad_frames.fetch_add(reason.starts_with("bad frame") as u64, Ordering::Relaxed);
        log::warn!("closing connection from {peer}: {reason}");
    }
    // A clean close, unless a send failed: TLS would flush the rest of a half-written frame
    // first. Bounded: TLS's close writes what it still holds, and a peer that reads nothing would
    // keep this thread and its max_connections place for as long as it lives.
    if !send_failed {
        let _ = tokio::time::timeout(shared.opts.idle_timeout.min(CLOSE_TIMEOUT), stream.shutdown()).await;
    }
}

/// How long a closing storage connection waits for the peer to take its last bytes.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);

fn settle_all(shared: &Shared, waiting: &mut Vec<Answer>, out: &mut Vec<u8>) {
    for answer in waiting.drain(..) {
        push_answer(shared, out, settle(shared, answer));
    }
}

fn push_answer(shared: &Shared, out: &mut Vec<u8>, bytes: Vec<u8>) {
    count_response(&shared.stats, &bytes);
    if out.is_empty() {
        *out = bytes;
    } else {
        out.extend_from_slice(&bytes);
    }
}

struct Conn {
    peer: SocketAddr,
    greeted: bool,
    opened: bool,
    /// Set when the peer was refused with an answer: the connection closes once it is sent.
    refused: Option<String>,
    /// What the peer proved: its certificate's roles, then the role whose secret it gave.
    role: PeerRole,
}

/// Turns one request into its (future) response. Err closes the connection with that reason.
fn handle(shared: &Arc<Shared>, conn: &mut Conn, req: Request) -> Result<Answer, String> {
    if !conn.greeted {
        return greet(shared, conn, req);
    }
    let h = match req.header() {
        Some(h) => h,
        None => return Err("Hello sent twice".into()),
    };
    if let Request::Open { cluster_key, partition_count, .. } = req {
        return Ok(now(open(shared, conn, h, cluster_key, partition_count)));
    }
    if !conn.opened {
        return Ok(now(fail(h, FailureKind::NotOpened, "send Open first")));
    }
    let part = match partition_and_fence(shared, h) {
        Ok(p) => p,
        Err(resp) => return Ok(now(resp)),
    };
    if let Some(refused) = refusal(shared, h, &req, &part).or_else(|| role_refusal(shared, conn, h, &req)) {
        return Ok(now(refused));
    }
    Ok(dispatch(shared, h, part, req))
}

/// Refused when the request needs a role the peer did not prove. A Restart Log replaces a
/// replica's whole log (issue 35): only a server's store session sends it on this port (an
/// operator has the admin port's), so with TLS or role secrets it needs the `server` role;
/// without either, nothing is proven by anyone and the cluster key in Open is all there is
/// (docs/operations.md, "Security model").
fn role_refusal(shared: &Shared, conn: &Conn, h: MsgHeader, req: &Request) -> Option<Response> {
    let roles_proven = shared.opts.tls.is_some() || !shared.opts.role_secrets.is_empty();
    if !matches!(req, Request::RestartLog { .. }) || !roles_proven || conn.role.is("server") {
        return None;
    }
    let has = match conn.role.roles.as_slice() {
        [] => "no role".to_string(),
        roles => format!("role {}", roles.join(", ")),
    };
    shared.stats.role_request_refusals.fetch_add(1, Ordering::Relaxed);
    log::warn!(
        "refused Restart Log of partition {} from {}: it proved {has}, and only a server may restart a log here",
        h.partition_id,
        conn.peer
    );
    Some(fail(
        h,
        FailureKind::Refused,
        format!(
            "Restart Log on the storage port needs the server role (a server certificate or the server secret); \
             this connection proved {has} (operators use the admin port's Restart Log)"
        ),
    ))
}

/// The version handshake: the first frame must be a Hello this node speaks, with a role secret
/// when the node has them (refused with an answer, then closed); any other error closes the
/// connection.
fn greet(shared: &Shared, conn: &mut Conn, req: Request) -> Result<Answer, String> {
    match req {
        Request::Hello { min_version, max_version, credential } if min_version <= VERSION && VERSION <= max_version => {
            if let Err(why) = check_credential(shared, "storage", conn.peer, credential.as_ref(), &mut conn.role) {
                conn.refused = Some(format!("refused at Hello: {why}"));
                return Ok(now(fail(MsgHeader::default(), FailureKind::Refused, why)));
            }
            conn.greeted = true;
            Ok(now(Response::HelloOk { version: VERSION }))
        }
        Request::Hello { min_version, max_version, .. } => {
            Err(format!("client speaks versions {min_version}..={max_version}, node speaks {VERSION}"))
        }
        _ => Err("the first frame must be Hello".into()),
    }
}

/// Open: the peer proves it belongs to this storage's cluster (key and partition count).
fn open(shared: &Shared, conn: &mut Conn, h: MsgHeader, cluster_key: [u8; 16], partition_count: i32) -> Response {
    // Whatever an earlier Open proved, a failed one leaves the connection unopened (and past
    // its Open deadline, so it is closed once the Failure is sent).
    conn.opened = false;
    let s = &shared.storage;
    if cluster_key != s.cluster_key {
        let theirs = crate::engine::format::format_uuid(&cluster_key);
        // The key is what makes a peer one of the cluster's: the answer must not teach it.
        // Nor may the log: anyone who reads it would hold the key (issue 34). The peer's key is
        // the peer's to disclose, and useful to tell which cluster it belongs to.
        log::warn!("refusing Open from {}: cluster key {theirs} does not match this storage's", conn.peer);
        return fail(
            h,
            FailureKind::ClusterKeyMismatch,
            format!("cluster key {theirs} does not match this storage's key"),
        );
    }
    if partition_count != s.partition_count {
        return fail(
            h,
            FailureKind::PartitionCountMismatch,
            format!("partition count {partition_count} does not match this storage's {}", s.partition_count),
        );
    }
    conn.opened = true;
    Response::Success { h }
}

/// Why this node refuses the request on this partition now (an admin's availability marks, a
/// failed partition), or None.
fn refusal(shared: &Shared, h: MsgHeader, req: &Request, part: &Partition) -> Option<Response> {
    let (readable, writable) = shared
        .availability
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&h.partition_id)
        .copied()
        .unwrap_or((true, true));
    let mutates = matches!(
        req,
        Request::Append { .. }
            | Request::Truncate { .. }
            | Request::SetLowWaterMark { .. }
            | Request::RestartLog { .. }
    );
    if mutates && !writable {
        return Some(fail(
            h,
            FailureKind::PartitionNotWritable,
            format!("partition {} is not writable on this node", h.partition_id),
        ));
    }
    if !mutates && !readable {
        return Some(fail(
            h,
            FailureKind::PartitionNotReadable,
            format!("partition {} is not readable on this node", h.partition_id),
        ));
    }
    // A partition that failed (an fsync or a write refused) may hold bytes past its durable end
    // that were written but never confirmed: they can be back after a reopen. Until then it
    // cannot say what it holds, and taking a session's mark would vouch for a tail it never
    // truncated (`waltz torture`: a dirty record resurrected at an id another session committed).
    if matches!(req, Request::MaxTransactionId { .. } | Request::SetLowWaterMark { .. }) {
        if let Some(reason) = part.is_failed() {
            let msg = format!(
                "partition {} failed ({reason}): what it holds is unknown until the node reopens it",
                h.partition_id
            );
            return Some(fail(h, FailureKind::PartitionFailed, msg));
        }
    }
    None
}

/// Serves a request that passed the handshake, Open, fence and availability checks.
fn dispatch(shared: &Arc<Shared>, h: MsgHeader, part: Arc<Partition>, req: Request) -> Answer {
    match req {
        Request::Append { records, .. } => append(shared, h, part, records),
        // Waits for the sync of every append already queued (an older session's, accepted just
        // before this session's fence): the answer is what the replica will hold.
        Request::MaxTransactionId { .. } => blocking(shared, h, move |_| match part.settled_max_txid() {
            Ok(txid) => Response::MaxTransactionId { h, txid },
            Err(e) => fail(h, failure_kind(&e), e.to_string()),
        }),
        Request::LastSessionInfo { .. } => {
            blocking(shared, h, move |sh| match sh.storage.partition_info(h.partition_id) {
                Ok(i) => Response::LastSessionInfo { h, session_id: i.session_id, low_water_mark: i.low_water_mark },
                Err(e) => fail(h, failure_kind(&e), e.to_string()),
            })
        }
        // Mutations other than appends complete before the next request is read, so a later
        // append on this connection sees their effect.
        Request::Truncate { txid, .. } => blocking(shared, h, move |sh| {
            gated_mutation(sh, h, || {
                if let Some(refused) = below_low_water_mark(sh, h, &part, txid) {
                    return refused;
                }
                match part.truncate(txid) {
                    Ok(_) => Response::Success { h },
                    Err(e) => fail(h, failure_kind(&e), e.to_string()),
                }
            })
        }),
        Request::SetLowWaterMark { low_water_mark, .. } => blocking(shared, h, move |sh| {
            gated_mutation(sh, h, || {
                match sh.storage.set_low_water_mark(h.partition_id, h.session_id, low_water_mark) {
                    Ok(_) => Response::Success { h },
                    Err(e) => fail(h, failure_kind(&e), e.to_string()),
                }
            })
        }),
        Request::RecordHeader { txid, .. } => blocking(shared, h, move |_| match part.read_header(txid) {
            Ok(header) => Response::RecordHeader { h, header },
            Err(e) => fail(h, failure_kind(&e), e.to_string()),
        }),
        Request::Record { txid, .. } => blocking(shared, h, move |_| match part.read_record(txid) {
            Ok(r) => Response::Record { h, record: r.map(WireRecord::from) },
            Err(e) => fail(h, failure_kind(&e), e.to_string()),
        }),
        Request::RecordHeaderList { txid, max_count, .. } => {
            let n = (max_count.max(0) as usize).min(shared.opts.max_list_count);
            blocking(shared, h, move |_| match part.read_headers(txid, n) {
                Ok(headers) => Response::RecordHeaderList { h, headers },
                Err(e) => fail(h, failure_kind(&e), e.to_string()),
            })
        }
        Request::RecordList { txid, max_count, .. } => {
            let n = (max_count.max(0) as usize).min(shared.opts.max_list_count);
            let bytes = shared.opts.max_list_bytes;
            blocking(shared, h, move |_| match part.read_records(txid, n, bytes) {
                Ok(rs) => Response::RecordList { h, records: rs.into_iter().map(WireRecord::from).collect() },
                Err(e) => fail(h, failure_kind(&e), e.to_string()),
            })
        }
        // Past the replica's end only (the engine refuses anything else): it never cuts a log, it
        // replaces one that its peers' retention left behind.
        Request::RestartLog { first_txid, .. } => blocking(shared, h, move |sh| {
            gated_mutation(sh, h, || match sh.storage.restart_partition(h.partition_id, first_txid) {
                Ok(_) => Response::Success { h },
                Err(Error::InvalidArgument(m)) => fail(h, FailureKind::Refused, m),
                Err(e) => fail(h, failure_kind(&e), e.to_string()),
            })
        }),
        // Only remembered: the retention thread applies it, capped by this replica's own state.
        Request::SetRetention(order) => {
            shared.retention.set(order);
            now(Response::Retention { h, first_txid: part.first_txid() })
        }
        Request::Hello { .. } | Request::Open { .. } => unreachable!("handled above"),
    }
}

/// The partition, if this node has it, after the session fence; a Failure response otherwise.
/// A newer session is made durable (the fence file) before its request is served, so no
/// restart can let an older session write again.
fn partition_and_fence(shared: &Arc<Shared>, h: MsgHeader) -> Result<Arc<Partition>, Response> {
    let pid = h.partition_id;
    let cached = shared.storage.open_partition_info(pid).map(|(p, _)| p);
    let newest = lock(&shared.fences).get(&pid).copied();
    if let (Some(p), Some(n)) = (&cached, newest) {
        if h.session_id == n {
            return Ok(p.clone());
        }
        if h.session_id < n {
            return Err(stale(h, n));
        }
    }
    // First use of the partition (its recovery), or a new session: open and persist the fence,
    // on this connection's thread like all its storage work.
    if let Some(refused) = beyond_session_bound(shared, h) {
        return Err(refused);
    }
    let session = h.session_id;
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let p = shared.storage.partition(pid)?;
        Ok::<_, Error>((p, shared.storage.raise_fence(pid, session)?))
    }))
    .map_err(|_| fail(h, FailureKind::Internal, "opening the partition panicked"))?;
    match outcome {
        Ok((p, Ok(()))) => {
            let mut fences = lock(&shared.fences);
            let newest = fences.entry(pid).or_insert(session);
            *newest = (*newest).max(session);
            Ok(p)
        }
        Ok((_, Err(current))) => Err(stale(h, current)),
        Err(e) => Err(fail(h, failure_kind(&e), e.to_string())),
    }
}

/// Refused when a Truncate to `txid` would remove a record at or below the replica's low-water
/// mark: those records were committed by the session that set the mark, and no server's
/// recovery ever cuts them (it truncates uncommitted tails above it). With the cluster key alone,
/// a Truncate to -1 on every replica destroyed acknowledged data (issue 34).
fn below_low_water_mark(shared: &Shared, h: MsgHeader, part: &Partition, txid: i64) -> Option<Response> {
    match truncation_refusal(shared, h.partition_id, part, txid) {
        Ok(None) => None,
        Ok(Some(why)) => {
            log::warn!("refused Truncate by session {}: {why}", h.session_id);
            Some(fail(h, FailureKind::Refused, why))
        }
        Err(e) => Some(fail(h, failure_kind(&e), e.to_string())),
    }
}

/// Why a Truncate of partition `pid` to `txid` must be refused (it would remove a record at or
/// below the replica's low-water mark), or None; an admin may force it (`admin.rs`).
pub(super) fn truncation_refusal(
    shared: &Shared,
    pid: i32,
    part: &Partition,
    txid: i64,
) -> Result<Option<String>, Error> {
    let info = shared.storage.partition_info(pid)?;
    let committed = info.low_water_mark.min(part.max_txid());
    // Below -1 is no truncation at all: the engine answers that as a bad request.
    Ok((txid >= -1 && txid < committed).then(|| {
        format!(
            "truncating partition {pid} to {txid} would remove committed records: its low-water mark is {} \
             (session {})",
            info.low_water_mark, info.session_id
        )
    }))
}

/// How far above a replica's fence a new session may come. Servers number a partition's
/// sessions one by one from the cluster metadata (`_new_session_id`), so a replica that missed
/// every session since it was last used is behind by the sessions it missed: 2^32 of them is
/// more failovers than any cluster lives through, while a request with session 2^62 (issue 34)
/// would fence every server out for good.
pub const MAX_SESSION_JUMP: i64 = 1 << 32;

/// Refused when session `h.session_id` is more than `MAX_SESSION_JUMP` above the fence.
fn beyond_session_bound(shared: &Shared, h: MsgHeader) -> Option<Response> {
    match session_jump_refusal(shared, h.partition_id, h.session_id) {
        Ok(None) => None,
        Ok(Some(why)) => {
            log::warn!("refused {why}");
            Some(fail(h, FailureKind::Refused, why))
        }
        Err(e) => Some(fail(h, failure_kind(&e), e.to_string())),
    }
}

/// Why session `session` must not raise partition `pid`'s fence (more than `MAX_SESSION_JUMP`
/// above it), or None; an admin may force it (`admin.rs`).
pub(super) fn session_jump_refusal(shared: &Shared, pid: i32, session: i64) -> Result<Option<String>, Error> {
    let current = shared.storage.fence(pid)?.max(0);
    Ok((session.saturating_sub(current) > MAX_SESSION_JUMP).then(|| {
        format!(
            "session {session} of partition {pid} is more than {MAX_SESSION_JUMP} above this replica's fence {current}"
        )
    }))
}

fn stale(h: MsgHeader, newest: i64) -> Response {
    fail(
        h,
        FailureKind::StaleSession,
        format!("session {} of partition {} is older than session {newest}", h.session_id, h.partition_id),
    )
}

/// Queues the batch into the partition; its answer waits for the sync that covers it.
fn append(shared: &Arc<Shared>, h: MsgHeader, part: Arc<Partition>, records: Vec<WireRecord>) -> Answer {
    let Some(first) = records.first().map(|r| r.txid) else {
        return now(Response::Success { h });
    };
    if let Some((i, r)) = records.iter().enumerate().find(|(i, r)| r.txid != first + *i as i64) {
        return now(fail(
            h,
            FailureKind::NonDenseAppend,
            format!("record {i} of the batch has id {}, expected {}", r.txid, first + i as i64),
        ));
    }
    let recs: Vec<NewRecord<'_>> = records
        .iter()
        .map(|r| NewRecord { req_id: r.req_id, header: r.header, data: &r.data, data_crc: Some(r.data_crc) })
        .collect();
    // Queued in arrival order right here, under the fence gate: no newer session can be
    // served between the session check and the enqueue.
    let gate = shared.storage.fence_gate(h.partition_id);
    let queued = {
        let _shared = gate.read().unwrap_or_else(|e| e.into_inner());
        if let Some(refused) = fenced_out(&shared.storage, h).or_else(|| not_writable(shared, h)) {
            return now(refused);
        }
        part.enqueue(Some(first), &recs)
    };
    match queued {
        Ok(ticket) => {
            shared.stats.appended_records.fetch_add(records.len() as u64, Ordering::Relaxed);
            Answer::Durable { h, part, seq: ticket.seq }
        }
        Err(e) => now(fail(h, failure_kind(&e), e.to_string())),
    }
}

/// PartitionNotWritable when an admin marked the partition so (checked again under the fence
/// gate, which Set Availability takes exclusively).
fn not_writable(shared: &Shared, h: MsgHeader) -> Option<Response> {
    let writable = lock(&shared.availability).get(&h.partition_id).is_none_or(|a| a.1);
    (!writable).then(|| {
        fail(h, FailureKind::PartitionNotWritable, format!("partition {} is not writable on this node", h.partition_id))
    })
}
