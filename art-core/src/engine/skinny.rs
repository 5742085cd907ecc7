//! `y = x W^T` for a few rows `x` (a decoding step) and a dense f32 weight `W` `[n, k]`, on
//! x86-64 CPUs with AVX-512 or AVX2 and FMA.
//!
//! Why: candle hands this product to gemm, which first repacks all of `W^T` for its
//! microkernels, on every call. With one to a few dozen rows that repacking is most of the work
//! (two thirds of SmolLM2's dense decoding step at batch 8). Here each output is a dot product
//! of contiguous rows, computed in tiles of 4 input rows x 4 weight rows (AVX2: x 3, for its 16
//! registers) so that every weight load serves four multiply-adds.

use std::arch::x86_64::*;

use super::ops::Simd;

/// Rows of `x` up to which this is used. SmolLM2's dense decoding at batch 32 ran 1.16x faster
/// than with gemm on two AVX2 cores (177 vs 153 tok/s; 1.8x at batch 64 when gemm was built with
/// debug assertions); larger products are gemm's ground.
pub(crate) const MAX_ROWS: usize = 64;
/// Input rows per tile.
const TILE_M: usize = 4;
/// Weight rows per tile with AVX-512 (16 accumulators of its 32 registers).
const TILE_N_AVX512: usize = 4;
/// Weight rows per tile with AVX2: 4 x 3 accumulators, 3 weight vectors and an input vector fill
/// its 16 registers exactly.
const TILE_N_AVX2: usize = 3;
/// Multiply-adds from which a product is split across threads: a single row's products of
/// SmolLM2's q/o and MLP weights are split too (batch 2 / 8 decoding: 44 -> 48 / 93 -> 97-100
/// tok/s on two AVX2 cores, against 1 << 20).
const PARALLEL_MACS: usize = 1 << 18;

pub(crate) fn available() -> bool {
    Simd::detect() != Simd::Baseline
}

/// `dst[m, n] = x[m, k] w[n, k]^T`. Call only when [`available`].
pub(crate) fn matmul(x: &[f32], w: &[f32], m: usize, n: usize, k: usize, dst: &mut [f32]) {
    matmul_with(Simd::detect(), x, w, m, n, k, dst)
}

/// [`matmul`] with the given instruction set (AVX-512 or AVX2), which this CPU must have;
/// panics on [`Simd::Baseline`].
fn matmul_with(isa: Simd, x: &[f32], w: &[f32], m: usize, n: usize, k: usize, dst: &mut [f32]) {
    assert_eq!(x.len(), m * k, "skinny matmul: x is not [m, k]");
    assert_eq!(w.len(), n * k, "skinny matmul: w is not [n, k]");
    assert_eq!(dst.len(), m * n, "skinny matmul: dst is not [m, n]");
    let dst_addr = dst.as_mut_ptr() as usize;
    let tile_n = match isa {
        Simd::Avx512 => TILE_N_AVX512,
        Simd::Avx2 => TILE_N_AVX2,
        Simd::Baseline => panic!("skinny matmul needs AVX-512 or AVX2"),
    };
    let groups = n.div_ceil(tile_n);
    let run = |group: usize| {
        let first = group * tile_n;
        let count = (n - first).min(tile_n);
        let mut row = 0;
        while row < m {
            let rows = (m - row).min(TILE_M);
            // SAFETY: the instruction set was detected above; the tile's reads are inside `x`
            // and `w` and its writes inside `dst` (sizes asserted), and no other group writes
            // columns `first..first + count`.
            unsafe {
                let at = Tile {
                    x,
                    w,
                    k,
                    n,
                    row,
                    first,
                    count,
                    dst: dst_addr as *mut f32,
                };
                match (isa, rows) {
                    (Simd::Avx512, 4) => at.avx512::<4>(),
                    (Simd::Avx512, 3) => at.avx512::<3>(),
                    (Simd::Avx512, 2) => at.avx512::<2>(),
                    (Simd::Avx512, _) => at.avx512::<1>(),
                    (_, 4) => at.avx2::<4>(),
                    (_, 3) => at.avx2::<3>(),
                    (_, 2) => at.avx2::<2>(),
                    (_, _) => at.avx2::<1>(),
                }
            }
            row += rows;
        }
    };
    super::ops::for_each_index(groups, m * n * k >= PARALLEL_MACS, run);
}

/// One register tile: outputs `row..row + R` x `first..first + count` over all of `k`.
struct Tile<'a> {
    x: &'a [f32],
    w: &'a [f32],
    k: usize,
    n: usize,
    row: usize,
    first: usize,
    /// Weight rows in this tile (at most the instruction set's tile width).
    count: usize,
    dst: *mut f32,
}

