//! Quantized matmul for x86-64 CPUs with AVX-512 VNNI: `y = x W^T` with `W` in a GGUF block
//! format (Q4_0, Q4_1, Q8_0) and `x` in f32.
//!
//! Why our own: candle's CPU kernels compute one dot product per (input row, output column)
//! pair, so a batch of rows re-reads every weight once per row and decoding 32 sequences costs
//! 32 times one; its AVX-512 tiles need the input width to be a multiple of 256, which
//! SmolLM2's 576 is not. Here the weights are repacked once, at load, into panels of 16 output
//! rows laid out for `vpdpbusd` (16 lanes, each the dot product of 4 unsigned bytes of weights
//! with 4 signed bytes of input), and a tile of up to 4 input rows x 2 panels is computed from
//! registers, so each weight load serves every row of the tile.
//!
//! Arithmetic (ggml's): each block of 32 input values is quantized to i8 with its own scale
//! `da = max|a| / 127`; a weight block is `w = d q + m` with unsigned `q` (4 bits: 0..15;
//! 8 bits: the signed Q8_0 value plus 128, with `m = -128 d`). Then
//! `sum_k w_k a_k = d da sum(q qa) + m da sum(qa)`: the integer dot product is exact, and the
//! rest is two fused multiply-adds per block and output.

use std::arch::x86_64::*;

use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;

/// Output rows per panel: one 512-bit register of i32/f32 lanes.
const PANEL: usize = 16;
/// Input values per quantization block (ggml's Q4_0, Q4_1, Q8_0 all use 32).
const BLOCK: usize = 32;
/// Input rows per register tile.
const MAX_ROWS: usize = 4;
/// Multiply-adds from which a product is split across threads.
const PARALLEL_MACS: usize = 8 << 20;

/// Whether this CPU runs the packed kernels.
pub(crate) fn available() -> bool {
    // The standard library caches what the CPU reported.
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bits {
    /// Two weights per byte: the low nibble of byte `j` of a block is weight `j`, the high one
    /// weight `j + 16` (ggml's Q4 layout, kept as is).
    Four,
    /// One weight per byte, offset by 128 so it is unsigned.
    Eight,
}

impl Bits {
    /// 64-byte lines of quantized weights per (panel, block).
    const fn quant_lines(self) -> usize {
        match self {
            Bits::Four => 4,
            Bits::Eight => 8,
        }
    }
}

#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

/// A weight `[n, k]` repacked for the kernels. For each panel of 16 output rows and each block
/// of 32 inputs, one record: the quantized weights (4 or 8 lines, line `s` holding 4 consecutive
/// bytes of each of the 16 rows), then a line with the 16 scales `d` and the 16 offsets `m` as
/// f16.
pub(crate) struct PackedWeight {
    n: usize,
    k: usize,
    bits: Bits,
    lines: Vec<Line>,
}

impl std::fmt::Debug for PackedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PackedWeight({}x{}, {:?})", self.n, self.k, self.bits)
    }
}

impl PackedWeight {
    /// Repacks a 2-d quantized tensor `[n, k]`. `None` when this CPU lacks the instructions,
    /// the format is not Q4_0/Q4_1/Q8_0 (re-quantize to Q8_0 first), or `k` is not a whole
    /// number of blocks.
    pub(crate) fn pack(q: &QTensor) -> Option<PackedWeight> {
        let &[n, k] = q.shape().dims() else {
            return None;
        };
        let (bits, block_bytes) = match q.dtype() {
            GgmlDType::Q4_0 => (Bits::Four, 18),
            GgmlDType::Q4_1 => (Bits::Four, 20),
            GgmlDType::Q8_0 => (Bits::Eight, 34),
            _ => return None,
        };
        if !available() || k == 0 || k % BLOCK != 0 || n == 0 {
            return None;
        }
        let data = q.data().ok()?;
        let blocks = k / BLOCK;
        if data.len() != n * blocks * block_bytes {
            return None;
        }
        let panels = n.div_ceil(PANEL);
        let record = bits.quant_lines() + 1;
        // Rows past `n` in the last panel stay zero: scale 0, so they compute 0 and are not stored.
        let mut lines = vec![Line([0; 64]); panels * blocks * record];
        let f16_at = |bytes: &[u8], at: usize| f16::from_le_bytes([bytes[at], bytes[at + 1]]);
        for row in 0..n {
            let (panel, lane) = (row / PANEL, row % PANEL);
            for b in 0..blocks {
                let src = &data[(row * blocks + b) * block_bytes..][..block_bytes];
                let rec = &mut lines[(panel * blocks + b) * record..][..record];
                let (d, m, quants): (f16, f16, &[u8]) = match q.dtype() {
                    GgmlDType::Q4_0 => {
                        let d = f16_at(src, 0);
                        (d, f16::from_f32(-8.0 * d.to_f32()), &src[2..18])
                    }
                    GgmlDType::Q4_1 => (f16_at(src, 0), f16_at(src, 2), &src[4..20]),
                    _ => (f16_at(src, 0), f16::ZERO, &src[2..34]),
                };
                for (s, group) in quants.chunks_exact(4).enumerate() {
                    for (j, &byte) in group.iter().enumerate() {
                        rec[s].0[lane * 4 + j] = match bits {
                            Bits::Four => byte,
                            Bits::Eight => byte ^ 0x80,
                        };
                    }
                }
                let scales = &mut rec[bits.quant_lines()].0;
                scales[lane * 2..lane * 2 + 2].copy_from_slice(&d.to_le_bytes());
                scales[32 + lane * 2..32 + lane * 2 + 2].copy_from_slice(&m.to_le_bytes());
            }
        }
        Some(PackedWeight { n, k, bits, lines })
    }

