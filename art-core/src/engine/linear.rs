//! A linear layer whose base weight is frozen, kept dense (for training and reference) and,
//! for GGUF files, also quantized (for fast CPU inference).

use std::sync::{Arc, Mutex};

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Module, Shape, Storage, Tensor};

use super::error::Result;
use super::lora::LoraPair;
use super::ops;
#[cfg(target_arch = "x86_64")]
use super::qgemm::PackedWeight;
use super::switches::{QGEMM, SKINNY_MATMUL};

/// `y = x W^T + b`, plus `scale * (x A^T) B^T` when a LoRA pair is given.
#[derive(Debug, Clone)]
pub struct Linear {
    /// `[out, in]`, in the model's compute dtype.
    weight: Tensor,
    /// The same weight in its quantized GGUF form, when the model came from a GGUF file.
    quantized: Option<Arc<QMatMul>>,
    /// The quantized weight repacked for this CPU's AVX-512 VNNI kernels, where it has them.
    #[cfg(target_arch = "x86_64")]
    packed: Option<Arc<PackedWeight>>,
    bias: Option<Tensor>,
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear {
            weight,
            quantized: None,
            #[cfg(target_arch = "x86_64")]
            packed: None,
            bias,
        }
    }

    /// A linear layer from a quantized tensor: dequantized to `dtype` for the dense path, and
    /// kept quantized too when `keep_quantized`. On CPU, formats that candle has no SIMD kernel
    /// for (Q4_1, Q5_0, Q5_1, Q8_1) are re-quantized to Q8_0, which has AVX2/NEON kernels (the
    /// dense weights stay the exact dequantized GGUF values); on CPUs with AVX-512 VNNI the
    /// weight is also repacked for our kernels (Q4_0/Q4_1/Q8_0 as they are, any other format
    /// re-quantized to Q8_0).
    pub fn from_qtensor(
        qtensor: Arc<QTensor>,
        bias: Option<Tensor>,
        device: &Device,
        dtype: DType,
        keep_quantized: bool,
    ) -> Result<Self> {
        let dense = qtensor.dequantize(device)?;
        #[cfg(target_arch = "x86_64")]
        let packed = if keep_quantized && device.is_cpu() && super::qgemm::available() {
            let packed = match PackedWeight::pack(&qtensor) {
                Some(p) => Some(p),
                None => QTensor::quantize(&dense, GgmlDType::Q8_0)
                    .ok()
                    .and_then(|q| PackedWeight::pack(&q)),
            };
            packed.map(Arc::new)
        } else {
            None
        };
        let quantized = if keep_quantized {
            let q = if device.is_cpu() && needs_requantize(&qtensor) {
                Arc::new(QTensor::quantize(&dense, GgmlDType::Q8_0)?)
            } else {
                qtensor
            };
            Some(Arc::new(QMatMul::from_arc(q)?))
        } else {
            None
        };
        let weight = dense.to_dtype(dtype)?;
        Ok(Linear {
            weight,
            quantized,
            #[cfg(target_arch = "x86_64")]
            packed,
            bias,
        })
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn in_features(&self) -> usize {
        self.weight.dims()[1]
    }

    pub fn out_features(&self) -> usize {
        self.weight.dims()[0]
    }

    pub fn has_quantized(&self) -> bool {
        self.quantized.is_some()
    }

    /// `x`: `[..., in]` -> `[..., out]`. `quantized` selects the quantized weight when there is
    /// one (inference only: it has no gradient, which is fine since the base is frozen, but its
    /// values differ slightly from the dense ones). `lora` adds the adapter's update.
    pub fn forward(
        &self,
        x: &Tensor,
        quantized: bool,
        lora: Option<(&LoraPair, bool)>,
        lora_scale: f64,
    ) -> Result<Tensor> {
        self.forward_with(x, quantized, lora, lora_scale, true)
    }

    /// [`Linear::forward`] without the bias, for a kernel that adds it itself.
    pub(crate) fn forward_unbiased(
        &self,
        x: &Tensor,
        lora: Option<(&LoraPair, bool)>,
        lora_scale: f64,
    ) -> Result<Tensor> {
        self.forward_with(x, false, lora, lora_scale, false)
    }

    /// The bias, if the layer has one.
    pub(crate) fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    fn forward_with(
        &self,
        x: &Tensor,
        quantized: bool,
        lora: Option<(&LoraPair, bool)>,
        lora_scale: f64,
        with_bias: bool,
    ) -> Result<Tensor> {
        let bias = self.bias.as_ref().filter(|_| with_bias);
        let dims = x.dims().to_vec();
        let in_dim = *dims.last().expect("linear input has at least one dim");
        let rows = x.elem_count() / in_dim.max(1);
        let x2 = x.reshape((rows, in_dim))?;
        let add_bias = |y: Tensor| -> Result<Tensor> {
            Ok(match bias {
                Some(b) => ops::add(&y, b)?,
                None => y,
            })
        };
        let mut y = match (&self.quantized, quantized) {
            (Some(q), true) => add_bias(match self.packed_forward(&x2)? {
                Some(y) => y,
                None => q.forward(&x2)?,
            })?,
            // The bias is added inside: as a graph node of its own, candle's backward would
            // fill and keep a full-size gradient for the (constant) broadcast bias.
            _ if x2.track_op() => frozen_matmul(&x2, &self.weight, bias)?,
            _ => add_bias(match skinny_forward(&x2, &self.weight)? {
                Some(y) => y,
                None => x2.matmul(&self.weight.t()?)?,
            })?,
        };
        if let Some((pair, train)) = lora {
            y = (y + lora_product(&x2, pair, train, lora_scale)?)?;
        }
        let mut out_dims = dims;
        *out_dims.last_mut().unwrap() = self.out_features();
        Ok(y.reshape(out_dims)?)
    }

    /// `x W^T` with the repacked weight, for a contiguous f32 `[rows, in]` on the CPU; `None`
    /// where that does not apply (no packed weight, another dtype, switched off).
    #[cfg(target_arch = "x86_64")]
    fn packed_forward(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let Some(packed) = &self.packed else {
            return Ok(None);
        };
        if x.dtype() != DType::F32 || !x.device().is_cpu() || !QGEMM.on() {
            return Ok(None);
        }
        let rows = x.dims()[0];
        cpu_product(x, packed.out_features(), |input, out| {
            packed.matmul(input, rows, out)
        })
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn packed_forward(&self, _: &Tensor) -> Result<Option<Tensor>> {
        Ok(None)
    }

    /// The adapter's update alone, `scale * (x A^T) B^T`, shaped like the layer's output.
    pub(crate) fn lora_delta(
        x: &Tensor,
        pair: &LoraPair,
        train: bool,
        scale: f64,
    ) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let in_dim = *dims.last().expect("linear input has at least one dim");
        let x2 = x.reshape((x.elem_count() / in_dim.max(1), in_dim))?;
        let delta = lora_product(&x2, pair, train, scale)?;
        let mut out_dims = dims;
        *out_dims.last_mut().unwrap() = delta.dims()[1];
        Ok(delta.reshape(out_dims)?)
    }
}

