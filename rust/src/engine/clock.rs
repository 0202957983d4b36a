//! The wall clock Waltz reads: the system clock, or, when `WALTZ_CLOCK_FILE` names a file, the
//! system clock stepped and skewed as that file says. The torture run's clock faults write the
//! file of one process at a time (python/waltz/clock.py reads the same format: three numbers,
//! `offset_ms rate since_ms`; the clock shows `system + offset + (rate - 1) * (system - since)`).
//! Without the variable a read is one atomic load more than `SystemTime::now`.

use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The environment variable that names the clock file.
pub const CLOCK_FILE_ENV: &str = "WALTZ_CLOCK_FILE";
/// A changed file is noticed within this long: its mtime is looked at no more often.
const CHECK_EVERY: Duration = Duration::from_millis(100);

/// Milliseconds since the Unix epoch by this process's clock (0 on a clock before 1970).
pub fn now_ms() -> i64 {
    let system = system_ms();
    match FILE_CLOCK.get_or_init(|| std::env::var_os(CLOCK_FILE_ENV).map(|p| Mutex::new(FileClock::new(p.into())))) {
        None => system,
        Some(clock) => clock.lock().unwrap_or_else(|e| e.into_inner()).at(system, Instant::now()),
    }
}

fn system_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

static FILE_CLOCK: OnceLock<Option<Mutex<FileClock>>> = OnceLock::new();

/// The step and skew a clock file describes; no file (or an unreadable one) is no step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adjustment {
    pub offset_ms: f64,
    pub rate: f64,
    pub since_ms: f64,
}

impl Adjustment {
    pub const NONE: Adjustment = Adjustment { offset_ms: 0.0, rate: 1.0, since_ms: 0.0 };

    pub fn parse(text: &str) -> Option<Adjustment> {
        let mut it = text.split_whitespace().map(str::parse::<f64>);
        let (offset_ms, rate, since_ms) = (it.next()?.ok()?, it.next()?.ok()?, it.next()?.ok()?);
        (offset_ms.is_finite() && rate.is_finite() && rate > 0.0 && since_ms.is_finite()).then_some(Adjustment {
            offset_ms,
            rate,
            since_ms,
        })
    }

    pub fn apply(&self, system_ms: i64) -> i64 {
        let s = system_ms as f64;
        (s + self.offset_ms + (self.rate - 1.0) * (s - self.since_ms)) as i64
    }
}

/// The file, re-read when its mtime changes (looked at every `CHECK_EVERY` at most).
pub struct FileClock {
    path: PathBuf,
    checked: Option<Instant>,
    mtime: Option<SystemTime>,
    adjustment: Adjustment,
}

impl FileClock {
    pub fn new(path: PathBuf) -> FileClock {
        FileClock { path, checked: None, mtime: None, adjustment: Adjustment::NONE }
    }

    /// This clock's time when the system clock says `system_ms` (read at `now`).
    pub fn at(&mut self, system_ms: i64, now: Instant) -> i64 {
        if self.checked.is_none_or(|c| now.duration_since(c) >= CHECK_EVERY) {
            self.checked = Some(now);
            let mtime = std::fs::metadata(&self.path).and_then(|m| m.modified()).ok();
            if mtime != self.mtime {
                self.mtime = mtime;
                self.adjustment = std::fs::read_to_string(&self.path)
                    .ok()
                    .and_then(|t| Adjustment::parse(&t))
                    .unwrap_or(Adjustment::NONE);
            }
        }
        self.adjustment.apply(system_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_and_skews_as_the_file_says_and_rereads_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("clock");
        let mut clock = FileClock::new(path.clone());
        let t0 = Instant::now();
        assert_eq!(clock.at(1_000_000, t0), 1_000_000, "no file: the system clock");
        std::fs::write(&path, "-60000 1 0\n").unwrap();
        assert_eq!(clock.at(1_000_000, t0 + Duration::from_millis(10)), 1_000_000, "not looked at yet");
        assert_eq!(clock.at(1_000_000, t0 + CHECK_EVERY), 940_000);
        // A new mtime: the write may land in the same mtime tick, so set one explicitly.
        std::fs::write(&path, "0 2 1000000").unwrap();
        let f = std::fs::File::options().write(true).open(&path).unwrap();
        f.set_modified(SystemTime::now() + Duration::from_secs(5)).unwrap();
        assert_eq!(clock.at(1_010_000, t0 + 2 * CHECK_EVERY), 1_020_000, "twice as fast since 1000000");
        std::fs::remove_file(&path).unwrap();
        assert_eq!(clock.at(1_010_000, t0 + 3 * CHECK_EVERY), 1_010_000, "healed: the file is gone");
    }

    #[test]
    fn rejects_what_is_not_a_clock() {
        assert_eq!(Adjustment::parse("5 0.5 7"), Some(Adjustment { offset_ms: 5.0, rate: 0.5, since_ms: 7.0 }));
        for bad in ["", "1 2", "x 1 0", "0 0 0", "0 -1 0", "0 NaN 0"] {
            assert_eq!(Adjustment::parse(bad), None, "{bad:?}");
        }
    }
}