    pub(crate) fn out_features(&self) -> usize {
        self.n
    }

    /// `dst[m, n] = x[m, k] W^T`, `x` row-major f32. Runs on rayon's thread pool.
    pub(crate) fn matmul(&self, x: &[f32], m: usize, dst: &mut [f32]) {
        assert_eq!(x.len(), m * self.k, "packed matmul: input is not [m, k]");
        assert_eq!(dst.len(), m * self.n, "packed matmul: output is not [m, n]");
        let input = QuantizedInput::new(x, m, self.k);
        // Work items: pairs of panels (a whole decode step for them, or every row of a batch),
        // so a worker keeps its weights in cache while it walks the rows.
        let panels = self.n.div_ceil(PANEL);
        let pairs = panels.div_ceil(2);
        let dst_addr = dst.as_mut_ptr() as usize;
        let run = |pair: usize| {
            let first = pair * 2;
            let count = (panels - first).min(2);
            // SAFETY: `available()` held when this weight was packed (pack checks it); each
            // pair writes only its own columns of `dst`, whose size was asserted above.
            unsafe {
                self.pair_all_rows(&input, first, count, dst_addr as *mut f32);
            }
        };
        super::ops::for_each_index(pairs, m * self.n * self.k >= PARALLEL_MACS, run);
    }

