//! The admin port: operators' requests (assign, availability, status, maintenance copies),
//! one at a time, answered in order.
use super::connection::{
    bad_frame, check_credential, failure_kind, frame_limit, greet_and_open_deadlines, read_more, send, PeerRole,
    Shared, Slot, Wait,
};
use super::protocol::{
    split_frame, AdminRequest, AdminResponse, FailureKind, FrameBuf, MsgHeader, PartitionStatus, WireRecord,
    MAGIC_ADMIN, VERSION,
};
use super::server::{session_jump_refusal, truncation_refusal};
use crate::engine::partition::lock;
use crate::engine::record::NewRecord;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};

/// The admin port: one request at a time, answered in order.
pub(super) async fn serve_admin<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    peer: SocketAddr,
    shared: Arc<Shared>,
    unopened: Slot,
    mut peer_role: PeerRole,
) {
    let mut unopened = Some(unopened);
    let mut buf = FrameBuf::default();
    let (mut greeted, mut opened) = (false, false);
    let (greet_by, open_by) = greet_and_open_deadlines(&shared);
    let wait = |greeted: bool, opened: bool| match (greeted, opened) {
        (_, true) => Wait::Idle,
        (false, _) => Wait::OpenBy(greet_by),
        (true, false) => Wait::OpenBy(open_by),
    };
    let mut out = Vec::new();
    let reason: String = 'conn: loop {
        loop {
            let (size, req) = match split_frame(buf.pending(), MAGIC_ADMIN, frame_limit(&shared, opened)) {
                Ok(Some(f)) => (f.size, AdminRequest::decode(&f)),
                Ok(None) => break,
                Err(e) => {
                    break 'conn bad_frame(
                        if opened { "bad admin frame" } else { "bad admin frame before Open" },
                        buf.pending(),
                        e,
                    )
                }
            };
            buf.consume(size);
            let req = match req {
                Ok(r) => r,
                Err(e) => break 'conn format!("bad admin frame: {e}"),
            };
            let mut refused = None;
            let resp = match (greeted, req) {
                (false, AdminRequest::Hello { min_version, max_version, credential })
                    if min_version <= VERSION && VERSION <= max_version =>
                {
                    match check_credential(&shared, "admin", peer, credential.as_ref(), &mut peer_role) {
                        Ok(()) => {
                            greeted = true;
                            AdminResponse::HelloOk { version: VERSION }
                        }
                        Err(why) => {
                            refused = Some(format!("refused at Hello: {why}"));
                            admin_fail(MsgHeader::default(), FailureKind::Refused, why)
                        }
                    }
                }
                (false, _) => break 'conn "the first admin frame must be a Hello this node speaks".into(),
                (true, AdminRequest::Hello { .. }) => break 'conn "Hello sent twice".into(),
                (true, AdminRequest::Open { h, cluster_key, partition_count }) => {
                    opened = false; // as on the storage port: a failed Open leaves it unopened
                    let s = &shared.storage;
                    if cluster_key != s.cluster_key {
                        admin_fail(h, FailureKind::ClusterKeyMismatch, "cluster key does not match this storage".into())
                    } else if partition_count != s.partition_count {
                        admin_fail(
                            h,
                            FailureKind::PartitionCountMismatch,
                            format!("this storage has {} partitions", s.partition_count),
                        )
                    } else {
                        opened = true;
                        AdminResponse::Success { h }
                    }
                }
                (true, req) if !opened => {
                    admin_fail(req.header().unwrap_or_default(), FailureKind::NotOpened, "send Open first".into())
                }
                (true, req) => {
                    let sh = shared.clone();
                    let by = Requester { peer, admin: peer_role.is_admin() };
                    match tokio::task::spawn_blocking(move || admin(&sh, req, by)).await {
                        Ok(r) => r,
                        Err(e) => admin_fail(MsgHeader::default(), FailureKind::Internal, e.to_string()),
                    }
                }
            };
            if opened {
                unopened.take(); // its place among the unopened goes back once, at its first Open
            }
            resp.encode(&mut out);
            if let Err(why) = send(&mut stream, &mut out, &shared, wait(greeted, opened)).await {
                break 'conn why;
            }
            if let Some(why) = refused {
                break 'conn why;
            }
        }
        if let Err(why) = read_more(&mut stream, &mut buf, &shared, wait(greeted, opened)).await {
            break why;
        }
    };
    if !reason.is_empty() {
        log::warn!("closing admin connection from {peer}: {reason}");
    }
}

