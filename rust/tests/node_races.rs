//! Races between sessions, fencing and assignment on a running storage node, driven over TCP
//! with gated fsyncs. Found by an adversarial review; each lost an acknowledged append before
//! its fix. Then the limits on what a peer may cost the node (connection limits, below).
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use waltz_native::engine::fs::{FileHandle, FileSystem, ForwardingFile, StdFs};
use waltz_native::engine::partition::default_options;
use waltz_native::engine::record::{crc32, ReqId};
use waltz_native::engine::storage::Storage;
use waltz_native::node::protocol::{
    split_frame, AdminRequest, AdminResponse, Frame, MsgHeader, Request, Response, WireRecord, MAGIC_ADMIN,
    MAGIC_STORAGE,
};
use waltz_native::node::server::{self, NodeOptions};

const KEY: [u8; 16] = [7; 16];

// ---------------------------------------------------------------- gated file system
#[derive(Default)]
struct GateSt {
    armed: bool,
    open: bool,
    blocked: u32,
    ext: &'static str,
    once_exists: Option<PathBuf>,
}
#[derive(Default)]
struct Gate {
    st: Mutex<GateSt>,
    cv: Condvar,
}
impl Gate {
    fn arm(&self, ext: &'static str) {
        let mut s = self.st.lock().unwrap();
        *s = GateSt { armed: true, open: false, blocked: 0, ext, once_exists: None };
    }
    fn arm_exists(&self, p: PathBuf) {
        let mut s = self.st.lock().unwrap();
        *s = GateSt { armed: false, open: false, blocked: 0, ext: "", once_exists: Some(p) };
    }
    fn wait_blocked(&self, n: u32) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut s = self.st.lock().unwrap();
        while s.blocked < n {
            assert!(Instant::now() < deadline, "nobody reached the gate");
            s = self.cv.wait_timeout(s, Duration::from_millis(20)).unwrap().0;
        }
    }
    fn release(&self) {
        let mut s = self.st.lock().unwrap();
        s.open = true;
        s.armed = false;
        self.cv.notify_all();
    }
}
struct GFile {
    inner: Arc<dyn FileHandle>,
    ext: String,
    gate: Arc<Gate>,
}
impl ForwardingFile for GFile {
    fn inner(&self) -> &dyn FileHandle {
        self.inner.as_ref()
    }
    fn sync_data(&self) -> io::Result<()> {
        {
            let mut s = self.gate.st.lock().unwrap();
            if s.armed && s.ext == self.ext {
                s.blocked += 1;
                self.gate.cv.notify_all();
                while !s.open {
                    s = self.gate.cv.wait(s).unwrap();
                }
            }
        }
        self.inner.sync_data()
    }
}
struct GFs {
    gate: Arc<Gate>,
}
impl GFs {
    fn wrap(&self, p: &Path, f: Arc<dyn FileHandle>) -> Arc<dyn FileHandle> {
        let ext = p.extension().map(|e| e.to_string_lossy().to_string()).unwrap_or_default();
        Arc::new(GFile { inner: f, ext, gate: self.gate.clone() })
    }
}
impl FileSystem for GFs {
    fn open(&self, p: &Path, w: bool) -> io::Result<Arc<dyn FileHandle>> {
        Ok(self.wrap(p, StdFs.open(p, w)?))
    }
    fn create_new(&self, p: &Path) -> io::Result<Arc<dyn FileHandle>> {
        Ok(self.wrap(p, StdFs.create_new(p)?))
    }
    fn exists(&self, p: &Path) -> bool {
        {
            let mut s = self.gate.st.lock().unwrap();
            if s.once_exists.as_deref() == Some(p) {
                s.once_exists = None;
                s.blocked += 1;
                self.gate.cv.notify_all();
                while !s.open {
                    s = self.gate.cv.wait(s).unwrap();
                }
            }
        }
        StdFs.exists(p)
    }
}

fn gated_storage(dir: &Path, parts: i32) -> (Arc<Storage>, Arc<Gate>) {
    let gate = Arc::new(Gate::default());
    let fs: Arc<dyn FileSystem> = Arc::new(GFs { gate: gate.clone() });
    let s = Storage::create_with(fs, dir, KEY, parts, default_options()).unwrap();
    for p in 0..parts {
        s.add_partition(p).unwrap();
    }
    (Arc::new(s), gate)
}