    /// Every row of the output, in the columns of panels `first..first + count`.
    ///
    /// # Safety
    /// The CPU must have AVX-512F, BW and VNNI; `dst` must be valid for the `[m, n]` output, and
    /// no other thread may write these panels' columns.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn pair_all_rows(
        &self,
        input: &QuantizedInput,
        first: usize,
        count: usize,
        dst: *mut f32,
    ) {
        let mut row = 0;
        while row < input.m {
            let rows = (input.m - row).min(MAX_ROWS);
            // SAFETY: the caller's contract; the tile stays inside `input` and `dst`.
            unsafe {
                macro_rules! tiles {
                    ($bits:literal) => {
                        match (rows, count) {
                            (4, 2) => self.tile::<$bits, 4, 2>(input, row, first, dst),
                            (3, 2) => self.tile::<$bits, 3, 2>(input, row, first, dst),
                            (2, 2) => self.tile::<$bits, 2, 2>(input, row, first, dst),
                            (1, 2) => self.tile::<$bits, 1, 2>(input, row, first, dst),
                            (4, _) => self.tile::<$bits, 4, 1>(input, row, first, dst),
                            (3, _) => self.tile::<$bits, 3, 1>(input, row, first, dst),
                            (2, _) => self.tile::<$bits, 2, 1>(input, row, first, dst),
                            _ => self.tile::<$bits, 1, 1>(input, row, first, dst),
                        }
                    };
                }
                match self.bits {
                    Bits::Four => tiles!(4),
                    Bits::Eight => tiles!(8),
                }
            }
            row += rows;
        }
    }

    /// Rows `row..row + R` of the output, columns of panels `first..first + P`, over all of `k`.
    /// `B` is the weight width in bits (4 or 8).
    ///
    /// # Safety
    /// As [`PackedWeight::pair_all_rows`], with `row + R <= m` and `first + P` panels at most.
    // Indices, not iterators: `r` and `p` address a register tile in two arrays at once.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[inline]
    unsafe fn tile<const B: usize, const R: usize, const P: usize>(
        &self,
        input: &QuantizedInput,
        row: usize,
        first: usize,
        dst: *mut f32,
    ) {
        // SAFETY: the caller's contract (AVX-512F/BW/VNNI present, rows `row..row + R` inside the input, panels `first..first + P` inside the weight and `dst`); masked stores write only each panel's valid columns.
        unsafe {
            let blocks = self.k / BLOCK;
            let quant_lines = if B == 4 { 4 } else { 8 };
            let record = quant_lines + 1;
            let nibble = _mm512_set1_epi8(0x0f);
            let mut acc = [[_mm512_setzero_ps(); P]; R];
            for b in 0..blocks {
                let mut dots = [[_mm512_setzero_si512(); P]; R];
                // (Macros, not closures: a closure would not inherit this function's target features.)
                // The 4 input bytes of group `s` of block `b` of tile row `r`, in every lane.
                macro_rules! group {
                    ($r:expr, $s:expr) => {{
                        let at = input
                            .quants
                            .as_ptr()
                            .add((row + $r) * self.k + b * BLOCK + $s * 4);
                        _mm512_set1_epi32((at as *const i32).read_unaligned())
                    }};
                }
                // Line `line` of the record of panel `first + p`, block `b`.
                macro_rules! line {
                    ($p:expr, $line:expr) => {
                        self.lines
                            .as_ptr()
                            .add(((first + $p) * blocks + b) * record + $line)
                            .cast::<__m512i>()
                    };
                }
                if B == 4 {
                    for s in 0..4 {
                        for p in 0..P {
                            let packed = _mm512_load_si512(line!(p, s));
                            let low = _mm512_and_si512(packed, nibble);
                            let high = _mm512_and_si512(_mm512_srli_epi16::<4>(packed), nibble);
                            for r in 0..R {
                                dots[r][p] = _mm512_dpbusd_epi32(dots[r][p], low, group!(r, s));
                                dots[r][p] =
                                    _mm512_dpbusd_epi32(dots[r][p], high, group!(r, s + 4));
                            }
                        }
                    }
                } else {
                    for s in 0..8 {
                        for p in 0..P {
                            let weights = _mm512_load_si512(line!(p, s));
                            for r in 0..R {
                                dots[r][p] = _mm512_dpbusd_epi32(dots[r][p], weights, group!(r, s));
                            }
                        }
                    }
                }
                for p in 0..P {
                    let scales = line!(p, quant_lines).cast::<__m256i>();
                    let d = _mm512_cvtph_ps(_mm256_load_si256(scales));
                    let m = _mm512_cvtph_ps(_mm256_load_si256(scales.add(1)));
                    for r in 0..R {
                        let at = (row + r) * blocks + b;
                        let scale =
                            _mm512_mul_ps(d, _mm512_set1_ps(*input.scales.get_unchecked(at)));
                        let dot = if B == 4 {
                            // `m da sum(qa)`: the offset's share.
                            let offset = _mm512_set1_ps(*input.scaled_sums.get_unchecked(at));
                            acc[r][p] = _mm512_fmadd_ps(m, offset, acc[r][p]);
                            dots[r][p]
                        } else {
                            // The +128 of the unsigned weights, taken back in integers (exact).
                            let sum = _mm512_set1_epi32(128 * *input.sums.get_unchecked(at));
                            _mm512_sub_epi32(dots[r][p], sum)
                        };
                        acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r][p]);
                    }
                }
            }
            for p in 0..P {
                let column = (first + p) * PANEL;
                let width = (self.n - column).min(PANEL);
                let mask: __mmask16 = if width == PANEL {
                    0xffff
                } else {
                    (1u16 << width) - 1
                };
                for r in 0..R {
                    let out = dst.add((row + r) * self.n + column);
                    _mm512_mask_storeu_ps(out, mask, acc[r][p]);
                }
            }
        }
    }
}

/// The input rows quantized per 32-value block, as the kernels read them.
struct QuantizedInput {
    m: usize,
    /// `[m, k]` i8.
    quants: Vec<i8>,
    /// `[m, k / 32]`: each block's scale `da`.
    scales: Vec<f32>,
    /// `[m, k / 32]`: `sum(qa)` of each block.
    sums: Vec<i32>,
    /// `[m, k / 32]`: `da * sum(qa)`.
    scaled_sums: Vec<f32>,
}

