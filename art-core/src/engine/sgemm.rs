//! `C = A B` for large f32 products on x86-64 CPUs with AVX2 and FMA: the training step's
//! products (a micro-batch's token rows times a layer's weight, forward and backward, and the
//! language-model head) and long prompts' prefill.
//!
//! Why: candle's CPU matmul goes through the gemm crate, which reached 60-80 GFLOP/s at
//! SmolLM2's shapes on a 2-core AVX2 machine (41 on one core) where OpenBLAS reached 150-168
//! (82 on one core). A training step on the CPU is two thirds products, so that factor is most of
//! the distance to PyTorch, which uses MKL.
//!
//! The layout is the classic one (Goto; BLIS): `B` is packed in panels of up to `KC_MAX` rows x
//! 16 columns, `A` in blocks of up to `MC_MAX` rows packed 6 at a time (once per depth slice, for
//! every column block), and a 6 x 16 microkernel keeps its twelve accumulators in registers, so
//! that every load of `B` serves six multiply-adds. Threads take row blocks of `C` (disjoint
//! writes).

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::ops::Simd;

/// Rows of `A` per microkernel call.
const MR: usize = 6;
/// Columns of `B` per microkernel call (two AVX2 vectors).
const NR: usize = 16;
/// Depth of one packed panel at most. Its slice of `B` (576 x 16 values, 36 KB) streams from L2
/// (prefetched well: one sequential read per step); going deeper once saves a pass over `C`,
/// which for the language-model head's 49k columns is what limits (1.72x gemm at 576, 1.59x at
/// 256; the layers' shapes within noise of each other).
const KC_MAX: usize = 576;
/// Rows of one packed block of `A` at most (72 x 576 x 4 bytes = 162 KB, inside L2).
const MC_MAX: usize = 72;
/// Columns of `B` packed at once (9 MB at `KC_MAX` rows): bounds the packing buffer.
const NC: usize = 4096;

/// How the right-hand operand is stored.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Rhs<'a> {
    /// `B` itself, `[k, n]` row-major.
    KN(&'a [f32]),
    /// `B`'s transpose, `[n, k]` row-major: a weight `W` (`[out, in]`) in `x W^T`.
    NK(&'a [f32]),
}

pub(crate) fn available() -> bool {
    // AVX-512 CPUs have AVX2 and FMA too; this kernel uses those.
    Simd::detect() != Simd::Baseline
}

/// `c[m, n] = a[m, k] B`, `B` as `rhs` says. Call only when [`available`].
pub(crate) fn matmul(a: &[f32], rhs: Rhs<'_>, m: usize, n: usize, k: usize, c: &mut [f32]) {
    assert!(available(), "sgemm needs AVX2 and FMA");
    assert_eq!(a.len(), m * k, "sgemm: a is not [m, k]");
    let b_len = match rhs {
        Rhs::KN(b) | Rhs::NK(b) => b.len(),
    };
    assert_eq!(b_len, k * n, "sgemm: b does not hold k x n values");
    assert_eq!(c.len(), m * n, "sgemm: c is not [m, n]");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.fill(0.0);
        return;
    }
    let mc = block_rows(m, rayon::current_num_threads());
    let padded_rows = |ic: usize| (m - ic).min(mc).div_ceil(MR) * MR;
    // Depth slices of equal size (1,536 = 3 x 512 rather than 576 + 576 + 384).
    let kc_step = k.div_ceil(k.div_ceil(KC_MAX));
    let mut a_packed = vec![0f32; m.div_ceil(mc) * mc.div_ceil(MR) * MR * kc_step];
    let mut b_packed = vec![0f32; kc_step * NC.min(n.div_ceil(NR) * NR)];
    for pc in (0..k).step_by(kc_step) {
        let kc = kc_step.min(k - pc);
        // This depth slice of A, packed once for every column block of B.
        let a_block_len = mc.div_ceil(MR) * MR * kc;
        a_packed[..m.div_ceil(mc) * a_block_len]
            .par_chunks_mut(a_block_len)
            .enumerate()
            .for_each(|(block, out)| {
                let ic = block * mc;
                let rows = (m - ic).min(mc);
                pack_a(a, k, ic, rows, pc, kc, &mut out[..padded_rows(ic) * kc]);
            });
        let a_packed = &a_packed[..m.div_ceil(mc) * a_block_len];
        // The first depth slice writes C, the later ones add to it.
        let accumulate = pc > 0;
        for jc in (0..n).step_by(NC) {
            let nc = NC.min(n - jc);
            let panels = nc.div_ceil(NR);
            b_packed[..panels * kc * NR]
                .par_chunks_mut(kc * NR)
                .enumerate()
                .for_each(|(q, panel)| pack_b(rhs, n, k, pc, kc, jc + q * NR, panel));
            let b_packed = &b_packed[..panels * kc * NR];
            c.par_chunks_mut(mc * n)
                .zip(a_packed.par_chunks(a_block_len))
                .enumerate()
                .for_each(|(block, (c_rows, a_block))| {
                    let rows = (m - block * mc).min(mc);
                    for q in 0..panels {
                        let cols = (nc - q * NR).min(NR);
                        let b_panel = &b_packed[q * kc * NR..][..kc * NR];
                        for r in 0..rows.div_ceil(MR) {
                            let tile_rows = (rows - r * MR).min(MR);
                            let a_panel = &a_block[r * kc * MR..][..kc * MR];
                            let at = r * MR * n + jc + q * NR;
                            // SAFETY: AVX2 and FMA were checked above; the panels hold `kc`
                            // steps of MR and NR values; the tile's writes stay in `c_rows`
                            // (rows `r*MR..+tile_rows` of this block, columns `at..+cols`).
                            unsafe {
                                kernel(
                                    kc,
                                    a_panel.as_ptr(),
                                    b_panel.as_ptr(),
                                    c_rows[at..].as_mut_ptr(),
                                    n,
                                    tile_rows,
                                    cols,
                                    accumulate,
                                )
                            };
                        }
                    }
                });
        }
    }
}

