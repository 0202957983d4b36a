//! CRC-32 (IEEE) arithmetic: extending a CRC by another's, so a record's data is hashed once.
//!
//! A record's CRC covers its prefix and its data, and the prefix holds the data's own CRC; read
//! naively, every data byte is hashed twice. CRCs are linear: crc(A ‖ B) = crc(A) · x^(8·|B|) ⊕
//! crc(B) in GF(2)[x] mod P, so the record CRC follows from the prefix's and the data's. The
//! multiply is one carry-less multiplication (`pclmulqdq`) and a four-step reduction; the
//! portable fallback is the 32-step loop. `crc32fast::Hasher::combine` uses that loop once per
//! set bit of the length, which costs more than hashing a 1 KiB record again.

/// The CRC-32 polynomial, reflected: bit 31 is x^0 and bit 0 is x^31.
const POLY: u32 = 0xedb8_8320;

/// a(x) · b(x) mod P, both reflected; the portable way.
const fn multiply_portable(a: u32, mut b: u32) -> u32 {
    let mut p = 0u32;
    let mut i = 0;
    while i < 32 {
        p ^= b & ((a >> (31 - i)) & 1).wrapping_neg();
        b = (b >> 1) ^ ((b & 1).wrapping_neg() & POLY);
        i += 1;
    }
    p
}

/// `X8N[i]` = x^(8·2^i) mod P: appending 2^i zero bytes.
static X8N: [u32; 64] = {
    let mut t = [0u32; 64];
    t[0] = 0x0080_0000; // x^8
    let mut i = 1;
    while i < 64 {
        t[i] = multiply_portable(t[i - 1], t[i - 1]);
        i += 1;
    }
    t
};

/// `BYTE[v]` = v(x) · x^8 mod P for a byte v in the low bits: the classic table-driven step.
static BYTE: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut v = 0;
    while v < 256 {
        let mut c = v as u32;
        let mut k = 0;
        while k < 8 {
            c = (c >> 1) ^ ((c & 1).wrapping_neg() & POLY);
            k += 1;
        }
        t[v] = c;
        v += 1;
    }
    t
};

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "pclmulqdq,sse2")]
#[inline]
unsafe fn multiply_clmul(a: u32, b: u32) -> u32 {
    use std::arch::x86_64::{_mm_clmulepi64_si128, _mm_cvtsi128_si64, _mm_cvtsi64_si128};
    let p = _mm_cvtsi128_si64(_mm_clmulepi64_si128(_mm_cvtsi64_si128(a as i64), _mm_cvtsi64_si128(b as i64), 0)) as u64;
    // Bit k of the raw product is x^(62-k); one shift left makes bit k x^(63-k), so the high
    // word is the product's degrees 0..31, reflected, and the low word its degrees 32..63 as
    // x^32 times a reflected word, which four table steps reduce.
    let p = p << 1;
    let mut lo = p as u32;
    for _ in 0..4 {
        lo = (lo >> 8) ^ BYTE[(lo & 0xff) as usize];
    }
    (p >> 32) as u32 ^ lo
}

/// x^(8·len) mod P: multiplying a CRC by it appends `len` zero bytes.
#[inline(always)]
fn x8n(len: u64, multiply: impl Fn(u32, u32) -> u32) -> u32 {
    let mut p = 0x8000_0000; // x^0
    let mut n = len;
    let mut i = 0;
    while n != 0 {
        if n & 1 != 0 {
            p = multiply(X8N[i], p);
        }
        n >>= 1;
        i += 1;
    }
    p
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "pclmulqdq,sse2")]
unsafe fn extend_clmul(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    let m = |a, b| unsafe { multiply_clmul(a, b) };
    let power = LAST_POWER.with(|last| match last.get() {
        (len, power) if len == len_b => power,
        _ => {
            let power = x8n(len_b, m);
            last.set((len_b, power));
            power
        }
    });
    m(power, crc_a) ^ crc_b
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// The last length and its x^(8·len): a log's records are often all one size, and the
    /// power (a multiply per set bit of the length) cost more than the multiply that uses it
    /// (9 % of a scan's CPU against 19 % for hashing the data, 1 KiB records).
    static LAST_POWER: std::cell::Cell<(u64, u32)> = const { std::cell::Cell::new((0, 0x8000_0000)) };
}

/// The CRC-32 of A ‖ B, from crc(A), crc(B) and |B|.
#[inline]
pub fn extend(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("pclmulqdq") {
        // SAFETY: the CPU has the instruction, checked just above.
        return unsafe { extend_clmul(crc_a, crc_b, len_b) };
    }
    multiply_portable(x8n(len_b, multiply_portable), crc_a) ^ crc_b
}