impl QuantizedInput {
    fn new(x: &[f32], m: usize, k: usize) -> Self {
        let blocks = m * k / BLOCK;
        let mut input = QuantizedInput {
            m,
            quants: vec![0; m * k],
            scales: Vec::with_capacity(blocks),
            sums: Vec::with_capacity(blocks),
            scaled_sums: Vec::with_capacity(blocks),
        };
        for (values, quants) in x
            .chunks_exact(BLOCK)
            .zip(input.quants.chunks_exact_mut(BLOCK))
        {
            let max = values.iter().fold(0f32, |max, v| max.max(v.abs()));
            let scale = max / 127.0;
            let inverse = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            let mut sum = 0i32;
            for (q, v) in quants.iter_mut().zip(values) {
                *q = (v * inverse).round() as i8;
                sum += *q as i32;
            }
            input.scales.push(scale);
            input.sums.push(sum);
            input.scaled_sums.push(scale * sum as f32);
        }
        input
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QMatMul;
    use candle_core::{Device, Module, Tensor};

    fn check(dtype: GgmlDType, n: usize, k: usize, m: usize) {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 0.05, (n, k), &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
        let q = QTensor::quantize(&w, dtype).unwrap();
        let Some(packed) = PackedWeight::pack(&q) else {
            // Without AVX-512 VNNI nothing is packed, so `Linear` keeps candle's kernels.
            assert!(!available(), "a {dtype:?} [{n}, {k}] weight should pack");
            return;
        };
        let xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
        let mut ours = vec![0f32; m * n];
        packed.matmul(&xs, m, &mut ours);
        let wd: Vec<f32> = q
            .dequantize(&dev)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        // Reference 1, exact: the dequantized weights times the input as the kernel quantized
        // it, in f64. Only the order of the f32 sums differs.
        let input = QuantizedInput::new(&xs, m, k);
        let exact: Vec<f64> = (0..m * n)
            .map(|i| {
                let (row, col) = (i / n, i % n);
                (0..k)
                    .map(|j| {
                        let a = input.quants[row * k + j] as f64
                            * input.scales[(row * k + j) / BLOCK] as f64;
                        a * wd[col * k + j] as f64
                    })
                    .sum()
            })
            .collect();
        // Reference 2: the exact product with the dequantized weights (the kernel also rounds
        // the input to 8 bits per block, so it differs by that).
        let dense: Vec<f32> = (x.matmul(&Tensor::from_vec(wd, (n, k), &dev).unwrap().t().unwrap()))
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        // Reference 3: candle's own quantized matmul (its input blocks have f16 scales, ours
        // f32, so it rounds a little more).
        let candle: Vec<f32> = QMatMul::from_qtensor(q)
            .unwrap()
            .forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let scale = dense.iter().fold(0f32, |a, v| a.max(v.abs()));
        for i in 0..m * n {
            let at = format!("{dtype:?} {n}x{k} m={m} [{i}]: ours {}", ours[i]);
            assert!(
                (ours[i] as f64 - exact[i]).abs() <= 1e-5 * scale as f64,
                "{at} exact {}",
                exact[i]
            );
            assert!(
                (ours[i] - dense[i]).abs() <= 2e-2 * scale,
                "{at} dense {}",
                dense[i]
            );
            assert!(
                (ours[i] - candle[i]).abs() <= 2e-3 * scale,
                "{at} candle {}",
                candle[i]
            );
        }
    }

    #[test]
    fn packed_matmul_matches_candle_and_dense() {
        for dtype in [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q8_0] {
            // Panels whole and partial (n = 40: 2.5 panels, an odd panel count), tiles of every
            // row count (m = 1..=9), SmolLM2's widths.
            for (n, k) in [(64, 64), (40, 128), (192, 576)] {
                for m in [1, 2, 3, 4, 5, 7, 9] {
                    check(dtype, n, k, m);
                }
            }
        }
    }

    #[test]
    fn pack_refuses_what_it_cannot_run() {
        let w = Tensor::zeros((16, 48), candle_core::DType::F32, &Device::Cpu).unwrap();
        // 48 is not a whole number of 32-wide blocks (candle cannot quantize it either: use
        // a K-quant shape instead to get a tensor of another type).
        assert!(QTensor::quantize(&w, GgmlDType::Q8_0).is_err());
        let w = Tensor::zeros((16, 256), candle_core::DType::F32, &Device::Cpu).unwrap();
        let q6 = QTensor::quantize(&w, GgmlDType::Q6K).unwrap();
        assert!(PackedWeight::pack(&q6).is_none());
    }
}
