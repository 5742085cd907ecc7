//! The decode step on CUDA: one new token for each of `B` sequences, every read of host data
//! already on the device (token ids, and the plan's table of positions and cache addresses), so
//! that the same code runs launched kernel by kernel and captured in a CUDA graph
//! ([`super::decode_graph`]).
//!
//! Per layer, for models without q/k norms, the fused path runs twelve kernels: the q, k and v
//! products; one kernel that adds their biases, rotates q and k, scales q and writes k and v
//! into the caches ([`cuda_decode::rope_append`]); the attention; the output product; the
//! residual add fused with the next norm ([`cuda_decode::add_rms_norm`]); gate and up; SwiGLU;
//! down; and the next residual add + norm. The composite path it replaces ran about
//! twenty-five (separate bias adds, layout copies, two rotary kernels, the scale, two norms
//! and two adds, SiLU and the product apart). Models with q/k norms (Qwen3) run the composite
//! layers with the rotary tables looked up on the device.

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

    /// Logits `[B, 1, vocab]` (f32) of one token per sequence: `ids` `[B, 1]` (u32, checked by
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
        if self.config.qk_norm {
            let x = self.decode_layers_composite(x, rope, plan, fwd)?;
            self.head(&x, fwd)
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
        for (i, layer) in self.layers.iter().enumerate() {
            let a = &layer.self_attn;
            let q = fwd.linear_unbiased(&a.q_proj, &h, i, Proj::Q)?;
            let k = fwd.linear_unbiased(&a.k_proj, &h, i, Proj::K)?;
            let v = fwd.linear_unbiased(&a.v_proj, &h, i, Proj::V)?;
            let q = cuda_decode::rope_append(
                plan,
                i,
                (&q, &k, &v),
                [a.q_proj.bias(), a.k_proj.bias(), a.v_proj.bias()],
                (&rope.cos, &rope.sin),
                dims,
                scale as f32,
            )?;
            let attended = cuda_decode::attend_cached(plan, i, &q, dims)?.reshape((b, 1, ()))?;
            let o = fwd.linear(&a.o_proj, &attended, i, Proj::O)?;
            let post = &layer.post_attention_layernorm;
            let (mid, normed) = cuda_decode::add_rms_norm(&x, &o, &post.weight, post.eps)?;
            let mlp = &layer.mlp;
            let gate = fwd.linear(&mlp.gate_proj, &normed, i, Proj::Gate)?;
            let up = fwd.linear(&mlp.up_proj, &normed, i, Proj::Up)?;
            let hidden = ops::silu_mul(&gate, &up)?;
            let down = fwd.linear(&mlp.down_proj, &hidden, i, Proj::Down)?;
            // The residual add that ends this layer, with the norm that starts the next one
            // (after the last layer, the final norm).
            let next = self
                .layers
                .get(i + 1)
                .map_or(&self.norm, |l| &l.input_layernorm);
            (x, h) = cuda_decode::add_rms_norm(&mid, &down, &next.weight, next.eps)?;
        }
        let logits = self.lm_head.forward(&h, fwd.quantized, None, 0.0)?;
        Ok(logits.to_dtype(DType::F32)?)
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
