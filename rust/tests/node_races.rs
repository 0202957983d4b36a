//! Races between sessions, fencing and assignment on a running storage node, driven over TCP
//! with gated fsyncs. Found by an adversarial review; each lost an acknowledged append before
//! its fix.
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use waltz_native::fs::{FileHandle, FileSystem, StdFs};
use waltz_native::node::{self, NodeOptions};
use waltz_native::partition::default_options;
use waltz_native::protocol::{
    split_frame, AdminRequest, AdminResponse, Frame, MsgHeader, Request, Response, WireRecord, MAGIC_ADMIN, MAGIC_STORAGE,
};
use waltz_native::record::{crc32, ReqId};
use waltz_native::storage::Storage;

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
impl FileHandle for GFile {
    fn read_at(&self, b: &mut [u8], o: u64) -> io::Result<usize> {
        self.inner.read_at(b, o)
    }
    fn write_all_at(&self, b: &[u8], o: u64) -> io::Result<()> {
        self.inner.write_all_at(b, o)
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
    fn set_len(&self, l: u64) -> io::Result<()> {
        self.inner.set_len(l)
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn try_lock_exclusive(&self) -> io::Result<bool> {
        self.inner.try_lock_exclusive()
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
        assert!(matches!(c.call(Request::Hello { min_version: 1, max_version: 1 }), Response::HelloOk { .. }));
        let h = c.h(-1, -1);
        assert!(matches!(c.call(Request::Open { h, cluster_key: KEY, partition_count: parts }), Response::Success { .. }));
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
    assert!(matches!(a.call(AdminRequest::Hello { min_version: 1, max_version: 1 }), AdminResponse::HelloOk { .. }));
    assert!(matches!(a.call(AdminRequest::Open { h: ah(-1), cluster_key: KEY, partition_count: 1 }), AdminResponse::Success { .. }));
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
        let node = node::start(s.clone(), "127.0.0.1:0", None, NodeOptions::default()).unwrap();
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
    let node = node::start(s.clone(), "127.0.0.1:0", Some("127.0.0.1:0"), NodeOptions::default()).unwrap();
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
    let node = node::start(s.clone(), "127.0.0.1:0", None, NodeOptions::default()).unwrap();
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
    let node = node::start(s.clone(), "127.0.0.1:0", Some("127.0.0.1:0"), NodeOptions::default()).unwrap();
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
        AdminResponse::Status { partitions, .. } => assert_eq!((partitions[0].max_txid, partitions[0].low_water_mark), (5, -1)),
        other => panic!("{other:?}"),
    }
    drop(node);
    s.close();
}

fn status_of_0(adm: &mut Admin) -> (i64, i64, bool) {
    match adm.call(AdminRequest::Status { h: ah(-1) }) {
        AdminResponse::Status { partitions, .. } => (partitions[0].max_txid, partitions[0].low_water_mark, partitions[0].writable),
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
    let node = node::start(s.clone(), "127.0.0.1:0", Some("127.0.0.1:0"), NodeOptions::default()).unwrap();
    let mut a = Client::connect(node.addr, 1);
    let mut b = Client::connect(node.addr, 1);
    let mut adm = admin(node.admin_addr.unwrap());
    let h = a.h(5, 0);
    assert!(matches!(a.call(Request::SetLowWaterMark { h, low_water_mark: -1 }), Response::Success { .. }));
    let gate = s.fence_gate(0);
    let (mut ran_before, mut refused) = (0, 0);
    for round in 0..12i64 {
        assert!(matches!(adm.call(AdminRequest::SetAvailability { h: ah(0), readable: true, writable: true }), AdminResponse::Success { .. }));
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