/// x^(8·len) mod P: `multiply(zeros_power(len), c)` moves a CRC difference `c` over `len`
/// bytes that follow it (`LaidBatch` keeps one per record, the length after its id).
pub fn zeros_power(len: u64) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("pclmulqdq") {
        // SAFETY: the CPU has the instruction, checked just above.
        return x8n(len, |a, b| unsafe { multiply_clmul(a, b) });
    }
    x8n(len, multiply_portable)
}

/// a(x) · b(x) mod P.
#[inline]
pub fn multiply(a: u32, b: u32) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("pclmulqdq") {
        // SAFETY: the CPU has the instruction, checked just above.
        return unsafe { multiply_clmul(a, b) };
    }
    multiply_portable(a, b)
}

/// The CRC of `bytes` without the initial and final inversions: the linear part, so that for
/// messages of one length crc(M ⊕ D) = crc(M) ⊕ `delta(D)`, with D's trailing zero bytes
/// applied by `multiply(zeros_power(n), ·)`. Changing an 8-byte field by XOR `d` changes the CRC
/// by `multiply(zeros_power(bytes after the field), delta(d))`.
#[inline]
pub fn delta(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0u32, |c, b| (c >> 8) ^ BYTE[((c ^ *b as u32) & 0xff) as usize])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator: the tests replay exactly.
    fn next(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_fast_multiply_equals_the_portable_one() {
        if !std::arch::is_x86_feature_detected!("pclmulqdq") {
            return;
        }
        let mut s = 0x9e37_79b9_7f4a_7c15;
        let mut pairs: Vec<(u32, u32)> = (0..100_000).map(|_| (next(&mut s) as u32, next(&mut s) as u32)).collect();
        pairs.extend([(0, 0), (0x8000_0000, 0xffff_ffff), (0xffff_ffff, 0xffff_ffff), (1, 1)]);
        for (a, b) in pairs {
            // SAFETY: the CPU has the instruction, checked above.
            assert_eq!(unsafe { multiply_clmul(a, b) }, multiply_portable(a, b), "{a:#x} * {b:#x}");
        }
    }

    #[test]
    fn the_portable_extend_equals_hashing_the_concatenation() {
        let (a, b) = (b"prefix of a record".as_slice(), [7u8; 1500]);
        let whole: Vec<u8> = a.iter().chain(b.iter()).copied().collect();
        let crc = multiply_portable(x8n(b.len() as u64, multiply_portable), crc32fast::hash(a)) ^ crc32fast::hash(&b);
        assert_eq!(crc, crc32fast::hash(&whole));
    }

    #[test]
    fn extending_equals_hashing_the_concatenation() {
        let mut s = 42;
        let bytes: Vec<u8> = (0..70_000).map(|_| next(&mut s) as u8).collect();
        let mut cuts: Vec<(usize, usize)> = (0..2000)
            .map(|_| {
                let a = next(&mut s) as usize % 100;
                (a, a + next(&mut s) as usize % 3000)
            })
            .collect();
        cuts.extend([(0, 0), (36, 36), (36, 37), (0, 70_000), (36, 36 + 65_536), (10, 10 + 1024)]);
        // Runs of one length, then another and back: the cached power must follow the length.
        cuts.extend([(5, 5 + 1024), (7, 7 + 1024), (5, 5 + 1000), (5, 5 + 1024), (0, 0), (3, 3 + 1024)]);
        for (mid, end) in cuts {
            let (a, b) = (&bytes[..mid], &bytes[mid..end]);
            assert_eq!(
                extend(crc32fast::hash(a), crc32fast::hash(b), b.len() as u64),
                crc32fast::hash(&bytes[..end]),
                "|A| = {mid}, |B| = {}",
                b.len()
            );
        }
    }

    #[test]
    fn a_field_changed_by_xor_changes_the_crc_by_its_shifted_delta() {
        let mut s = 7;
        for len in [8usize, 9, 40, 140, 1064, 4136, 70_000] {
            let mut bytes: Vec<u8> = (0..len).map(|_| next(&mut s) as u8).collect();
            for at in [0, len - 8, len / 2 - (len / 2).min(8)] {
                let before = crc32fast::hash(&bytes);
                let d = next(&mut s).to_be_bytes();
                for (b, x) in bytes[at..at + 8].iter_mut().zip(d) {
                    *b ^= x;
                }
                let after = before ^ multiply(zeros_power((len - at - 8) as u64), delta(&d));
                assert_eq!(after, crc32fast::hash(&bytes), "len {len}, field at {at}");
            }
        }
    }
}
