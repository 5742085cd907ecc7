//! `y = x W^T` for a few rows `x` (a decoding step) and a dense f32 weight `W` `[n, k]`, on
//! x86-64 CPUs with AVX-512.
//!
//! Why: candle hands this product to gemm, which first repacks all of `W^T` for its
//! microkernels, on every call. With one to a few dozen rows that repacking is most of the work
//! (two thirds of SmolLM2's dense decoding step at batch 8). Here each output is a dot product
//! of contiguous rows, computed in tiles of 4 input rows x 4 weight rows so that every load
//! serves four multiply-adds.

use std::arch::x86_64::*;

/// Rows of `x` up to which this is used. SmolLM2's dense decoding at batch 64 ran 1.8x faster
/// than with gemm (182 vs 99 tok/s); larger products are gemm's ground.
pub(crate) const MAX_ROWS: usize = 64;
/// Weight rows per tile.
const TILE_N: usize = 4;
/// Input rows per tile.
const TILE_M: usize = 4;
/// Multiply-adds from which a product is split across threads.
const PARALLEL_MACS: usize = 1 << 20;

pub(crate) fn available() -> bool {
    // The standard library caches what the CPU reported.
    is_x86_feature_detected!("avx512f")
}

/// `dst[m, n] = x[m, k] w[n, k]^T`. Call only when [`available`].
pub(crate) fn matmul(x: &[f32], w: &[f32], m: usize, n: usize, k: usize, dst: &mut [f32]) {
    assert!(available(), "skinny matmul without AVX-512");
    assert_eq!(x.len(), m * k, "skinny matmul: x is not [m, k]");
    assert_eq!(w.len(), n * k, "skinny matmul: w is not [n, k]");
    assert_eq!(dst.len(), m * n, "skinny matmul: dst is not [m, n]");
    let dst_addr = dst.as_mut_ptr() as usize;
    let groups = n.div_ceil(TILE_N);
    let run = |group: usize| {
        let first = group * TILE_N;
        let count = (n - first).min(TILE_N);
        let mut row = 0;
        while row < m {
            let rows = (m - row).min(TILE_M);
            // SAFETY: AVX-512F checked above; the tile's reads are inside `x` and `w` and its
            // writes inside `dst` (sizes asserted), and no other group writes columns
            // `first..first + count`.
            unsafe {
                let dst = dst_addr as *mut f32;
                match rows {
                    4 => tile::<4>(x, w, k, n, row, first, count, dst),
                    3 => tile::<3>(x, w, k, n, row, first, count, dst),
                    2 => tile::<2>(x, w, k, n, row, first, count, dst),
                    _ => tile::<1>(x, w, k, n, row, first, count, dst),
                }
            }
            row += rows;
        }
    };
    super::ops::for_each_index(groups, m * n * k >= PARALLEL_MACS, run);
}

/// Outputs `row..row + R` x `first..first + count` (`count` at most 4), over all of `k`.
// Indices, not iterators: `r` and `j` address a register tile in several arrays at once.
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn tile<const R: usize>(
    x: &[f32],
    w: &[f32],
    k: usize,
    n: usize,
    row: usize,
    first: usize,
    count: usize,
    dst: *mut f32,
) {
    let mut acc = [[_mm512_setzero_ps(); TILE_N]; R];
    let x_rows: [*const f32; R] = std::array::from_fn(|r| x.as_ptr().add((row + r) * k));
    // Weight rows past `count` read the tile's first row again (valid memory), not stored.
    let w_rows: [*const f32; TILE_N] =
        std::array::from_fn(|j| w.as_ptr().add((first + if j < count { j } else { 0 }) * k));
    let mut at = 0;
    while at < k {
        let mask: __mmask16 = if k - at >= 16 {
            0xffff
        } else {
            (1u16 << (k - at)) - 1
        };
        let ws: [__m512; TILE_N] =
            std::array::from_fn(|j| _mm512_maskz_loadu_ps(mask, w_rows[j].add(at)));
        for r in 0..R {
            let xv = _mm512_maskz_loadu_ps(mask, x_rows[r].add(at));
            for j in 0..TILE_N {
                acc[r][j] = _mm512_fmadd_ps(xv, ws[j], acc[r][j]);
            }
        }
        at += 16;
    }
    for r in 0..R {
        for j in 0..count {
            *dst.add((row + r) * n + first + j) = _mm512_reduce_add_ps(acc[r][j]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_plain_product() {
        if !available() {
            eprintln!("no AVX-512 on this CPU: skinny matmul not tested");
            return;
        }
        // Tiles whole and partial in every direction, k with and without a tail.
        for (m, n, k) in [(1, 4, 16), (3, 7, 40), (5, 9, 576), (9, 64, 100)] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
                .collect();
            let w: Vec<f32> = (0..n * k)
                .map(|i| ((i * 53 % 97) as f32 - 48.0) / 40.0)
                .collect();
            let mut ours = vec![0f32; m * n];
            matmul(&x, &w, m, n, k, &mut ours);
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