// ---------------------------------------------------------------- tiny blocking clients
/// One port's framing: the storage port's requests and responses, or the admin port's.
trait Port {
    type Req;
    type Resp;
    const MAGIC: u16;
    fn encode(r: &Self::Req, out: &mut Vec<u8>);
    fn decode(f: &Frame<'_>) -> Self::Resp;
}
struct StoragePort;
impl Port for StoragePort {
    type Req = Request;
    type Resp = Response;
    const MAGIC: u16 = MAGIC_STORAGE;
    fn encode(r: &Request, out: &mut Vec<u8>) {
        r.encode(out)
    }
    fn decode(f: &Frame<'_>) -> Response {
        Response::decode(f).unwrap()
    }
}
struct AdminPort;
impl Port for AdminPort {
    type Req = AdminRequest;
    type Resp = AdminResponse;
    const MAGIC: u16 = MAGIC_ADMIN;
    fn encode(r: &AdminRequest, out: &mut Vec<u8>) {
        r.encode(out)
    }
    fn decode(f: &Frame<'_>) -> AdminResponse {
        AdminResponse::decode(f).unwrap()
    }
}

/// A blocking connection to one port.
struct Conn<P: Port> {
    s: TcpStream,
    buf: Vec<u8>,
    _port: std::marker::PhantomData<P>,
}
impl<P: Port> Conn<P> {
    fn connect(addr: std::net::SocketAddr) -> Self {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        Conn { s, buf: Vec::new(), _port: std::marker::PhantomData }
    }
    fn send(&mut self, r: &P::Req) {
        let mut b = Vec::new();
        P::encode(r, &mut b);
        self.s.write_all(&b).unwrap();
    }
    fn try_recv(&mut self) -> io::Result<P::Resp> {
        loop {
            if let Some(f) = split_frame(&self.buf, P::MAGIC, 1 << 30).unwrap() {
                let size = f.size;
                let r = P::decode(&f);
                self.buf.drain(..size);
                return Ok(r);
            }
            let mut chunk = [0u8; 65536];
            let n = self.s.read(&mut chunk)?;
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed"));
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
    fn recv(&mut self) -> P::Resp {
        self.try_recv().unwrap()
    }
    fn call(&mut self, r: P::Req) -> P::Resp {
        self.send(&r);
        self.recv()
    }
}

/// The storage port's client (Hello and Open done by `connect`), numbering its requests.
struct Client {
    conn: Conn<StoragePort>,
    seq: i64,
}
impl std::ops::Deref for Client {
    type Target = Conn<StoragePort>;
    fn deref(&self) -> &Self::Target {
        &self.conn
    }
}
impl std::ops::DerefMut for Client {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.conn
    }
}
impl Client {
    fn connect(addr: std::net::SocketAddr, parts: i32) -> Client {
        let mut c = Client { conn: Conn::connect(addr), seq: 0 };
        assert!(matches!(
            c.call(Request::Hello { min_version: 1, max_version: 1, credential: None }),
            Response::HelloOk { .. }
        ));
        let h = c.h(-1, -1);
        assert!(matches!(
            c.call(Request::Open { h, cluster_key: KEY, partition_count: parts }),
            Response::Success { .. }
        ));
        c
    }
    fn h(&mut self, session: i64, pid: i32) -> MsgHeader {
        self.seq += 1;
        MsgHeader { session_id: session, seq: self.seq, partition_id: pid }
    }
}

/// The admin port's client: Hello and Open done by `connect`.
type Admin = Conn<AdminPort>;
fn admin(addr: std::net::SocketAddr) -> Admin {
    let mut a = Admin::connect(addr);
    assert!(matches!(
        a.call(AdminRequest::Hello { min_version: 1, max_version: 1, credential: None }),
        AdminResponse::HelloOk { .. }
    ));
    assert!(matches!(
        a.call(AdminRequest::Open { h: ah(-1), cluster_key: KEY, partition_count: 1 }),
        AdminResponse::Success { .. }
    ));
    a
}
fn ah(pid: i32) -> MsgHeader {
    MsgHeader { session_id: 0, seq: 1, partition_id: pid }
}

fn recs(first: i64, n: i64, size: usize) -> Vec<WireRecord> {
    (first..first + n)
        .map(|t| {
            let data = vec![(t % 251) as u8; size];
            WireRecord { txid: t, req_id: ReqId::default(), header: 0, data_crc: crc32(&data), data }
        })
        .collect()
}

fn max_txid(c: &mut Client, session: i64, pid: i32) -> Response {
    let h = c.h(session, pid);
    c.call(Request::MaxTransactionId { h })
}

/// R1. A stale session's Truncate passes the fence, then waits (for the sync leadership) while a
/// newer session is fenced in and gets an append acknowledged; the stale truncate then runs and
/// cuts the newer session's acknowledged transaction.
#[test]
fn r1_stale_truncate_cuts_a_newer_sessions_acknowledged_append() {
    let mut lost = 0;
    let mut stale_truncate_ran_after_newer_session = 0;
    let trials = 12;
    for _ in 0..trials {
        let d = tempfile::tempdir().unwrap();
        let (s, gate) = gated_storage(d.path(), 1);
        let node = server::start(s.clone(), "127.0.0.1:0", None, NodeOptions::default()).unwrap();
        let mut a = Client::connect(node.addr, 1);
        let h = a.h(5, 0);
        assert!(matches!(a.call(Request::SetLowWaterMark { h, low_water_mark: -1 }), Response::Success { .. }));
        let h = a.h(5, 0);
        assert!(matches!(a.call(Request::Append { h, records: recs(0, 5, 10) }), Response::Success { .. }));

        // Session 5 append #5: its sync leader blocks in fdatasync.
        gate.arm("seg");
        let h = a.h(5, 0);
        a.send(&Request::Append { h, records: recs(5, 1, 10) });
        gate.wait_blocked(1);
        // Session 5 (old server, second connection) truncates to 4: passes the fence now.
        let mut b = Client::connect(node.addr, 1);
        let h = b.h(5, 0);
        b.send(&Request::Truncate { h, txid: 4 });
        std::thread::sleep(Duration::from_millis(150));
        // Session 6 (new server) shows up: its first request raises the fence, which waits
        // for the stale truncate already under way (so it is sent, not awaited, here).
        let mut c = Client::connect(node.addr, 1);
        let h = c.h(6, 0);
        c.send(&Request::MaxTransactionId { h });
        std::thread::sleep(Duration::from_millis(150));
        gate.release();
        let _ = a.recv();
        let tr = b.recv();
        let max6 = match c.recv() {
            Response::MaxTransactionId { txid, .. } => txid,
            other => panic!("{other:?}"),
        };
        if matches!(tr, Response::Success { .. }) && max6 > 4 {
            stale_truncate_ran_after_newer_session += 1;
        }
        // Session 6 appends where it saw the log end; nothing of session 5 may cut it now.
        let h = c.h(6, 0);
        assert!(matches!(c.call(Request::Append { h, records: recs(max6 + 1, 1, 10) }), Response::Success { .. }));
        let h = b.h(5, 0);
        assert!(matches!(b.call(Request::Truncate { h, txid: 0 }), Response::Failure { .. }));
        match max_txid(&mut c, 6, 0) {
            Response::MaxTransactionId { txid, .. } if txid == max6 + 1 => {}
            _ => lost += 1,
        }
        drop(node);
        s.close();
    }
    eprintln!("trials {trials}: stale truncate succeeded after session 6 was served: {stale_truncate_ran_after_newer_session}; session 6's acked txid lost: {lost}");
    assert_eq!(stale_truncate_ran_after_newer_session, 0, "a session-5 Truncate ran after session 6 was fenced in");
    assert_eq!(lost, 0, "an acknowledged append of the newer session was cut by the stale session");
}

/// R2. Unassign(delete_files) racing a request for the partition leaves a "ghost" partition open
/// on deleted files; after Assign the node serves (and acknowledges appends into) the ghost, and
/// they are gone after a restart.
#[test]
fn r2_unassign_racing_a_request_leaves_a_ghost_that_loses_acked_appends() {
    let d = tempfile::tempdir().unwrap();
    let (s, gate) = gated_storage(d.path(), 1);
    let node = server::start(s.clone(), "127.0.0.1:0", Some("127.0.0.1:0"), NodeOptions::default()).unwrap();
    let mut c = Client::connect(node.addr, 1);
    let h = c.h(5, 0);
    assert!(matches!(c.call(Request::Append { h, records: recs(0, 3, 10) }), Response::Success { .. }));

    let mut adm = admin(node.admin_addr.unwrap());
    // Unassign with delete: hold it after the partition left the map and was closed, before its
    // folder is renamed away (remove_partition's exists(dir) check).
    gate.arm_exists(d.path().join("0"));
    adm.send(&AdminRequest::Unassign { h: ah(0), delete_files: true });
    gate.wait_blocked(1);
    // Any request for the partition now reopens it from the folder that is about to go.
    let mut c2 = Client::connect(node.addr, 1);
    let h = c2.h(5, 0);
    c2.send(&Request::MaxTransactionId { h }); // waits: the unassign holds the partition map
    std::thread::sleep(Duration::from_millis(150));
    gate.release();
    let r = c2.recv();
    eprintln!("request during unassign: {r:?}");
    assert!(matches!(r, Response::Failure { .. }), "the partition being deleted must not be served: {r:?}");
    assert!(matches!(adm.recv(), AdminResponse::Success { .. }));
    assert!(!d.path().join("0").exists(), "unassign deleted the folder");
    // Later the partition is assigned here again.
    assert!(matches!(adm.call(AdminRequest::Assign { h: ah(0) }), AdminResponse::Success { .. }));
    let r = max_txid(&mut c2, 7, 0);
    eprintln!("after re-assign, max txid (new empty partition expected -1): {r:?}");
    // A new session appends from where the node says the log ends.
    let next = match r {
        Response::MaxTransactionId { txid, .. } => txid + 1,
        other => panic!("{other:?}"),
    };
    let h = c2.h(7, 0);
    let ack = c2.call(Request::Append { h, records: recs(next, 2, 10) });
    eprintln!("append after re-assign: {ack:?}");
    let acked = matches!(ack, Response::Success { .. });
    drop(c);
    drop(c2);
    drop(node);
    s.close();
    let s = Storage::open(d.path(), None, None, default_options()).unwrap();
    let max = s.partition(0).unwrap().max_txid();
    eprintln!("after restart: max txid {max}");
    assert!(!acked || max >= next + 1, "acknowledged appends {next}..={} are gone after a restart", next + 1);
}

/// R6. An append of session 5 is accepted and waits for its sync when session 6 is fenced in:
/// session 5 must not be told it is durable, and session 6's recovery must see it.
#[test]
fn r6_in_flight_append_of_the_old_session_is_acked_after_the_new_session_was_served() {
    let d = tempfile::tempdir().unwrap();
    let (s, gate) = gated_storage(d.path(), 1);
    let node = server::start(s.clone(), "127.0.0.1:0", None, NodeOptions::default()).unwrap();
    let mut a = Client::connect(node.addr, 1);
    let h = a.h(5, 0);
    assert!(matches!(a.call(Request::SetLowWaterMark { h, low_water_mark: -1 }), Response::Success { .. }));
    let h = a.h(5, 0);
    assert!(matches!(a.call(Request::Append { h, records: recs(0, 5, 10) }), Response::Success { .. }));
    gate.arm("seg");
    let h = a.h(5, 0);
    a.send(&Request::Append { h, records: recs(5, 1, 10) });
    gate.wait_blocked(1);
    let mut c = Client::connect(node.addr, 1);
    // Session 6 is fenced in (its first request), then asks what the replica holds.
    let h = c.h(6, 0);
    assert!(matches!(c.call(Request::LastSessionInfo { h }), Response::LastSessionInfo { .. }));
    let h = c.h(6, 0);
    c.send(&Request::MaxTransactionId { h });
    // The answer waits for the sync covering session 5's accepted append: none may come while
    // that sync is held (before, the node answered 4 at once, and txid 5 landed after the
    // vote, above a log the new session believed ended at 4).
    c.s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    let early = c.try_recv();
    assert!(early.is_err(), "session 6 was told the max before the append it must count was synced: {early:?}");
    c.s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    gate.release();
    let seen = match c.recv() {
        Response::MaxTransactionId { txid, .. } => txid,
        other => panic!("{other:?}"),
    };
    assert_eq!(seen, 5, "the max must count session 5's append accepted before the fence");
    let late = a.recv();
    eprintln!("session 6 saw max txid {seen}; session 5's in-flight append then got {late:?}");
    assert!(
        !matches!(late, Response::Success { .. }),
        "session 5 was told txid 5 is durable after session 6 was fenced in"
    );
    drop(node);
    s.close();
}

/// R7. Taking a replica out of the write path (Set Availability, not writable) while an append it
/// accepted waits for its sync: the answer must wait for that sync, so that the Status read next
/// (recover-partition's source of the replica's max) counts the append, and no append may be
/// accepted after the answer. Before, the answer came at once, the status missed the append, and
/// it landed after the copy was planned from a lower max.
#[test]
fn r7_set_availability_answers_after_the_appends_it_shuts_out_are_synced() {
    let d = tempfile::tempdir().unwrap();
    let (s, gate) = gated_storage(d.path(), 1);
    let node = server::start(s.clone(), "127.0.0.1:0", Some("127.0.0.1:0"), NodeOptions::default()).unwrap();
    let mut a = Client::connect(node.addr, 1);
    let h = a.h(5, 0);
    assert!(matches!(a.call(Request::SetLowWaterMark { h, low_water_mark: -1 }), Response::Success { .. }));
    let h = a.h(5, 0);
    assert!(matches!(a.call(Request::Append { h, records: recs(0, 5, 10) }), Response::Success { .. }));
    gate.arm("seg");
    let h = a.h(5, 0);
    a.send(&Request::Append { h, records: recs(5, 1, 10) });
    gate.wait_blocked(1);

    let mut adm = admin(node.admin_addr.unwrap());
    adm.send(&AdminRequest::SetAvailability { h: ah(0), readable: true, writable: false });
    adm.s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    let early = adm.try_recv();
    assert!(early.is_err(), "Set Availability answered while an append it must wait for was syncing: {early:?}");
    adm.s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    gate.release();
    assert!(matches!(adm.recv(), AdminResponse::Success { .. }));
    assert!(matches!(a.recv(), Response::Success { .. }), "the append accepted before is acknowledged once synced");
    match adm.call(AdminRequest::Status { h: ah(-1) }) {
        AdminResponse::Status { partitions, .. } => {
            assert_eq!(partitions.len(), 1);
            assert_eq!(partitions[0].max_txid, 5, "the status must count the append accepted before");
            assert!(!partitions[0].writable);
        }
        other => panic!("{other:?}"),
    }
    let h = a.h(5, 0);
    match a.call(Request::Append { h, records: recs(6, 1, 10) }) {
        Response::Failure { message, .. } => assert!(message.contains("not writable"), "{message}"),
        other => panic!("an append after Set Availability (not writable) was answered {other:?}"),
    }
    let h = a.h(5, 0);
    match a.call(Request::Truncate { h, txid: 2 }) {
        Response::Failure { message, .. } => assert!(message.contains("not writable"), "{message}"),
        other => panic!("a truncate after Set Availability (not writable) was answered {other:?}"),
    }
    let h = a.h(5, 0);
    match a.call(Request::SetLowWaterMark { h, low_water_mark: 5 }) {
        Response::Failure { message, .. } => assert!(message.contains("not writable"), "{message}"),
        other => panic!("a mark set after Set Availability (not writable) was answered {other:?}"),
    }
    match adm.call(AdminRequest::Status { h: ah(-1) }) {
        AdminResponse::Status { partitions, .. } => {
            assert_eq!((partitions[0].max_txid, partitions[0].low_water_mark), (5, -1))
        }
        other => panic!("{other:?}"),
    }
    drop(node);
    s.close();
}

fn status_of_0(adm: &mut Admin) -> (i64, i64, bool) {
    match adm.call(AdminRequest::Status { h: ah(-1) }) {
        AdminResponse::Status { partitions, .. } => {
            (partitions[0].max_txid, partitions[0].low_water_mark, partitions[0].writable)
        }
        other => panic!("{other:?}"),
    }
}

/// R8. Set Availability (not writable) waits for the partition's fence gate, and a Truncate and a
/// Set Low-water Mark arrive behind it: neither may change the replica after Set Availability
/// has answered (recover-partition plans its copy from the status it reads next). Before, both
/// checked writability on arrival, before taking the gate, so both passed and ran right after
/// Set Availability's answer. The test holds the gate itself to line the three up; who gets it
/// first when it lets go is the lock's choice (a waiting writer, in practice), so the round is
/// played several times.
#[test]
fn r8_mutations_waiting_behind_set_availability_at_the_gate_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let (s, _) = gated_storage(d.path(), 1);
    let node = server::start(s.clone(), "127.0.0.1:0", Some("127.0.0.1:0"), NodeOptions::default()).unwrap();
    let mut a = Client::connect(node.addr, 1);
    let mut b = Client::connect(node.addr, 1);
    let mut adm = admin(node.admin_addr.unwrap());
    let h = a.h(5, 0);
    assert!(matches!(a.call(Request::SetLowWaterMark { h, low_water_mark: -1 }), Response::Success { .. }));
    let gate = s.fence_gate(0);
    let (mut ran_before, mut refused) = (0, 0);
    for round in 0..12i64 {
        assert!(matches!(
            adm.call(AdminRequest::SetAvailability { h: ah(0), readable: true, writable: true }),
            AdminResponse::Success { .. }
        ));
        let (max, _, _) = status_of_0(&mut adm);
        let h = a.h(5, 0);
        assert!(matches!(a.call(Request::Append { h, records: recs(max + 1, 3, 10) }), Response::Success { .. }));
        let held = gate.write().unwrap();
        adm.send(&AdminRequest::SetAvailability { h: ah(0), readable: true, writable: false });
        std::thread::sleep(Duration::from_millis(100)); // Set Availability waits at the gate
        let h = a.h(5, 0);
        a.send(&Request::Truncate { h, txid: max + 2 });
        let h = b.h(5, 0);
        b.send(&Request::SetLowWaterMark { h, low_water_mark: max + 1 });
        std::thread::sleep(Duration::from_millis(100)); // and so do both of these, behind it
        drop(held);
        assert!(matches!(adm.recv(), AdminResponse::Success { .. }));
        let answered = status_of_0(&mut adm);
        assert!(!answered.2);
        let (truncated, marked) = (a.recv(), b.recv());
        for r in [&truncated, &marked] {
            match r {
                Response::Failure { message, .. } => {
                    assert!(message.contains("not writable"), "{message}");
                    refused += 1;
                }
                _ => ran_before += 1,
            }
        }
        assert_eq!(status_of_0(&mut adm), answered,
                   "round {round}: the replica changed after Set Availability (not writable) answered: {truncated:?} {marked:?}");
    }
    // A writer waiting is given the gate before readers that came after it: unless the threads
    // were late for every round, some mutations came in behind Set Availability. The old check
    // on arrival let every one of them through (24 of 24 ran on a replica taken out of the path).
    assert!(refused > 0, "no mutation waiting behind Set Availability (not writable) was refused ({ran_before} ran)");
    drop(node);
    s.close();
}

// ---------------------------------------------------------------- connection limits
// Not races: what a peer may cost the node before and after Open, over the same tiny clients.

/// Reads (and drops) what the node sends until it closes the connection (true) or `within` passed
/// with the connection still open (false). Also the number of bytes read.
fn closed_by_node(s: &mut TcpStream, within: Duration) -> (bool, usize) {
    let deadline = Instant::now() + within;
    let mut chunk = vec![0u8; 1 << 16];
    let mut read = 0;
    while let Some(left) = deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) {
        s.set_read_timeout(Some(left.min(Duration::from_millis(200)))).unwrap();
        match s.read(&mut chunk) {
            Ok(0) => return (true, read),
            Ok(n) => read += n,
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
            Err(_) => return (true, read), // reset
        }
    }
    (false, read)
}

