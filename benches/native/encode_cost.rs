//! Per-record cost of the append path without I/O: encoding into the queue, against a batch laid
//! out as records when built (`LaidBatch`: the build, then the id patch each append pays).
//! `cargo run --release --no-default-features --example encode_cost`
use std::hint::black_box;
use std::time::Instant;
use waltz_native::engine::batch::LaidBatch;
use waltz_native::engine::record::{crc32, encode_record, NewRecord, ReqId};

/// Nanoseconds per record of `f` over batches of 1,000, the best of `rounds` (the machine is shared).
fn best_ns(rounds: usize, mut f: impl FnMut()) -> f64 {
    (0..rounds)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_nanos() as f64 / 1000.0
        })
        .fold(f64::MAX, f64::min)
}

fn main() {
    for size in [100usize, 1024, 65536] {
        let data = vec![5u8; size];
        let crc = crc32(&data);
        let recs: Vec<NewRecord<'_>> = (0..1000)
            .map(|_| NewRecord { req_id: ReqId::default(), header: 0, data: &data, data_crc: Some(crc) })
            .collect();
        let rounds = (200_000_000 / (size * 1000)).clamp(3, 200);
        let mut out = Vec::new();
        let encode = best_ns(rounds, || {
            out.clear();
            for (i, r) in recs.iter().enumerate() {
                encode_record(&mut out, i as i64, r);
            }
            black_box(&out);
        });
        // What a RecordBatch cost to build before it was laid out: the data copied into a buffer
        // of its own (grown as records come, as both builds do), its CRC.
        let copy_and_crc = best_ns(rounds, || {
            let mut own = Vec::new();
            let crcs: Vec<u32> = recs
                .iter()
                .map(|r| {
                    own.extend_from_slice(r.data);
                    crc32(r.data)
                })
                .collect();
            black_box((own, crcs));
        });
        let unknown_crc: Vec<NewRecord<'_>> = recs.iter().map(|r| NewRecord { data_crc: None, ..*r }).collect();
        let mut laid = LaidBatch::default();
        let build = best_ns(rounds, || {
            laid = LaidBatch::default();
            laid.extend(&unknown_crc);
        });
        let mut first = 0;
        let patch = best_ns(rounds, || {
            first += 1000;
            laid.set_first(first);
        });
        println!(
            "{size:6} B, ns/record: encode {encode:7.1} ({:5.2} GB/s); RecordBatch build: copy + data CRC \
             {copy_and_crc:7.1}, laid out {build:7.1}; id patch {patch:5.1}",
            (size + 40) as f64 / encode
        );
    }
}