fn admin_fail(h: MsgHeader, kind: FailureKind, message: String) -> AdminResponse {
    AdminResponse::Failure { h, kind, message }
}

/// Who sent an admin request: its address and whether it proved the admin role (which a forced
/// request needs).
struct Requester {
    peer: SocketAddr,
    admin: bool,
}

fn admin(shared: &Shared, req: AdminRequest, by: Requester) -> AdminResponse {
    let s = &shared.storage;
    let h = req.header().unwrap_or_default();
    let pid = h.partition_id;
    match req {
        AdminRequest::Assign { .. } => done(h, s.add_partition(pid).and_then(|_| s.partition(pid).map(|_| ()))),
        AdminRequest::Unassign { delete_files, .. } => {
            let r = s.remove_partition(pid, delete_files);
            lock(&shared.fences).remove(&pid);
            done(h, r)
        }
        AdminRequest::SetAvailability { readable, writable, .. } => set_availability(shared, h, readable, writable),
        AdminRequest::Status { .. } => status(shared, h),
        AdminRequest::RecordList { txid, max_count, .. } => {
            let n = (max_count.max(0) as usize).min(shared.opts.max_list_count);
            match s.partition(pid).and_then(|p| p.read_records(txid, n, shared.opts.max_list_bytes)) {
                Ok(rs) => AdminResponse::RecordList { h, records: rs.into_iter().map(WireRecord::from).collect() },
                Err(e) => admin_fail(h, failure_kind(&e), e.to_string()),
            }
        }
        AdminRequest::Append { records, .. } => append(shared, h, records),
        AdminRequest::SetPartitionInfo { session_id, low_water_mark, .. } => {
            set_partition_info(shared, h, session_id, low_water_mark)
        }
        AdminRequest::ResetFence { session_id, .. } => reset_fence(shared, h, session_id),
        AdminRequest::RestartLog { first_txid, .. } => {
            if let Some(refused) = unless_in_maintenance(shared, h) {
                return refused;
            }
            match s.restart_partition(pid, first_txid) {
                Ok(_) => AdminResponse::Success { h },
                Err(crate::engine::error::Error::InvalidArgument(m)) => admin_fail(h, FailureKind::Refused, m),
                Err(e) => admin_fail(h, failure_kind(&e), e.to_string()),
            }
        }
        AdminRequest::Truncate { txid, force, .. } => truncate(shared, h, txid, force, &by),
        AdminRequest::RaiseFence { session_id, force, .. } => raise_fence(shared, h, session_id, force, &by),
        AdminRequest::Hello { .. } | AdminRequest::Open { .. } => unreachable!("handled by serve_admin"),
    }
}

/// Success, or the error as a Failure.
fn done(h: MsgHeader, r: crate::engine::error::Result<()>) -> AdminResponse {
    match r {
        Ok(()) => AdminResponse::Success { h },
        Err(e) => admin_fail(h, failure_kind(&e), e.to_string()),
    }
}

/// Lowers the partition's fence to `session` (durably, then in the node's memory), for a fence
/// a request no server sent raised out of every server's reach (issue 34). The CLI checks the
/// cluster metadata first: no session the metadata issued may find the fence below it.
fn reset_fence(shared: &Shared, h: MsgHeader, session: i64) -> AdminResponse {
    let pid = h.partition_id;
    let r = shared.storage.lower_fence(pid, session).map(|was| {
        // The storage's fence is lowered; the node's cache of it follows, so the next request of
        // a session at or above `session` is served.
        let mut fences = lock(&shared.fences);
        if fences.get(&pid).is_some_and(|&n| n > session) {
            fences.insert(pid, session);
        }
        log::warn!("partition {pid}: fence lowered from session {was} to {session} by an admin");
    });
    done(h, r)
}

/// A refusal the admin may override with `force`: None lets the request go on (logged loudly
/// when forced), else the answer. Only a peer that proved the admin role may force: a server's
/// certificate may not, and in plaintext mode only the admin secret proves it.
fn unless_forced(h: MsgHeader, what: &str, why: Option<String>, force: bool, by: &Requester) -> Option<AdminResponse> {
    let why = why?;
    if !force {
        log::warn!("refused admin {what} from {}: {why}", by.peer);
        return Some(admin_fail(h, FailureKind::Refused, format!("{why}; an admin may force it (--force)")));
    }
    if !by.admin {
        log::warn!("refused forced admin {what} from {}: it has not proved the admin role ({why})", by.peer);
        let msg = format!(
            "{why}; forcing it needs the admin role (an admin certificate with TLS, the admin secret without), \
             which this connection has not proved"
        );
        return Some(admin_fail(h, FailureKind::Refused, msg));
    }
    log::error!("FORCED by an admin from {}: {what} although {why}", by.peer);
    None
}

