//! crc32c computed on the GPU, for the GPUDirect Storage path (the bytes never reach the CPU).
//!
//! The store checksums every stripe unit with crc32c (Castagnoli, reflected polynomial
//! 0x82F63B78, initial value and final xor 0xFFFFFFFF). The GDS path must record the very same
//! values, so a tensor written by one path reads and verifies through the other. The kernel
//! ([`KERNEL_SOURCE`], compiled at run time with NVRTC) cuts each stripe unit into parts of
//! [`PART_BYTES`] and gives each part one thread block (so a tensor keeps the whole GPU busy):
//!
//! 1. the part is cut into [`THREADS`] pieces of equal length (a multiple of 16 bytes; the last
//!    ones shorter or empty); each thread computes the crc32c of its piece, 8 bytes per step
//!    with slicing-by-8 tables in shared memory (byte by byte where the piece is not 8-byte
//!    aligned, and for its tail);
//! 2. the block combines the pieces' crcs pairwise in a tree, with zlib's crc32_combine rule:
//!    `crc(A || B) = (x^(8|B|) mod P) * crc(A) xor crc(B)` in GF(2)\[x\] (the initial value and
//!    final xor cancel out, so full crc32c values combine directly);
//! 3. the host combines each unit's part crcs the same way ([`combine_parts`]).
//!
//! [`crc32c_like_kernel`] is a CPU mirror of exactly that algorithm (same pieces, same tables,
//! same tree); CI checks it against the `crc32c` crate for random data of odd sizes and
//! alignments, and a GPU test (`cuda::tests`) checks the kernel against the CPU crc32c.

/// Threads per block: pieces per stripe unit.
pub const THREADS: usize = 256;

/// Reflected crc32c polynomial.
const POLY: u32 = 0x82F6_3B78;

/// The CUDA C source of the kernel `teraio_crc32c_units`.
pub const KERNEL_SOURCE: &str = r#"
#define THREADS 256
#define POLY 0x82F63B78u