fn short_idle() -> NodeOptions {
    NodeOptions { idle_timeout: Duration::from_secs(1), ..NodeOptions::default() }
}

/// A peer that never opens may not hold a connection (a thread and three descriptors) for long,
/// even while it keeps talking: a flood of such connections ran the node out of file descriptors
/// until a segment roll failed and poisoned the partition. Before, only silence for idle_timeout
/// closed a connection, so these stayed.
#[test]
fn l1_a_peer_that_does_not_open_is_closed_at_the_open_deadline_on_both_ports() {
    let d = tempfile::tempdir().unwrap();
    let (s, _) = gated_storage(d.path(), 1);
    let opts = NodeOptions { idle_timeout: Duration::from_secs(2), ..NodeOptions::default() };
    let node = server::start(s.clone(), "127.0.0.1:0", Some("127.0.0.1:0"), opts).unwrap();
    let (mut greeted, mut refused) = (Conn::<StoragePort>::connect(node.addr), Conn::<StoragePort>::connect(node.addr));
    assert!(matches!(
        greeted.call(Request::Hello { min_version: 1, max_version: 1, credential: None }),
        Response::HelloOk { .. }
    ));
    assert!(matches!(
        refused.call(Request::Hello { min_version: 1, max_version: 1, credential: None }),
        Response::HelloOk { .. }
    ));
    let h = MsgHeader { session_id: -1, seq: 1, partition_id: -1 };
    match refused.call(Request::Open { h, cluster_key: [8; 16], partition_count: 1 }) {
        Response::Failure { .. } => {}
        other => panic!("an Open with another cluster's key was answered {other:?}"),
    }
    let mut adm = Admin::connect(node.admin_addr.unwrap());
    assert!(matches!(
        adm.call(AdminRequest::Hello { min_version: 1, max_version: 1, credential: None }),
        AdminResponse::HelloOk { .. }
    ));
    let start = Instant::now();
    let (mut open, mut admin_open) = (2, true);
    let (mut conns, mut seq) = ([Some(greeted), Some(refused)], 1);
    // Chatter every 200 ms (each answered "send Open first"), for well past the deadline.
    while start.elapsed() < Duration::from_secs(8) && (open > 0 || admin_open) {
        seq += 1;
        let h = MsgHeader { session_id: 1, seq, partition_id: 0 };
        for c in conns.iter_mut() {
            let served = c.as_mut().is_some_and(|conn| {
                matches!(conn.try_recv_after(Request::LastSessionInfo { h }), Ok(Response::Failure { .. }))
            });
            if c.is_some() && !served {
                *c = None;
                open -= 1;
            }
        }
        if admin_open {
            admin_open = matches!(adm.try_recv_after(AdminRequest::Status { h }), Ok(AdminResponse::Failure { .. }));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        (open, admin_open),
        (0, false),
        "connections that never opened were still served after {:?}",
        start.elapsed()
    );
    // And an opened connection is not subject to the deadline.
    let mut c = Client::connect(node.addr, 1);
    std::thread::sleep(Duration::from_millis(2500));
    assert!(matches!(max_txid(&mut c, 1, 0), Response::MaxTransactionId { .. }));
    drop(node);
    s.close();
}

/// Connections beyond `max_connections` on a port are closed as soon as they are accepted; a
/// connection that ends gives its place back.
#[test]
fn l2_connections_over_max_connections_are_closed_at_once() {
    let d = tempfile::tempdir().unwrap();
    let (s, _) = gated_storage(d.path(), 1);
    let opts = NodeOptions { max_connections: 2, ..NodeOptions::default() };
    let node = server::start(s.clone(), "127.0.0.1:0", Some("127.0.0.1:0"), opts).unwrap();
    let admin_addr = node.admin_addr.unwrap();
    let mut a = Client::connect(node.addr, 1);
    let b = Client::connect(node.addr, 1);
    let mut third = TcpStream::connect(node.addr).unwrap();
    assert!(closed_by_node(&mut third, Duration::from_secs(5)).0, "a third storage connection was kept");
    assert_eq!(node.stats().refused_connections.load(std::sync::atomic::Ordering::Relaxed), 1);
    let (mut x, _y) = (admin(admin_addr), admin(admin_addr));
    let mut third = TcpStream::connect(admin_addr).unwrap();
    assert!(closed_by_node(&mut third, Duration::from_secs(5)).0, "a third admin connection was kept");
    // Those admitted are served; one that ends frees its place.
    assert!(matches!(max_txid(&mut a, 1, 0), Response::MaxTransactionId { .. }));
    assert!(matches!(x.call(AdminRequest::Status { h: ah(-1) }), AdminResponse::Status { .. }));
    drop(b);
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut c = loop {
        let mut c = Conn::<StoragePort>::connect(node.addr);
        c.send(&Request::Hello { min_version: 1, max_version: 1, credential: None });
        if let Ok(Response::HelloOk { .. }) = c.try_recv() {
            break c;
        }
        assert!(Instant::now() < deadline, "the place of a closed connection was not given back");
        std::thread::sleep(Duration::from_millis(50));
    };
    let h = MsgHeader { session_id: -1, seq: 1, partition_id: -1 };
    assert!(matches!(c.call(Request::Open { h, cluster_key: KEY, partition_count: 1 }), Response::Success { .. }));
    drop(node);
    s.close();
}

/// An opened storage connection is a store session's link to its replica: a quiet partition
/// (no appends for longer than idle_timeout) must not cost it. Before, the node closed it after
/// idle_timeout of silence and the session's next append found every replica gone.
#[test]
fn l3_an_opened_storage_connection_survives_silence_longer_than_idle_timeout() {
    let d = tempfile::tempdir().unwrap();
    let (s, _) = gated_storage(d.path(), 1);
    let node = server::start(s.clone(), "127.0.0.1:0", Some("127.0.0.1:0"), short_idle()).unwrap();
    let mut a = Client::connect(node.addr, 1);
    let h = a.h(1, 0);
    assert!(matches!(a.call(Request::SetLowWaterMark { h, low_water_mark: -1 }), Response::Success { .. }));
    std::thread::sleep(Duration::from_secs(3));
    let h = a.h(1, 0);
    match a.try_recv_after(Request::Append { h, records: recs(0, 2, 10) }) {
        Ok(Response::Success { .. }) => {}
        other => panic!("an append after 3 s of silence (idle_timeout 1 s) was answered {other:?}"),
    }
    // The admin port keeps closing silent connections.
    let mut adm = admin(node.admin_addr.unwrap());
    assert!(closed_by_node(&mut adm.s, Duration::from_secs(5)).0, "a silent admin connection outlived idle_timeout");
    drop(node);
    s.close();
}

impl<P: Port> Conn<P> {
    /// Sends `r` and waits for its answer; Err when the connection was closed on either way.
    fn try_recv_after(&mut self, r: P::Req) -> io::Result<P::Resp> {
        let mut b = Vec::new();
        P::encode(&r, &mut b);
        self.s.write_all(&b)?;
        self.try_recv()
    }
}

/// Before Open a frame may not be large (Hello and Open are tiny): a peer that proved nothing
/// could make the node buffer up to max_frame (64 MiB) per connection. After Open, as before.
#[test]
fn l4_frames_above_the_pre_open_limit_close_a_connection_not_opened() {
    let d = tempfile::tempdir().unwrap();
    let (s, _) = gated_storage(d.path(), 1);
    let node = server::start(s.clone(), "127.0.0.1:0", Some("127.0.0.1:0"), NodeOptions::default()).unwrap();
    let claim_1mib = |s: &mut TcpStream| {
        let mut b = (1u32 << 20).to_be_bytes().to_vec();
        b.extend_from_slice(&[0; 1000]);
        s.write_all(&b).unwrap();
    };
    let mut c = Conn::<StoragePort>::connect(node.addr);
    claim_1mib(&mut c.s);
    assert!(closed_by_node(&mut c.s, Duration::from_secs(3)).0, "a 1 MiB frame was taken before Hello");
    let mut c = Conn::<StoragePort>::connect(node.addr);
    assert!(matches!(
        c.call(Request::Hello { min_version: 1, max_version: 1, credential: None }),
        Response::HelloOk { .. }
    ));
    claim_1mib(&mut c.s);
    assert!(closed_by_node(&mut c.s, Duration::from_secs(3)).0, "a 1 MiB frame was taken before Open");
    let mut a = Admin::connect(node.admin_addr.unwrap());
    assert!(matches!(
        a.call(AdminRequest::Hello { min_version: 1, max_version: 1, credential: None }),
        AdminResponse::HelloOk { .. }
    ));
    claim_1mib(&mut a.s);
    assert!(closed_by_node(&mut a.s, Duration::from_secs(3)).0, "a 1 MiB admin frame was taken before Open");
    // Hello, Open and a 1 MiB append in one write: the append comes after Open succeeded.
    let mut c = Conn::<StoragePort>::connect(node.addr);
    let h = |seq| MsgHeader { session_id: 1, seq, partition_id: 0 };
    let mut b = Vec::new();
    Request::Hello { min_version: 1, max_version: 1, credential: None }.encode(&mut b);
    Request::Open { h: h(1), cluster_key: KEY, partition_count: 1 }.encode(&mut b);
    Request::SetLowWaterMark { h: h(2), low_water_mark: -1 }.encode(&mut b);
    Request::Append { h: h(3), records: recs(0, 1, 1 << 20) }.encode(&mut b);
    c.s.write_all(&b).unwrap();
    assert!(matches!(c.recv(), Response::HelloOk { .. }));
    for _ in 0..3 {
        assert!(matches!(c.recv(), Response::Success { .. }));
    }
    drop(node);
    s.close();
}

/// The admin port's answers are sent with a time limit too: a peer that asks for record lists
/// and reads nothing is closed after idle_timeout. Before, the node's write waited forever,
/// holding the connection and its answer; once read, every answer was there.
#[test]
fn l5_an_admin_peer_that_reads_nothing_is_closed_after_idle_timeout() {
    let d = tempfile::tempdir().unwrap();
    let (s, _) = gated_storage(d.path(), 1);
    let node = server::start(s.clone(), "127.0.0.1:0", Some("127.0.0.1:0"), short_idle()).unwrap();
    let mut a = Client::connect(node.addr, 1);
    let h = a.h(1, 0);
    assert!(matches!(a.call(Request::SetLowWaterMark { h, low_water_mark: -1 }), Response::Success { .. }));
    let h = a.h(1, 0);
    assert!(matches!(a.call(Request::Append { h, records: recs(0, 8, 1 << 20) }), Response::Success { .. }));
    let mut adm = admin(node.admin_addr.unwrap());
    let asked = 16;
    for i in 0..asked {
        let h = MsgHeader { session_id: 0, seq: 10 + i, partition_id: 0 };
        adm.send(&AdminRequest::RecordList { h, txid: 0, max_count: 100 });
    }
    std::thread::sleep(Duration::from_secs(4));
    let (closed, read) = closed_by_node(&mut adm.s, Duration::from_secs(20));
    assert!(closed);
    let answer = 8 * (1 << 20);
    assert!(
        read < asked as usize * answer,
        "all {asked} answers were sent to a peer that read nothing for 4 s ({read} bytes)"
    );
    drop(node);
    s.close();
}

/// The cluster-key mismatch answer is for a peer not yet trusted: it must not carry the node's key.
#[test]
fn l6_a_cluster_key_mismatch_does_not_reveal_the_nodes_key() {
    let d = tempfile::tempdir().unwrap();
    let (s, _) = gated_storage(d.path(), 1);
    let node = server::start(s.clone(), "127.0.0.1:0", None, NodeOptions::default()).unwrap();
    let mut c = Conn::<StoragePort>::connect(node.addr);
    assert!(matches!(
        c.call(Request::Hello { min_version: 1, max_version: 1, credential: None }),
        Response::HelloOk { .. }
    ));
    let h = MsgHeader { session_id: -1, seq: 1, partition_id: -1 };
    let ours = waltz_native::engine::format::format_uuid(&KEY);
    match c.call(Request::Open { h, cluster_key: [8; 16], partition_count: 1 }) {
        Response::Failure { message, .. } => {
            assert!(
                !message.contains(&ours) && !message.contains(&ours.replace('-', "")),
                "the answer tells the node's key: {message}"
            )
        }
        other => panic!("{other:?}"),
    }
    drop(node);
    s.close();
}

/// Many small requests after one large frame (the read buffer grown to its size) are all answered,
/// in order. Taking each frame off the front of that buffer made this quadratic.
#[test]
fn l7_many_small_frames_after_a_large_one_are_all_answered_in_order() {
    let d = tempfile::tempdir().unwrap();
    let (s, _) = gated_storage(d.path(), 1);
    let node = server::start(s.clone(), "127.0.0.1:0", None, NodeOptions::default()).unwrap();
    let mut c = Client::connect(node.addr, 1);
    let h = c.h(1, 0);
    assert!(matches!(c.call(Request::SetLowWaterMark { h, low_water_mark: -1 }), Response::Success { .. }));
    let mut b = Vec::new();
    let h = c.h(1, 0);
    Request::Append { h, records: recs(0, 1, 8 << 20) }.encode(&mut b);
    let first = c.seq + 1;
    let n = 50_000;
    for _ in 0..n {
        let h = c.h(1, 0);
        Request::LastSessionInfo { h }.encode(&mut b);
    }
    let mut w = c.s.try_clone().unwrap();
    let writer = std::thread::spawn(move || w.write_all(&b).unwrap());
    assert!(matches!(c.recv(), Response::Success { .. }));
    for i in 0..n {
        match c.recv() {
            Response::LastSessionInfo { h, session_id: 1, low_water_mark: -1 } if h.seq == first + i => {}
            other => panic!("answer {i}: {other:?}"),
        }
    }
    writer.join().unwrap();
    drop(node);
    s.close();
}

/// A peer that keeps reading, however slowly, gets its whole answer: the write timeout runs from
/// the last bytes it took. Before, idle_timeout bounded the whole write of an answer of up to
/// `max_list_bytes`, so a reader slower than that rate was cut off mid-answer ("it read nothing").
#[test]
fn l8_a_slow_reader_that_keeps_reading_gets_its_whole_answer() {
    let d = tempfile::tempdir().unwrap();
    let (s, _) = gated_storage(d.path(), 1);
    let node = server::start(s.clone(), "127.0.0.1:0", None, short_idle()).unwrap();
    let mut c = Client::connect(node.addr, 1);
    let h = c.h(1, 0);
    assert!(matches!(c.call(Request::SetLowWaterMark { h, low_water_mark: -1 }), Response::Success { .. }));
    let h = c.h(1, 0);
    assert!(matches!(c.call(Request::Append { h, records: recs(0, 8, 1 << 20) }), Response::Success { .. }));
    let h = c.h(1, 0);
    c.send(&Request::RecordList { h, txid: 0, max_count: 100 });
    // 256 KiB per 100 ms: the 8 MiB answer takes about 3 s, three idle timeouts.
    let mut got = Vec::new();
    let mut chunk = vec![0u8; 256 << 10];
    c.s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let listed = loop {
        if let Some(f) = split_frame(&got, MAGIC_STORAGE, 1 << 30).unwrap() {
            break Response::decode(&f).unwrap();
        }
        std::thread::sleep(Duration::from_millis(100));
        let n = c.s.read(&mut chunk).unwrap();
        assert!(n > 0, "closed after {} bytes of the answer", got.len());
        got.extend_from_slice(&chunk[..n]);
    };
    match listed {
        Response::RecordList { records, .. } => {
            assert_eq!(records.iter().map(|r| r.txid).collect::<Vec<_>>(), (0..8).collect::<Vec<_>>())
        }
        other => panic!("{other:?}"),
    }
    drop(node);
    s.close();
}

/// An Open that fails on a connection already opened leaves it unopened: before, the Failure
/// was answered and the connection went on serving under the earlier Open.
#[test]
fn l9_a_failed_second_open_leaves_the_connection_unopened() {
    let d = tempfile::tempdir().unwrap();
    let (s, _) = gated_storage(d.path(), 1);
    let node = server::start(s.clone(), "127.0.0.1:0", Some("127.0.0.1:0"), NodeOptions::default()).unwrap();
    let mut c = Client::connect(node.addr, 1);
    let h = c.h(-1, -1);
    assert!(matches!(c.call(Request::Open { h, cluster_key: [8; 16], partition_count: 1 }), Response::Failure { .. }));
    let h = c.h(1, 0);
    assert!(!matches!(c.try_recv_after(Request::MaxTransactionId { h }), Ok(Response::MaxTransactionId { .. })));
    let mut a = admin(node.admin_addr.unwrap());
    assert!(matches!(
        a.call(AdminRequest::Open { h: ah(-1), cluster_key: [8; 16], partition_count: 1 }),
        AdminResponse::Failure { .. }
    ));
    assert!(!matches!(a.try_recv_after(AdminRequest::Status { h: ah(-1) }), Ok(AdminResponse::Status { .. })));
    drop(node);
    s.close();
}
