//! Per-record cost of the append path without I/O: encoding into the queue.
//! `cargo run --release --no-default-features --example encode_cost`
use std::time::Instant;
use waltz_native::engine::record::{crc32, encode_record, NewRecord, ReqId};

fn main() {
    for size in [100usize, 1024, 65536] {
        let data = vec![5u8; size];
        let crc = crc32(&data);
        let recs: Vec<NewRecord<'_>> = (0..1000)
            .map(|_| NewRecord { req_id: ReqId::default(), header: 0, data: &data, data_crc: Some(crc) })
            .collect();
        let mut out = Vec::new();
        let rounds = (200_000_000 / (size * 1000)).max(3);
        let t = Instant::now();
        for _ in 0..rounds {
            out.clear();
            for (i, r) in recs.iter().enumerate() {
                encode_record(&mut out, i as i64, r);
            }
        }
        let ns = t.elapsed().as_nanos() as f64 / (rounds * 1000) as f64;
        println!("{size:6} B: {ns:8.1} ns/record, {:6.2} GB/s", (size + 40) as f64 / ns);
    }
}