/// Truncates a partition under maintenance after `txid`; below its low-water mark only forced.
fn truncate(shared: &Shared, h: MsgHeader, txid: i64, force: bool, by: &Requester) -> AdminResponse {
    let (s, pid) = (&shared.storage, h.partition_id);
    if let Some(refused) = unless_in_maintenance(shared, h) {
        return refused;
    }
    let part = match s.partition(pid) {
        Ok(p) => p,
        Err(e) => return admin_fail(h, failure_kind(&e), e.to_string()),
    };
    let gate = s.fence_gate(pid);
    let _shared = gate.read().unwrap_or_else(|e| e.into_inner());
    let why = match truncation_refusal(shared, pid, &part, txid) {
        Ok(why) => why,
        Err(e) => return admin_fail(h, failure_kind(&e), e.to_string()),
    };
    if let Some(refused) = unless_forced(h, &format!("Truncate of partition {pid} to {txid}"), why, force, by) {
        return refused;
    }
    done(h, part.truncate(txid).map(|_| ()))
}

/// Raises a partition's fence to `session` (a no-op at or below it); more than
/// `MAX_SESSION_JUMP` above it only forced.
fn raise_fence(shared: &Shared, h: MsgHeader, session: i64, force: bool, by: &Requester) -> AdminResponse {
    let (s, pid) = (&shared.storage, h.partition_id);
    let why = match session_jump_refusal(shared, pid, session) {
        Ok(why) => why,
        Err(e) => return admin_fail(h, failure_kind(&e), e.to_string()),
    };
    if let Some(refused) = unless_forced(h, &format!("fence raise of partition {pid}"), why, force, by) {
        return refused;
    }
    match s.raise_fence(pid, session) {
        Ok(Ok(())) => {
            let mut fences = lock(&shared.fences);
            let newest = fences.entry(pid).or_insert(session);
            *newest = (*newest).max(session);
            log::warn!("partition {pid}: fence raised to session {session} by an admin from {}", by.peer);
            AdminResponse::Success { h }
        }
        // Already at or above it: nothing to raise.
        Ok(Err(_)) => AdminResponse::Success { h },
        Err(e) => admin_fail(h, failure_kind(&e), e.to_string()),
    }
}

/// Marks the partition (un)readable and (un)writable for servers on this node.
fn set_availability(shared: &Shared, h: MsgHeader, readable: bool, writable: bool) -> AdminResponse {
    let (s, pid) = (&shared.storage, h.partition_id);
    if pid < 0 || pid >= s.partition_count {
        return admin_fail(h, FailureKind::PartitionNotAssigned, format!("partition {pid} is out of range"));
    }
    {
        // Under the fence gate: an append checks writability and queues under it (shared).
        let gate = s.fence_gate(pid);
        let _exclusive = gate.write().unwrap_or_else(|e| e.into_inner());
        lock(&shared.availability).insert(pid, (readable, writable));
    }
    // Servers kept out: the appends accepted before are synced (or failed) before the
    // answer, so a status read next says what the replica holds for good.
    if !writable {
        if let Some((p, _)) = s.open_partition_info(pid) {
            if let Err(e) = p.settled_max_txid() {
                return admin_fail(h, failure_kind(&e), e.to_string());
            }
        }
    }
    AdminResponse::Success { h }
}