/// Rows per block of `C`: at most `MC_MAX`, a multiple of `MR`, and as many blocks as make an
/// even share for each thread (1,024 rows on two threads: 16 blocks of 66 rather than 15 of 72).
fn block_rows(m: usize, threads: usize) -> usize {
    let threads = threads.max(1);
    let blocks = m.div_ceil(MC_MAX).div_ceil(threads) * threads;
    m.div_ceil(blocks).div_ceil(MR) * MR
}

/// Packs columns `j0..j0 + 16` (zeros past `n`) of rows `pc..pc + kc` of `B` as `kc` rows of 16.
fn pack_b(rhs: Rhs<'_>, n: usize, k: usize, pc: usize, kc: usize, j0: usize, out: &mut [f32]) {
    let width = (n - j0).min(NR);
    match rhs {
        Rhs::KN(b) => {
            for (p, row) in out.chunks_exact_mut(NR).enumerate() {
                row[..width].copy_from_slice(&b[(pc + p) * n + j0..][..width]);
                row[width..].fill(0.0);
            }
        }
        Rhs::NK(b) => {
            for j in 0..NR {
                let column = (j < width).then(|| &b[(j0 + j) * k + pc..][..kc]);
                interleave(column, out, NR, j);
            }
        }
    }
}

/// Packs rows `ic..ic + rows` (zeros past them, to a multiple of 6) of columns `pc..pc + kc` of
/// `A` (`lda` values per row) as panels of `kc` steps of 6 values.
fn pack_a(a: &[f32], lda: usize, ic: usize, rows: usize, pc: usize, kc: usize, out: &mut [f32]) {
    for (r, panel) in out.chunks_exact_mut(kc * MR).enumerate() {
        for i in 0..MR {
            let row = r * MR + i;
            let values = (row < rows).then(|| &a[(ic + row) * lda + pc..][..kc]);
            interleave(values, panel, MR, i);
        }
    }
}

/// Writes `values` (zeros for `None`) to lane `lane` of a panel of `width`-value steps: value `p`
/// at `panel[p * width + lane]`.
fn interleave(values: Option<&[f32]>, panel: &mut [f32], width: usize, lane: usize) {
    let slots = panel[lane..].iter_mut().step_by(width);
    match values {
        Some(values) => slots.zip(values).for_each(|(slot, &value)| *slot = value),
        None => slots.for_each(|slot| *slot = 0.0),
    }
}