__device__ unsigned int multmodp(unsigned int a, unsigned int b) {
    unsigned int m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

/* x^(n * 2^k) mod P, with tab[k] = x^(2^k) mod P. */
__device__ unsigned int x2nmodp(unsigned long long n, unsigned int k, const unsigned int* tab) {
    unsigned int p = 1u << 31;
    while (n) {
        if (n & 1) p = multmodp(tab[k & 31], p);
        n >>= 1;
        k++;
    }
    return p;
}

extern "C" __global__ void teraio_crc32c_parts(const unsigned char* data,
                                               unsigned long long len,
                                               unsigned long long unit,
                                               unsigned long long part,
                                               unsigned int parts_per_unit,
                                               unsigned int* out) {
    __shared__ unsigned int tab[8][256];
    __shared__ unsigned int x2n[32];
    __shared__ unsigned int crcs[THREADS];
    __shared__ unsigned long long lens[THREADS];
    const unsigned int t = threadIdx.x;
    /* Tables: tab[0] byte-wise, tab[k][i] = crc of byte i followed by k zero bytes. */
    {
        unsigned int c = t;
        for (int j = 0; j < 8; j++) c = (c & 1) ? (c >> 1) ^ POLY : c >> 1;
        tab[0][t] = c;
    }
    __syncthreads();
    for (int k = 1; k < 8; k++) {
        unsigned int prev = tab[k - 1][t];
        tab[k][t] = (prev >> 8) ^ tab[0][prev & 0xff];
        __syncthreads();
    }
    if (t == 0) {
        unsigned int p = 1u << 30; /* x^1 */
        x2n[0] = p;
        for (int n = 1; n < 32; n++) { p = multmodp(p, p); x2n[n] = p; }
    }
    /* Block b: part b % parts_per_unit of unit b / parts_per_unit. */
    const unsigned long long u = blockIdx.x / parts_per_unit;
    const unsigned long long pidx = blockIdx.x % parts_per_unit;
    const unsigned long long ustart = u * unit;
    const unsigned long long unit_len = (len - ustart < unit) ? (len - ustart) : unit;
    const unsigned long long pstart = pidx * part;
    const unsigned long long ulen =
        pstart >= unit_len ? 0 : ((unit_len - pstart < part) ? (unit_len - pstart) : part);
    const unsigned long long start = ustart + pstart;
    unsigned long long piece = (ulen + THREADS - 1) / THREADS;
    piece = (piece + 15) & ~15ull;
    unsigned long long from = (unsigned long long)t * piece;
    unsigned long long to = from + piece;
    if (from > ulen) from = ulen;
    if (to > ulen) to = ulen;
    const unsigned char* p = data + start + from;
    unsigned long long n = to - from;
    unsigned int crc = 0xFFFFFFFFu;
    if ((((unsigned long long)p) & 7) == 0) {
        const unsigned long long* w = (const unsigned long long*)p;
        unsigned long long words = n / 8;
        for (unsigned long long i = 0; i < words; i++) {
            unsigned long long v = w[i];
            unsigned int lo = (unsigned int)v ^ crc;
            unsigned int hi = (unsigned int)(v >> 32);
            crc = tab[7][lo & 0xff] ^ tab[6][(lo >> 8) & 0xff] ^ tab[5][(lo >> 16) & 0xff] ^
                  tab[4][lo >> 24] ^ tab[3][hi & 0xff] ^ tab[2][(hi >> 8) & 0xff] ^
                  tab[1][(hi >> 16) & 0xff] ^ tab[0][hi >> 24];
        }
        p += words * 8;
        n -= words * 8;
    }
    for (unsigned long long i = 0; i < n; i++) crc = (crc >> 8) ^ tab[0][(crc ^ p[i]) & 0xff];
    crcs[t] = crc ^ 0xFFFFFFFFu;
    lens[t] = to - from;
    __syncthreads();
    for (unsigned int s = 1; s < THREADS; s <<= 1) {
        if ((t % (2 * s)) == 0 && t + s < THREADS) {
            unsigned long long lb = lens[t + s];
            if (lb > 0) {
                crcs[t] = multmodp(x2nmodp(lb, 3, x2n), crcs[t]) ^ crcs[t + s];
                lens[t] += lb;
            }
        }
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = crcs[0];
}
"#;

/// Name of the kernel in [`KERNEL_SOURCE`].
pub const KERNEL_NAME: &str = "teraio_crc32c_parts";

/// Bytes one thread block checksums: a stripe unit is cut into parts of this size (so a 1 MiB
/// unit keeps 16 blocks busy, and a 1 GiB tensor 16384: the whole GPU), whose crcs the host
/// combines per unit ([`combine_parts`]).
pub const PART_BYTES: u64 = 64 << 10;

/// The part size and parts per unit for units of `unit` bytes.
pub fn parts_of(unit: u64) -> (u64, u64) {
    let part = unit.clamp(1, PART_BYTES);
    (part, unit.div_ceil(part))
}

/// The crc32c of each unit of `len` bytes from the crcs of its parts (`parts_per_unit` per
/// unit, `part` bytes each, the unit's last parts shorter or empty), as the kernel leaves them.
pub fn combine_parts(parts: &[u32], len: u64, unit: u64) -> Vec<u32> {
    let (part, k) = parts_of(unit);
    let x2n = x2n_table();
    let full_op = x2nmodp(part, 3, &x2n);
    let units = len.div_ceil(unit);
    let mut out = Vec::with_capacity(units as usize);
    for u in 0..units {
        let unit_len = (len - u * unit).min(unit);
        let base = (u * k) as usize;
        let mut acc = parts[base];
        for i in 1..k {
            let start = i * part;
            if start >= unit_len {
                break;
            }
            let n = (unit_len - start).min(part);
            let op = if n == part { full_op } else { x2nmodp(n, 3, &x2n) };
            acc = multmodp(op, acc) ^ parts[base + i as usize];
        }
        out.push(acc);
    }
    out
}

fn multmodp(a: u32, mut b: u32) -> u32 {
    let mut m = 1u32 << 31;
    let mut p = 0u32;
    loop {
        if a & m != 0 {
            p ^= b;
            if a & (m - 1) == 0 {
                break;
            }
        }
        m >>= 1;
        if m == 0 {
            break; // a == 0
        }
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
    }
    p
}

fn x2n_table() -> [u32; 32] {
    let mut t = [0u32; 32];
    let mut p = 1u32 << 30;
    t[0] = p;
    for e in t.iter_mut().skip(1) {
        p = multmodp(p, p);
        *e = p;
    }
    t
}

fn x2nmodp(mut n: u64, mut k: u32, tab: &[u32; 32]) -> u32 {
    let mut p = 1u32 << 31;
    while n != 0 {
        if n & 1 != 0 {
            p = multmodp(tab[(k & 31) as usize], p);
        }
        n >>= 1;
        k += 1;
    }
    p
}

fn slice8_tables() -> [[u32; 256]; 8] {
    let mut tab = [[0u32; 256]; 8];
    for (i, e) in tab[0].iter_mut().enumerate() {
        let mut c = i as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
        }
        *e = c;
    }
    for k in 1..8 {
        for i in 0..256 {
            let prev = tab[k - 1][i];
            tab[k][i] = (prev >> 8) ^ tab[0][(prev & 0xff) as usize];
        }
    }
    tab
}

/// The combined crc32c of `a` followed by `b` bytes whose crc32c is `crc_b`.
pub fn combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    if len_b == 0 {
        return crc_a;
    }
    multmodp(x2nmodp(len_b, 3, &x2n_table()), crc_a) ^ crc_b
}

/// crc32c of one stripe unit computed by the kernel's algorithm on the CPU (see the module
/// docs): parts of [`PART_BYTES`] checksummed as one thread block does, combined as the host
/// does. Equal to `crc32c::crc32c(unit)`; tested in CI, so the GPU path's on-disk checksums
/// are the bounce path's.
pub fn crc32c_like_kernel(unit: &[u8]) -> u32 {
    let len = unit.len() as u64;
    if len == 0 {
        return 0;
    }
    let (part, _) = parts_of(len);
    let parts: Vec<u32> = unit.chunks(part as usize).map(block_crc).collect();
    combine_parts(&parts, len, len)[0]
}