// Indices, not iterators: `r` and `j` address a register tile in several arrays at once.
#[allow(clippy::needless_range_loop)]
impl Tile<'_> {
    /// The tile's input rows and `N` weight rows; weight rows past `count` read the tile's first
    /// row again (valid memory), their sums are not stored.
    ///
    /// # Safety
    /// `row + R <= m` and `first + count <= n` for the `[m, k]` input and `[n, k]` weight.
    unsafe fn rows<const R: usize, const N: usize>(&self) -> ([*const f32; R], [*const f32; N]) {
        // SAFETY: the caller's contract: rows `row..row + R` of `x` and rows `first..first + count` of `w` (or the first, again) are inside their slices, so each offset stays in its allocation.
        unsafe {
            let x_rows = std::array::from_fn(|r| self.x.as_ptr().add((self.row + r) * self.k));
            let w_rows = std::array::from_fn(|j| {
                let j = if j < self.count { j } else { 0 };
                self.w.as_ptr().add((self.first + j) * self.k)
            });
            (x_rows, w_rows)
        }
    }

    /// # Safety
    /// As [`Tile::rows`], with `dst` valid for the `[m, n]` output and no other thread writing
    /// columns `first..first + count`.
    unsafe fn store<const R: usize, const N: usize>(&self, sums: impl Fn(usize, usize) -> f32) {
        // SAFETY: the caller's contract: every written index is inside the `[m, n]` output `dst` points to, in columns no other thread writes.
        unsafe {
            for r in 0..R {
                for j in 0..self.count.min(N) {
                    *self.dst.add((self.row + r) * self.n + self.first + j) = sums(r, j);
                }
            }
        }
    }

    /// # Safety
    /// As [`Tile::store`], on a CPU with AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn avx512<const R: usize>(&self) {
        // SAFETY: the caller's contract (AVX-512F present, the tile inside `x`, `w` and `dst`); masked loads read only the `k - at` valid lanes of each row.
        unsafe {
            const N: usize = TILE_N_AVX512;
            let k = self.k;
            let mut acc = [[_mm512_setzero_ps(); N]; R];
            let (x_rows, w_rows) = self.rows::<R, N>();
            let mut at = 0;
            while at < k {
                let mask: __mmask16 = if k - at >= 16 {
                    0xffff
                } else {
                    (1u16 << (k - at)) - 1
                };
                let ws: [__m512; N] =
                    std::array::from_fn(|j| _mm512_maskz_loadu_ps(mask, w_rows[j].add(at)));
                for r in 0..R {
                    let xv = _mm512_maskz_loadu_ps(mask, x_rows[r].add(at));
                    for j in 0..N {
                        acc[r][j] = _mm512_fmadd_ps(xv, ws[j], acc[r][j]);
                    }
                }
                at += 16;
            }
            self.store::<R, N>(|r, j| _mm512_reduce_add_ps(acc[r][j]));
        }
    }

    /// # Safety
    /// As [`Tile::store`], on a CPU with AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2<const R: usize>(&self) {
        // SAFETY: the caller's contract (AVX2 and FMA present, the tile inside `x`, `w` and `dst`); plain loads stay below `whole <= k`, masked loads read only the tail's valid lanes.
        unsafe {
            const N: usize = TILE_N_AVX2;
            let k = self.k;
            let mut acc = [[_mm256_setzero_ps(); N]; R];
            let (x_rows, w_rows) = self.rows::<R, N>();
            let whole = k - k % 8;
            let mut at = 0;
            while at < whole {
                let ws: [__m256; N] = std::array::from_fn(|j| _mm256_loadu_ps(w_rows[j].add(at)));
                for r in 0..R {
                    let xv = _mm256_loadu_ps(x_rows[r].add(at));
                    for j in 0..N {
                        acc[r][j] = _mm256_fmadd_ps(xv, ws[j], acc[r][j]);
                    }
                }
                at += 8;
            }
            if at < k {
                // The tail with masked loads (the main loop's plain loads are cheaper): lanes below
                // the tail's length load, the others read as zero.
                let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((k - at) as i32), lanes);
                let ws: [__m256; N] =
                    std::array::from_fn(|j| _mm256_maskload_ps(w_rows[j].add(at), mask));
                for r in 0..R {
                    let xv = _mm256_maskload_ps(x_rows[r].add(at), mask);
                    for j in 0..N {
                        acc[r][j] = _mm256_fmadd_ps(xv, ws[j], acc[r][j]);
                    }
                }
            }
            self.store::<R, N>(|r, j| horizontal_sum(acc[r][j]));
        }
    }
}

/// The sum of the eight lanes.
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
unsafe fn horizontal_sum(v: __m256) -> f32 {
    let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every instruction set this CPU has (AVX2 is also tested where AVX-512 is used: every
    /// AVX-512 CPU has AVX2 and FMA).
    fn isas() -> Vec<Simd> {
        match Simd::detect() {
            Simd::Avx512 => vec![Simd::Avx512, Simd::Avx2],
            Simd::Avx2 => vec![Simd::Avx2],
            Simd::Baseline => vec![],
        }
    }

    #[test]
    fn matches_a_plain_product() {
        // The build targets x86-64-v3 (.cargo/config.toml): a CPU that runs it has AVX2 and FMA.
        assert!(
            !isas().is_empty(),
            "no AVX2 on a CPU running an x86-64-v3 build"
        );
        // Tiles whole and partial in every direction, k with and without a tail.
        let shapes = [
            (1, 4, 16),
            (3, 7, 40),
            (5, 9, 576),
            (9, 64, 100),
            (4, 5, 13),
        ];
        for (isa, (m, n, k)) in isas()
            .into_iter()
            .flat_map(|isa| shapes.map(|shape| (isa, shape)))
        {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
                .collect();
            let w: Vec<f32> = (0..n * k)
                .map(|i| ((i * 53 % 97) as f32 - 48.0) / 40.0)
                .collect();
            let mut ours = vec![0f32; m * n];
            matmul_with(isa, &x, &w, m, n, k, &mut ours);
            for r in 0..m {
                for j in 0..n {
                    let exact: f64 = (0..k)
                        .map(|i| x[r * k + i] as f64 * w[j * k + i] as f64)
                        .sum();
                    let bound = 1e-5
                        * (0..k)
                            .map(|i| (x[r * k + i] * w[j * k + i]).abs() as f64)
                            .sum::<f64>();
                    assert!(
                        (ours[r * n + j] as f64 - exact).abs() <= bound,
                        "({m},{n},{k}) [{r},{j}]: {} vs {exact}",
                        ours[r * n + j]
                    );
                }
            }
        }
    }
}