/// Every partition this node has: ids, session, marks, availability and failure.
fn status(shared: &Shared, h: MsgHeader) -> AdminResponse {
    let s = &shared.storage;
    let ids = match s.partition_ids() {
        Ok(ids) => ids,
        Err(e) => return admin_fail(h, failure_kind(&e), e.to_string()),
    };
    let avail = lock(&shared.availability).clone();
    let mut partitions = Vec::new();
    for id in ids {
        let st = s.partition(id).and_then(|p| Ok((p, s.partition_info(id)?)));
        let (readable, writable) = avail.get(&id).copied().unwrap_or((true, true));
        partitions.push(match st {
            Ok((p, info)) => {
                let spans = p.segment_spans().unwrap_or_default();
                PartitionStatus {
                    partition_id: id,
                    first_txid: p.first_txid(),
                    max_txid: p.max_txid(),
                    session_id: info.session_id,
                    low_water_mark: info.low_water_mark,
                    local_low_water_mark: info.local_low_water_mark,
                    newest_session: s.fence(id).unwrap_or(info.session_id),
                    readable,
                    writable,
                    failure: p.is_failed().unwrap_or_default(),
                    bytes_on_disk: spans.iter().map(|s| s.bytes as i64).sum(),
                    oldest_ms: spans.first().map_or(-1, |s| s.creation_ms),
                    reclaimed_bytes: p.reclaimed_bytes() as i64,
                    retention_limit: shared.retention.limit(shared, id),
                    retention_hold: shared.retention.hold(shared, id),
                }
            }
            Err(e) => PartitionStatus {
                partition_id: id,
                first_txid: -1,
                max_txid: -1,
                session_id: -1,
                low_water_mark: -1,
                local_low_water_mark: -1,
                newest_session: -1,
                readable,
                writable,
                failure: format!("cannot open: {e}"),
                bytes_on_disk: -1,
                oldest_ms: -1,
                reclaimed_bytes: 0,
                retention_limit: -1,
                retention_hold: -1,
            },
        });
    }
    AdminResponse::Status { h, partitions }
}

/// A maintenance copy: records read from another replica, appended at their own ids.
fn append(shared: &Shared, h: MsgHeader, records: Vec<WireRecord>) -> AdminResponse {
    let (s, pid) = (&shared.storage, h.partition_id);
    if let Some(refused) = unless_in_maintenance(shared, h) {
        return refused;
    }
    let Some(first) = records.first().map(|r| r.txid) else {
        return AdminResponse::Success { h };
    };
    if let Some((i, r)) = records.iter().enumerate().find(|(i, r)| r.txid != first + *i as i64) {
        let msg = format!("record {i} of the batch has id {}, expected {}", r.txid, first + i as i64);
        return admin_fail(h, FailureKind::NonDenseAppend, msg);
    }
    let recs: Vec<NewRecord<'_>> = records
        .iter()
        .map(|r| NewRecord { req_id: r.req_id, header: r.header, data: &r.data, data_crc: Some(r.data_crc) })
        .collect();
    done(h, s.partition(pid).and_then(|p| p.append(first, &recs)).map(|_| ()))
}

/// Sets the session and low-water mark of a partition under maintenance.
fn set_partition_info(shared: &Shared, h: MsgHeader, session_id: i64, low_water_mark: i64) -> AdminResponse {
    let (s, pid) = (&shared.storage, h.partition_id);
    if let Some(refused) = unless_in_maintenance(shared, h) {
        return refused;
    }
    // Never behind a session this replica has already seen: recovery would take the
    // replica's log for an older session's and the fence would no longer be recorded.
    // Raising only the low-water mark of the session it has is allowed (recover-partition
    // fills a replica that lost its files that way: taking the source's session would
    // hide the loss from recovery); the fence file keeps the newer session.
    let gate = s.fence_gate(pid);
    let _exclusive = gate.write().unwrap_or_else(|e| e.into_inner());
    match (s.fence(pid), s.partition_info(pid)) {
        (Ok(newest), Ok(i)) if session_id < newest && session_id != i.session_id => {
            let msg = format!("session {session_id} of partition {pid} is older than session {newest} seen here");
            return admin_fail(h, FailureKind::StaleSession, msg);
        }
        (_, Ok(i)) if (session_id, low_water_mark) < (i.session_id, i.low_water_mark) => {
            let msg = format!(
                "partition {pid} already has session {} with low-water mark {}",
                i.session_id, i.low_water_mark
            );
            return admin_fail(h, FailureKind::BadRequest, msg);
        }
        (Err(e), _) | (_, Err(e)) => return admin_fail(h, failure_kind(&e), e.to_string()),
        _ => {}
    }
    done(h, s.set_low_water_mark(pid, session_id, low_water_mark).map(|_| ()))
}

/// Admin writes bypass store sessions, so they are refused unless servers are kept out of the
/// partition (marked unwritable with Set Availability).
fn unless_in_maintenance(shared: &Shared, h: MsgHeader) -> Option<AdminResponse> {
    let writable =
        shared.availability.lock().unwrap_or_else(|e| e.into_inner()).get(&h.partition_id).map(|a| a.1).unwrap_or(true);
    writable.then(|| {
        admin_fail(
            h,
            FailureKind::BadRequest,
            format!("partition {} is writable by servers; mark it unwritable before admin writes", h.partition_id),
        )
    })
}