/// What one thread block computes: the crc32c of one part, cut over [`THREADS`] threads.
fn block_crc(unit: &[u8]) -> u32 {
    let tab = slice8_tables();
    let x2n = x2n_table();
    let ulen = unit.len() as u64;
    let piece = ulen.div_ceil(THREADS as u64).next_multiple_of(16);
    let mut crcs = [0u32; THREADS];
    let mut lens = [0u64; THREADS];
    for t in 0..THREADS {
        let from = (t as u64 * piece).min(ulen);
        let to = (from + piece).min(ulen);
        let mut p = &unit[from as usize..to as usize];
        let mut crc = 0xFFFF_FFFFu32;
        if (p.as_ptr() as usize).is_multiple_of(8) {
            let words = p.len() / 8;
            for w in p[..words * 8].chunks_exact(8) {
                let v = u64::from_le_bytes(w.try_into().expect("8 bytes"));
                let lo = (v as u32) ^ crc;
                let hi = (v >> 32) as u32;
                crc = tab[7][(lo & 0xff) as usize]
                    ^ tab[6][((lo >> 8) & 0xff) as usize]
                    ^ tab[5][((lo >> 16) & 0xff) as usize]
                    ^ tab[4][(lo >> 24) as usize]
                    ^ tab[3][(hi & 0xff) as usize]
                    ^ tab[2][((hi >> 8) & 0xff) as usize]
                    ^ tab[1][((hi >> 16) & 0xff) as usize]
                    ^ tab[0][(hi >> 24) as usize];
            }
            p = &p[words * 8..];
        }
        for &b in p {
            crc = (crc >> 8) ^ tab[0][((crc ^ u32::from(b)) & 0xff) as usize];
        }
        crcs[t] = crc ^ 0xFFFF_FFFF;
        lens[t] = to - from;
    }
    let mut s = 1;
    while s < THREADS {
        for t in (0..THREADS).step_by(2 * s) {
            if t + s < THREADS && lens[t + s] > 0 {
                crcs[t] = multmodp(x2nmodp(lens[t + s], 3, &x2n), crcs[t]) ^ crcs[t + s];
                lens[t] += lens[t + s];
            }
        }
        s <<= 1;
    }
    crcs[0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn the_kernel_algorithm_equals_crc32c_for_odd_sizes_and_alignments() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(11);
        let mut data = vec![0u8; (3 << 20) + 64];
        rng.fill(&mut data[..]);
        let mut sizes = vec![0usize, 1, 7, 8, 15, 16, 17, 255, 256, 4095, 4096, 4097, 65_537];
        sizes.extend((0..12).map(|_| rng.gen_range(1..(3 << 20))));
        sizes.push(1 << 20);
        sizes.push(3 << 20);
        for &n in &sizes {
            for shift in [0usize, 1, 3, 8, 13] {
                let bytes = &data[shift..shift + n];
                assert_eq!(
                    crc32c_like_kernel(bytes),
                    crc32c::crc32c(bytes),
                    "{n} bytes at alignment offset {shift}"
                );
            }
        }
    }

    #[test]
    fn parts_of_a_tensor_combine_into_its_unit_crcs() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(5);
        let mut data = vec![0u8; (5 << 20) + 999];
        rng.fill(&mut data[..]);
        for unit in [4096u64, 65_536, 100_003, 1 << 20, 4 << 20] {
            let len = data.len() as u64;
            let (part, k) = parts_of(unit);
            // What the kernel leaves: one crc per (unit, part) block, empty parts as 0.
            let mut parts = Vec::new();
            for u in 0..len.div_ceil(unit) {
                let unit_bytes = &data[(u * unit) as usize..((u + 1) * unit).min(len) as usize];
                for i in 0..k {
                    let from = ((i * part) as usize).min(unit_bytes.len());
                    let to = (((i + 1) * part) as usize).min(unit_bytes.len());
                    parts.push(if from < to { block_crc(&unit_bytes[from..to]) } else { 0 });
                }
            }
            let cpu: Vec<u32> = data.chunks(unit as usize).map(crc32c::crc32c).collect();
            assert_eq!(combine_parts(&parts, len, unit), cpu, "units of {unit}");
        }
    }

    #[test]
    fn combine_joins_crcs_of_adjacent_ranges() {
        let a = b"teraio stripes tensors";
        let b = b" over its own array";
        let whole: Vec<u8> = a.iter().chain(b.iter()).copied().collect();
        let c = combine(crc32c::crc32c(a), crc32c::crc32c(b), b.len() as u64);
        assert_eq!(c, crc32c::crc32c(&whole));
        assert_eq!(combine(0x1234_5678, 0, 0), 0x1234_5678);
    }
}