/// One 6 x 16 tile of `C` (`rows` x `cols` of it written, `ldc` values per row): the sum over
/// `kc` steps of a packed column of `A` times a packed row of `B`, added to the tile when
/// `accumulate`.
///
/// # Safety
/// The CPU has AVX2 and FMA; `a` holds `kc * 6` values, `b` `kc * 16`, and `c` is writable for
/// `rows` rows of `cols` values `ldc` apart.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel(
    kc: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    rows: usize,
    cols: usize,
    accumulate: bool,
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; MR];
    for p in 0..kc {
        let b0 = _mm256_loadu_ps(b.add(p * NR));
        let b1 = _mm256_loadu_ps(b.add(p * NR + 8));
        let a_step = a.add(p * MR);
        for (i, row) in acc.iter_mut().enumerate() {
            let ai = _mm256_broadcast_ss(&*a_step.add(i));
            row[0] = _mm256_fmadd_ps(ai, b0, row[0]);
            row[1] = _mm256_fmadd_ps(ai, b1, row[1]);
        }
    }
    if rows == MR && cols == NR {
        for (i, row) in acc.iter().enumerate() {
            let out = c.add(i * ldc);
            let (mut lo, mut hi) = (row[0], row[1]);
            if accumulate {
                lo = _mm256_add_ps(lo, _mm256_loadu_ps(out));
                hi = _mm256_add_ps(hi, _mm256_loadu_ps(out.add(8)));
            }
            _mm256_storeu_ps(out, lo);
            _mm256_storeu_ps(out.add(8), hi);
        }
    } else {
        // An edge tile: through a buffer, writing only what lies inside C.
        let mut tile = [0f32; MR * NR];
        for (i, row) in acc.iter().enumerate() {
            _mm256_storeu_ps(tile.as_mut_ptr().add(i * NR), row[0]);
            _mm256_storeu_ps(tile.as_mut_ptr().add(i * NR + 8), row[1]);
        }
        for i in 0..rows {
            for j in 0..cols {
                let out = c.add(i * ldc + j);
                *out = if accumulate { *out } else { 0.0 } + tile[i * NR + j];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(a: &[f32], b_kn: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for p in 0..k {
                let x = a[i * k + p] as f64;
                for j in 0..n {
                    c[i * n + j] += x * b_kn[p * n + j] as f64;
                }
            }
        }
        c
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        // A small deterministic generator: values in [-1, 1).
        let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                (state as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Both layouts of `B`, at shapes with edges in every dimension (rows not a multiple of 6 or
    /// of a block, columns not of 16 or of `NC`, depth not of `KC_MAX`), against an f64 product.
    #[test]
    fn products_match_a_plain_f64_product_at_ragged_shapes() {
        if !available() {
            eprintln!("skipping: no AVX2/FMA");
            return;
        }
        for &(m, n, k) in &[
            (1, 1, 1),
            (7, 17, 3),
            (150, 37, 300),
            (65, 4100, 20),
            (200, 96, 513),
        ] {
            let a = values(m * k, 1);
            let b_kn = values(k * n, 2);
            let mut b_nk = vec![0f32; n * k];
            for p in 0..k {
                for j in 0..n {
                    b_nk[j * k + p] = b_kn[p * n + j];
                }
            }
            let expected = reference(&a, &b_kn, m, n, k);
            for rhs in [Rhs::KN(&b_kn), Rhs::NK(&b_nk)] {
                let mut c = vec![f32::NAN; m * n];
                matmul(&a, rhs, m, n, k, &mut c);
                for (idx, (&got, &want)) in c.iter().zip(&expected).enumerate() {
                    let tolerance = 1e-5 * (k as f64).sqrt().max(1.0);
                    assert!(
                        (got as f64 - want).abs() <= tolerance,
                        "{m}x{n}x{k} {rhs:?}: element {idx} is {got}, expected {want}",
                        rhs = matches!(rhs, Rhs::KN(_)),
                    );
                }
            }
        }
    }

    #[test]
    fn an_empty_depth_gives_zeros() {
        if !available() {
            return;
        }
        let mut c = vec![f32::NAN; 6];
        matmul(&[], Rhs::KN(&[]), 2, 3, 0, &mut c);
        assert_eq!(c, vec![0.0; 6]);
    }
}
