//! Group commit without Python in the way: N threads appending single records to one partition.
//! `cargo run --release --no-default-features --example group_commit -- DIR` (see benches/README.md)
use std::sync::Arc;
use std::time::{Duration, Instant};
use waltz_native::engine::partition::{default_options, Partition};
use waltz_native::engine::record::{NewRecord, ReqId};

fn main() {
    let base = std::env::args().nth(1).expect("usage: group_commit DIR");
    for threads in [1usize, 4, 16, 64] {
        let dir = std::path::Path::new(&base).join(format!("gc{threads}"));
        let _ = std::fs::remove_dir_all(&dir);
        let fs: Arc<dyn waltz_native::engine::fs::FileSystem> = Arc::new(waltz_native::engine::fs::StdFs);
        Partition::create(fs.as_ref(), &dir, 0, [1; 16]).unwrap();
        let p = Arc::new(Partition::open(fs, &dir, 0, [1; 16], default_options()).unwrap());
        let stop = Instant::now() + Duration::from_secs(2);
        let t0 = Instant::now();
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                let p = p.clone();
                std::thread::spawn(move || {
                    let data = vec![7u8; 1024];
                    let mut n = 0u64;
                    while Instant::now() < stop {
                        let r = [NewRecord { req_id: ReqId::default(), header: 0, data: &data, data_crc: None }];
                        p.append_next(&r).unwrap();
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        let total: u64 = hs.into_iter().map(|h| h.join().unwrap()).sum();
        let secs = t0.elapsed().as_secs_f64();
        let s = p.stats();
        println!(
            "{threads:3} threads: {:8.0} records/s, {:6.0} syncs/s, {:5.1} records/sync",
            total as f64 / secs,
            s.syncs as f64 / secs,
            s.records as f64 / s.syncs as f64
        );
    }
}
