//! The decode step on CUDA: one new token for each of `B` sequences, every read of host data
//! already on the device (token ids, and the plan's table of positions and cache addresses), so
//! that the same code runs launched kernel by kernel and captured in a CUDA graph
//! ([`super::decode_graph`]).
//!
//! Per layer, for models without q/k norms, the fused path runs seven kernels for up to
//! [`cuda_decode::GEMV_ROWS`] sequences with `ART_DECODE_GEMV=1`: q, k and v in one product
//! ([`cuda_decode::gemv`]: our kernel reads each weight row once for all rows; off by default,
//! since on an H100 it measured slower than cuBLAS's products at every batch of 1-8); one kernel that adds their biases, rotates q and k, scales q and writes k and v
//! into the caches ([`cuda_decode::rope_append`]); the attention; the output product; the
//! residual add fused with the next norm ([`cuda_decode::add_rms_norm`]); gate, up and SwiGLU in
//! one product ([`cuda_decode::gemv_swiglu`]); down; and the next residual add + norm. An
//! adapter adds one kernel per product (the LoRA down-projections; the up-projection is summed
//! inside the product). Larger batches take cuBLAS's products, eleven kernels. The composite
//! path before ran about twenty-five (separate bias adds, layout copies, two rotary kernels, the
//! scale, two norms and two adds, SiLU and the product apart; four more per adapted
//! projection). Models with q/k norms (Qwen3) run the composite layers with the rotary tables
//! looked up on the device.

use super::*;

impl Model {
    /// The cos and sin of every position the decode kernels take, on the device.
    fn decode_rope(&self) -> Result<&RopeTables> {
        if let Some(tables) = self.decode_rope.get() {
            return Ok(tables);
        }
        let t = self
            .rotary
            .tables(&[0], cuda_decode::MAX_LEN, self.dtype, &self.device)?;
        let tables = RopeTables {
            cos: t.cos.squeeze(0)?,
            sin: t.sin.squeeze(0)?,
            segments: None,
        };
        Ok(self.decode_rope.get_or_init(|| tables))
    }

    /// Logits `[B, 1, vocab]` (in the model's dtype) of one token per sequence: `ids` `[B, 1]` (u32, checked by
    /// the caller), the sequences' positions and caches in `plan`, whose caches receive the new
    /// keys and values. No host copy and no synchronisation anywhere.
    pub(super) fn decode_step(
        &self,
        ids: &Tensor,
        plan: &DecodePlan,
        fwd: &Forward,
    ) -> Result<Tensor> {
        let rope = self.decode_rope()?;
        let x = self.embed(ids)?;
        if self.config.qk_norm || !cuda_decode::attend_cached_takes(self.config.head_dim) {
            let x = self.decode_layers_composite(x, rope, plan, fwd)?;
            Ok(self
                .lm_head
                .forward(&self.norm.forward(&x)?, fwd.quantized, None, 0.0)?)
        } else {
            self.decode_layers_fused(x, rope, plan, fwd)
        }
    }

