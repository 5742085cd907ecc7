//! A linear layer whose base weight is frozen, kept dense (for training and reference) and,
//! for GGUF files, also quantized (for fast CPU inference).

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use super::error::Result;
use super::lora::LoraPair;

/// `y = x W^T + b`, plus `scale * (x A^T) B^T` when a LoRA pair is given.
#[derive(Debug, Clone)]
pub struct Linear {
    /// `[out, in]`, in the model's compute dtype.
    weight: Tensor,
    /// The same weight in its quantized GGUF form, when the model came from a GGUF file.
    quantized: Option<Arc<QMatMul>>,
    bias: Option<Tensor>,
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear {
            weight,
            quantized: None,
            bias,
        }
    }

    /// A linear layer from a quantized tensor: dequantized to `dtype` for the dense path, and
    /// kept quantized too when `keep_quantized`. On CPU, formats that candle has no SIMD kernel
    /// for (Q4_1, Q5_0, Q5_1, Q8_1) are re-quantized to Q8_0, which has AVX2/NEON kernels (the
    /// dense weights stay the exact dequantized GGUF values).
    pub fn from_qtensor(
        qtensor: Arc<QTensor>,
        bias: Option<Tensor>,
        device: &Device,
        dtype: DType,
        keep_quantized: bool,
    ) -> Result<Self> {
        let dense = qtensor.dequantize(device)?;
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
        let dims = x.dims().to_vec();
        let in_dim = *dims.last().expect("linear input has at least one dim");
        let rows = x.elem_count() / in_dim.max(1);
        let x2 = x.reshape((rows, in_dim))?;
        let mut y = match (&self.quantized, quantized) {
            (Some(q), true) => q.forward(&x2)?,
            _ => x2.matmul(&self.weight.t()?)?,
        };
        if let Some(b) = &self.bias {
            y = y.broadcast_add(b)?;
        }
        if let Some((pair, train)) = lora {
            let (a, b) = pair.tensors(train);
            let (a, b) = (a.to_dtype(x.dtype())?, b.to_dtype(x.dtype())?);
            let delta = x2.matmul(&a.t()?)?.matmul(&b.t()?)?;
            y = (y + (delta * lora_scale)?)?;
        }
        let mut out_dims = dims;
        *out_dims.last_mut().unwrap() = self.out_features();
        Ok(y.reshape(out_dims)?)
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