/// `scale * (x A^T) B^T` for `x` of `[rows, in]`.
fn lora_product(x: &Tensor, pair: &LoraPair, train: bool, scale: f64) -> Result<Tensor> {
    let (a, scaled_b) = scaled_pair(pair, train, x.dtype(), scale)?;
    Ok(x.matmul(&a.t()?)?.matmul(&scaled_b.t()?)?)
}

/// `A` and `scale * B` of `pair` in `dtype`. The scale multiplies `B` (`[out, rank]`), not the
/// `[rows, out]` product: one small op instead of a full-size one, forward and backward.
pub(crate) fn scaled_pair(
    pair: &LoraPair,
    train: bool,
    dtype: DType,
    scale: f64,
) -> Result<(Tensor, Tensor)> {
    let (a, b) = pair.tensors(train);
    Ok((a.to_dtype(dtype)?, (b.to_dtype(dtype)? * scale)?))
}

/// `x W^T` for a few rows of f32 on a CPU with AVX-512 or AVX2 (a decoding step), with our kernel
/// instead of gemm, which would repack all of `W` first; `None` where that does not apply.
fn skinny_forward(x: &Tensor, weight: &Tensor) -> Result<Option<Tensor>> {
    #[cfg(target_arch = "x86_64")]
    {
        use super::skinny;
        let (rows, k) = x.dims2()?;
        let n = weight.dims()[0];
        // One row is gemm's: its matrix-vector path beats ours (39 vs 23-31 tok/s decoding
        // SmolLM2 at batch 1 on two AVX2 cores); from two rows ours wins (48 vs 26 at batch 2).
        let applies = (2..=skinny::MAX_ROWS).contains(&rows)
            && x.dtype() == DType::F32
            && weight.dtype() == DType::F32
            && x.device().is_cpu()
            && weight.is_contiguous()
            && skinny::available()
            && SKINNY_MATMUL.on();
        if !applies {
            return Ok(None);
        }
        let (w_storage, w_layout) = weight.storage_and_layout();
        let Some(ws) = ops::cpu_f32(&w_storage) else {
            return Ok(None);
        };
        let ws = &ws[w_layout.start_offset()..][..n * k];
        cpu_product(x, n, |xs, out| skinny::matmul(xs, ws, rows, n, k, out))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (x, weight);
        Ok(None)
    }
}