    fn decode_layers_fused(
        &self,
        x: Tensor,
        rope: &RopeTables,
        plan: &DecodePlan,
        fwd: &Forward,
    ) -> Result<Tensor> {
        let b = plan.batch;
        let c = &self.config;
        let dims = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let scale = 1.0 / (c.head_dim as f64).sqrt();
        let mut h = self.layers[0].input_layernorm.forward(&x)?;
        let mut x = x;
        let hidden_size = c.hidden_size;
        let (nq, nkv) = (dims.0 * c.head_dim, dims.1 * c.head_dim);
        for (i, layer) in self.layers.iter().enumerate() {
            let a = &layer.self_attn;
            let h2 = h.reshape((b, hidden_size))?;
            let (wq, wk, wv) = (a.q_proj.weight(), a.k_proj.weight(), a.v_proj.weight());
            let projections = match decode_lora(fwd, i, &[Proj::Q, Proj::K, Proj::V]) {
                Some(lora) if cuda_decode::gemv_applies(&h2, &[wq, wk, wv]) => {
                    let y = cuda_decode::gemv(&h2, &[wq, wk, wv], as_arg(&lora))?;
                    (
                        y.narrow(1, 0, nq)?,
                        y.narrow(1, nq, nkv)?,
                        y.narrow(1, nq + nkv, nkv)?,
                    )
                }
                _ => (
                    fwd.linear_unbiased(&a.q_proj, &h, i, Proj::Q)?,
                    fwd.linear_unbiased(&a.k_proj, &h, i, Proj::K)?,
                    fwd.linear_unbiased(&a.v_proj, &h, i, Proj::V)?,
                ),
            };
            let q = cuda_decode::rope_append(
                plan,
                i,
                (&projections.0, &projections.1, &projections.2),
                [a.q_proj.bias(), a.k_proj.bias(), a.v_proj.bias()],
                (&rope.cos, &rope.sin),
                dims,
                scale as f32,
            )?;
            let attended = cuda_decode::attend_cached(plan, i, &q, dims)?;
            let o = decode_product(fwd, &a.o_proj, &attended, i, Proj::O)?.reshape((
                b,
                1,
                hidden_size,
            ))?;
            let post = &layer.post_attention_layernorm;
            let (mid, normed) = cuda_decode::add_rms_norm(&x, &o, &post.weight, post.eps)?;
            let mlp = &layer.mlp;
            let normed2 = normed.reshape((b, hidden_size))?;
            let (wg, wu) = (mlp.gate_proj.weight(), mlp.up_proj.weight());
            let hidden = match decode_lora(fwd, i, &[Proj::Gate, Proj::Up]) {
                Some(lora)
                    if mlp.gate_proj.bias().is_none()
                        && mlp.up_proj.bias().is_none()
                        && cuda_decode::gemv_applies(&normed2, &[wg, wu]) =>
                {
                    cuda_decode::gemv_swiglu(&normed2, wg, wu, as_arg(&lora))?
                }
                _ => {
                    let gate = fwd.linear(&mlp.gate_proj, &normed2, i, Proj::Gate)?;
                    let up = fwd.linear(&mlp.up_proj, &normed2, i, Proj::Up)?;
                    ops::silu_mul(&gate, &up)?
                }
            };
            let down = decode_product(fwd, &mlp.down_proj, &hidden, i, Proj::Down)?.reshape((
                b,
                1,
                hidden_size,
            ))?;
            // The residual add that ends this layer, with the norm that starts the next one
            // (after the last layer, the final norm).
            let next = self
                .layers
                .get(i + 1)
                .map_or(&self.norm, |l| &l.input_layernorm);
            (x, h) = cuda_decode::add_rms_norm(&mid, &down, &next.weight, next.eps)?;
        }
        self.lm_head.forward(&h, fwd.quantized, None, 0.0)
    }

    /// The composite layers, the rotary tables of the step gathered on the device.
    fn decode_layers_composite(
        &self,
        mut x: Tensor,
        rope: &RopeTables,
        plan: &DecodePlan,
        fwd: &Forward,
    ) -> Result<Tensor> {
        let b = plan.batch;
        let positions = plan.positions()?;
        let half = self.config.head_dim / 2;
        let step = RopeTables {
            cos: rope
                .cos
                .index_select(&positions, 0)?
                .reshape((b, 1, half))?,
            sin: rope
                .sin
                .index_select(&positions, 0)?
                .reshape((b, 1, half))?,
            segments: None,
        };
        for layer in &self.layers {
            x = layer.forward(&x, &step, None, Some(plan), fwd)?;
        }
        Ok(x)
    }
}

/// `x` `[B, in]` times one projection (with its adapter pair): our few-row product where it
/// applies (no bias: the kernel adds none), else `fwd.linear`.
fn decode_product(
    fwd: &Forward,
    linear: &Linear,
    x: &Tensor,
    layer: usize,
    proj: Proj,
) -> Result<Tensor> {
    let w = linear.weight();
    match decode_lora(fwd, layer, &[proj]) {
        Some(lora) if linear.bias().is_none() && cuda_decode::gemv_applies(x, &[w]) => {
            cuda_decode::gemv(x, &[w], as_arg(&lora))
        }
        _ => fwd.linear(linear, x, layer, proj),
    }
}

/// The adapter's pairs of `projs` in layer `layer` for the decode products, with its scale:
/// `Some(None)` without an adapter, `None` when a pair is not f32 (the products then run
/// unfused).
fn decode_lora(fwd: &Forward, layer: usize, projs: &[Proj]) -> Option<Option<DecodeLora>> {
    let Some(adapter) = fwd.adapter else {
        return Some(None);
    };
    let mut pairs = Vec::with_capacity(projs.len());
    for &proj in projs {
        let pair = adapter.get(layer, proj).map(|p| p.tensors(false));
        if let Some((a, b)) = &pair {
            if a.dtype() != DType::F32 || b.dtype() != DType::F32 {
                return None;
            }
        }
        pairs.push(pair);
    }
    Some(Some((pairs, adapter.scale())))
}

type DecodeLora = (Vec<Option<cuda_decode::LoraF32>>, f64);

fn as_arg(lora: &Option<DecodeLora>) -> Option<(&[Option<cuda_decode::LoraF32>], f64)> {
    lora.as_ref()
        .map(|(pairs, scale)| (pairs.as_slice(), *scale))
}
