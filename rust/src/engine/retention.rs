//! Which head of a partition's log retention may delete: a pure function of the segments, the
//! policy and the limit the node computed (its own low-water mark, the floor of transactions
//! kept, the servers' holds). Whole segments only, oldest first, never the last segment.
use crate::engine::partition::SegmentSpan;

/// A partition's retention policy; `None` keeps everything on that count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// A sealed segment goes once its newest record is older than this (milliseconds).
    pub max_age_ms: Option<i64>,
    /// The oldest segments go while the partition holds more than this many bytes.
    pub max_bytes: Option<u64>,
}

impl RetentionPolicy {
    pub fn keeps_everything(&self) -> bool {
        self.max_age_ms.is_none() && self.max_bytes.is_none()
    }
}

/// The first id the partition should start at: the first id of the oldest segment kept. A
/// segment is deleted only if every id in it is below `limit` (so no id at or above `limit` is
/// ever deleted) and the policy lets it go; the deleted segments are a prefix, so the log stays
/// dense. `now_ms` is the wall clock: all records of segment i were written before segment i+1
/// was created, so its age is measured from that creation.
pub fn retention_start(spans: &[SegmentSpan], policy: &RetentionPolicy, limit: i64, now_ms: i64) -> i64 {
    let first = match spans.first() {
        Some(s) => s.first_txid,
        None => return limit,
    };
    if policy.keeps_everything() {
        return first;
    }
    let mut held: u64 = spans.iter().map(|s| s.bytes).sum();
    let mut start = first;
    for w in spans.windows(2) {
        let (seg, next) = (&w[0], &w[1]);
        if next.first_txid > limit {
            break;
        }
        let too_old = policy.max_age_ms.is_some_and(|age| next.creation_ms >= 0 && next.creation_ms <= now_ms - age);
        let too_big = policy.max_bytes.is_some_and(|max| held > max);
        if !(too_old || too_big) {
            break;
        }
        held -= seg.bytes;
        start = next.first_txid;
    }
    start
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spans(n: i64, per: i64, bytes: u64, created_every: i64) -> Vec<SegmentSpan> {
        (0..n)
            .map(|i| SegmentSpan {
                first_txid: i * per,
                next_txid: (i + 1) * per,
                bytes,
                creation_ms: 1_000 + i * created_every,
            })
            .collect()
    }

    #[test]
    fn keep_everything_by_default() {
        let s = spans(5, 10, 100, 1000);
        assert_eq!(retention_start(&s, &RetentionPolicy::default(), i64::MAX, i64::MAX / 2), 0);
    }

    #[test]
    fn age_deletes_sealed_segments_whose_successor_is_old_enough() {
        let s = spans(5, 10, 100, 1000); // created at 1000, 2000, ... 5000
        let p = RetentionPolicy { max_age_ms: Some(500), max_bytes: None };
        // now 2600: segment 1 created at 2000 is older than 500 ms, so segment 0 may go.
        assert_eq!(retention_start(&s, &p, i64::MAX, 2600), 10);
        assert_eq!(retention_start(&s, &p, i64::MAX, 4600), 30);
        // never the last segment, however old
        assert_eq!(retention_start(&s, &p, i64::MAX, 1_000_000), 40);
    }

    #[test]
    fn bytes_delete_the_oldest_while_over() {
        let s = spans(5, 10, 100, 1000);
        let p = RetentionPolicy { max_age_ms: None, max_bytes: Some(250) };
        assert_eq!(retention_start(&s, &p, i64::MAX, 0), 30);
        let p = RetentionPolicy { max_age_ms: None, max_bytes: Some(500) };
        assert_eq!(retention_start(&s, &p, i64::MAX, 0), 0);
    }

    #[test]
    fn never_deletes_an_id_at_or_above_the_limit() {
        let s = spans(5, 10, 100, 1000);
        let p = RetentionPolicy { max_age_ms: Some(0), max_bytes: Some(0) };
        for limit in -1..60 {
            let start = retention_start(&s, &p, limit, 1_000_000);
            assert!(start <= limit.max(0), "limit {limit} start {start}");
            assert_eq!(start % 10, 0);
        }
        assert_eq!(retention_start(&s, &p, 25, 1_000_000), 20);
        assert_eq!(retention_start(&s, &p, 20, 1_000_000), 20);
        assert_eq!(retention_start(&s, &p, 19, 1_000_000), 10);
    }
}