/// `product(values of x, out)` for an f32 `[rows, k]` tensor `x` on the CPU, into a new
/// `[rows, n]` tensor; `None` when `x` is elsewhere or of another dtype.
#[cfg(target_arch = "x86_64")]
fn cpu_product(
    x: &Tensor,
    n: usize,
    product: impl FnOnce(&[f32], &mut [f32]),
) -> Result<Option<Tensor>> {
    let rows = x.dims()[0];
    let x = x.contiguous()?;
    let (storage, layout) = x.storage_and_layout();
    let Some(values) = ops::cpu_f32(&storage) else {
        return Ok(None);
    };
    let mut out = vec![0f32; rows * n];
    product(&values[layout.start_offset()..][..x.elem_count()], &mut out);
    Ok(Some(Tensor::from_vec(out, (rows, n), x.device())?))
}

/// `x W^T (+ b)` for a frozen `W` (and bias) inside an autograd graph. A plain matmul would make backward compute
/// the gradient of `W` too (candle computes gradients for every argument of a tracked op), which
/// for a LoRA-only trainer is a third of all its matmul work thrown away. Here the product is
/// computed without a graph and attached to `x` through a custom op whose backward is only
/// `grad_x = grad_y W`.
fn frozen_matmul(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let y = x.detach().matmul(&weight.t()?)?;
    let y = match bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    let (storage, layout) = y.storage_and_layout();
    let output = storage.try_clone(layout)?;
    let op = FrozenMatmul {
        weight: weight.clone(),
        shape: y.shape().clone(),
        output: Mutex::new(Some(output)),
    };
    drop(storage);
    Ok(x.apply_op1(op)?)
}

struct FrozenMatmul {
    /// `[out, in]`.
    weight: Tensor,
    shape: Shape,
    /// The product, computed before the op is applied; taken by the forward.
    output: Mutex<Option<Storage>>,
}

impl FrozenMatmul {
    fn take(&self) -> candle_core::Result<Storage> {
        self.output
            .lock()
            .expect("frozen matmul lock")
            .take()
            .ok_or_else(|| candle_core::Error::Msg("frozen matmul applied twice".into()))
    }
}

impl CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        match self.take()? {
            Storage::Cpu(s) => Ok((s, self.shape.clone())),
            _ => Err(candle_core::Error::Msg(
                "frozen matmul: device mismatch".into(),
            )),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        match self.take()? {
            Storage::Cuda(s) => Ok((s, self.shape.clone())),
            _ => Err(candle_core::Error::Msg(
                "frozen matmul: device mismatch".into(),
            )),
        }
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad.matmul(&self.weight)?))
    }
}

/// Whether `q` is in a block format without a SIMD CPU kernel in candle and can be re-quantized
/// to Q8_0 (rows a multiple of its 32-value blocks).
fn needs_requantize(q: &QTensor) -> bool {
    matches!(
        q.dtype(),
        GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1 | GgmlDType::Q8_1
    ) && q
        .shape()
        .dims()
        .last()
        .is_some_and(|&n| n % GgmlDType::Q8_0.block_size() == 0)
}
