//! A hand-written backward pass through one decoder layer, for LoRA training with gradient
//! checkpointing: the layer's forward is recomputed from its saved input (keeping what the
//! backward reads), then the gradients flow back through it in plain tensor ops, with the fused
//! kernels of [`crate::engine::ops`] for the norms, the rotary embedding and the softmax.
//!
//! Why not candle's autograd: its backward fills a zero tensor and adds into it for every
//! argument of every op, computes gradients for constants and frozen weights alike, and spends
//! host time per graph node that, on a GPU, exceeds the device's work several times over (a
//! 0.5B model's layer has about 150 nodes). Here only what LoRA training needs is computed:
//! the gradient of each layer's input and of each adapter matrix, about 60 ops per layer. The
//! frozen weights get no gradient, and the last projection's output is not even recomputed
//! (nothing in the backward reads it).
//!
//! The checkpointed forward runs layers through the same code ([`layer_forward`]), with each
//! adapter pair cast to the activations' dtype once per micro-batch ([`LayerCasts`]), shared
//! by the forward and the backward.
//!
//! Checked against candle's autograd over the whole graph (tests/train.rs, in f64 on the CPU).

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use super::{causal_probs, DecoderLayer, RmsNorm, RopeTables};
use crate::engine::error::Result;
use crate::engine::linear::{scaled_pair, Linear};
use crate::engine::lora::{LoraAdapter, LoraPair, Proj};
use crate::engine::ops;

/// One layer's adapter pairs in the activations' dtype, by [`Proj::index`]: `A`
/// (`[rank, in]`) and `scale * B` (`[out, rank]`).
pub(crate) struct LayerCasts([Option<(Tensor, Tensor)>; 7]);

impl LayerCasts {
    pub(super) fn new(adapter: &LoraAdapter, layer: usize, dtype: DType) -> Result<Self> {
        let mut pairs: [Option<(Tensor, Tensor)>; 7] = Default::default();
        for proj in Proj::ALL {
            if let Some(pair) = adapter.get(layer, proj) {
                pairs[proj.index()] = Some(scaled_pair(pair, false, dtype, adapter.scale())?);
            }
        }
        Ok(LayerCasts(pairs))
    }
}

/// A frozen linear layer with its adapter pair (if any).
struct Adapted<'a> {
    linear: &'a Linear,
    /// `A` and `scale * B` in the activations' dtype, and the variables themselves.
    lora: Option<(&'a Tensor, &'a Tensor, &'a LoraPair)>,
    scale: f64,
}

/// What a linear layer's backward reads: its input and, with an adapter, `x A^T`.
struct Saved {
    x: Tensor,
    xa: Option<Tensor>,
}

impl Adapted<'_> {
    /// Only what the backward needs, without the output.
    fn save(&self, x: &Tensor) -> Result<Saved> {
        let xa = match &self.lora {
            Some((a, _, _)) => Some(x.matmul(&a.t()?)?),
            None => None,
        };
        Ok(Saved { x: x.clone(), xa })
    }

    /// `y = x W^T + b + (x A^T) (s B)^T` for `x` of `[T, in]`.
    fn forward(&self, x: &Tensor) -> Result<(Tensor, Saved)> {
        let y = self.linear.forward(x, false, None, 0.0)?;
        let saved = self.save(x)?;
        let y = match (&self.lora, &saved.xa) {
            (Some((_, sb, _)), Some(xa)) => add_matmul(y, xa, &sb.t()?)?,
            _ => y,
        };
        Ok((y, saved))
    }

    /// The gradient of the input for `dy` (`[T, out]`), added to `sum` when given (the input
    /// feeds several projections); the adapter's gradients go to `grads`:
    /// `dB = s dy^T (x A^T)`, `dA = (s dy B)^T x`, `dx = dy W + (s dy B) A`.
    fn backward(
        &self,
        saved: Saved,
        dy: &Tensor,
        sum: Option<Tensor>,
        grads: &mut GradStore,
    ) -> Result<Tensor> {
        let weight = self.linear.weight();
        let dx = match sum {
            Some(sum) => add_matmul(sum, dy, weight)?,
            None => dy.matmul(weight)?,
        };
        let (Some((a, sb, pair)), Some(xa)) = (&self.lora, &saved.xa) else {
            return Ok(dx);
        };
        let dyb = dy.matmul(sb)?;
        let dx = add_matmul(dx, &dyb, a)?;
        let db = (dy.t()?.matmul(xa)? * self.scale)?;
        let da = dyb.t()?.matmul(&saved.x)?;
        accumulate(grads, &pair.b, &db)?;
        accumulate(grads, &pair.a, &da)?;
        Ok(dx)
    }
}

/// `c + a b` for 2-D operands; on CUDA in `c`'s own memory, by the product's kernel itself
/// (`c` must be a tensor that nothing else holds).
fn add_matmul(c: Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if c.device().is_cuda() && c.is_contiguous() && ops::supported(&c) {
        c.inplace_op3(a, b, &crate::engine::cuda_ops::AddMatmul)?;
        return Ok(c);
    }
    Ok((c + a.matmul(b)?)?)
}

/// Adds `grad` (in any dtype) to the gradient stored for `var`.
fn accumulate(grads: &mut GradStore, var: &Var, grad: &Tensor) -> Result<()> {
    let grad = grad.to_dtype(var.dtype())?;
    let sum = match grads.remove(var.as_tensor()) {
        Some(g) => (g + grad)?,
        None => grad,
    };
    grads.insert(var.as_tensor(), sum);
    Ok(())
}

fn norm_grad(norm: &RmsNorm, x: &Tensor, grad: &Tensor) -> Result<Tensor> {
    Ok(ops::rms_norm_grad(x, &norm.weight, grad, norm.eps)?)
}

/// The seven projections of `layer` with their cast adapter pairs.
fn projections<'a>(
    layer: &'a DecoderLayer,
    casts: &'a LayerCasts,
    adapter: &'a LoraAdapter,
) -> [Adapted<'a>; 7] {
    let (attn, mlp) = (&layer.self_attn, &layer.mlp);
    let linear = |proj: Proj| match proj {
        Proj::Q => &attn.q_proj,
        Proj::K => &attn.k_proj,
        Proj::V => &attn.v_proj,
        Proj::O => &attn.o_proj,
        Proj::Gate => &mlp.gate_proj,
        Proj::Up => &mlp.up_proj,
        Proj::Down => &mlp.down_proj,
    };
    Proj::ALL.map(|proj| Adapted {
        linear: linear(proj),
        lora: match (&casts.0[proj.index()], adapter.get(attn.layer, proj)) {
            (Some((a, sb)), Some(pair)) => Some((a, sb, pair)),
            _ => None,
        },
        scale: adapter.scale(),
    })
}

/// A layer's forward on `[T, hidden]` rows, with what its backward reads: recomputed by
/// [`layer_backward`] from the layer's input, or kept from the forward ([`layer_forward`]).
pub(super) struct Activations {
    saved: [Option<Saved>; 7],
    /// Queries and keys before their norms, `[B, L, heads, hd]`.
    q: Tensor,
    k: Tensor,
    /// Scaled, rotated queries stacked by key head `[B, kv, n_rep * L, hd]`; rotated keys and
    /// values `[B, kv, L, hd]`; the attention probabilities.
    q_grouped: Tensor,
    k_rot: Tensor,
    v: Tensor,
    probs: Tensor,
    /// The residual stream after attention, and the MLP's gate and up projections.
    x2: Tensor,
    gate: Tensor,
    up: Tensor,
    /// The layer's output, when asked for.
    out: Option<Tensor>,
}

impl Activations {
    /// The memory these activations hold, each buffer counted once (the projections that read
    /// the same input share it).
    pub(super) fn bytes(&self) -> usize {
        let mut seen = std::collections::HashSet::new();
        let saved = self.saved.iter().flatten();
        let inputs = saved.flat_map(|s| std::iter::once(&s.x).chain(s.xa.as_ref()));
        let kept = [
            &self.q,
            &self.k,
            &self.q_grouped,
            &self.k_rot,
            &self.v,
            &self.probs,
            &self.x2,
            &self.gate,
            &self.up,
        ];
        inputs
            .chain(kept)
            .filter(|t| seen.insert(t.id()))
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }
}

fn activations(
    layer: &DecoderLayer,
    x: &Tensor,
    (b, l): (usize, usize),
    rope: &RopeTables,
    projs: &[Adapted; 7],
    output: bool,
) -> Result<Activations> {
    let attn = &layer.self_attn;
    let (h, kv, hd) = (attn.num_heads, attn.num_kv_heads, attn.head_dim);
    let t = b * l;
    let mut saved: [Option<Saved>; 7] = Default::default();
    let mut run = |proj: Proj, x: &Tensor| -> Result<Tensor> {
        let (y, s) = projs[proj.index()].forward(x)?;
        saved[proj.index()] = Some(s);
        Ok(y)
    };
    let h1 = layer.input_layernorm.forward(x)?;
    let q = run(Proj::Q, &h1)?.reshape((b, l, h, hd))?;
    let k = run(Proj::K, &h1)?.reshape((b, l, kv, hd))?;
    let v = ops::transpose12(&run(Proj::V, &h1)?.reshape((b, l, kv, hd))?)?;
    let q_normed = match &attn.q_norm {
        Some(n) => n.forward(&q)?,
        None => q.clone(),
    };
    let k_normed = match &attn.k_norm {
        Some(n) => n.forward(&k)?,
        None => k.clone(),
    };
    let softmax_scale = 1.0 / (hd as f64).sqrt();
    let q_rot = (rope.apply(&ops::transpose12(&q_normed)?)? * softmax_scale)?;
    let k_rot = rope.apply(&ops::transpose12(&k_normed)?)?;
    // The query heads sharing a key head, stacked: [B, kv, n_rep * L, hd].
    let q_grouped = q_rot.reshape((b, kv, (h / kv) * l, hd))?;
    let probs = causal_probs(&q_grouped.matmul(&k_rot.t()?)?, l, rope)?;
    let attended =
        ops::transpose12(&probs.matmul(&v)?.reshape((b, h, l, hd))?)?.reshape((t, h * hd))?;
    let x2 = ops::add(x, &run(Proj::O, &attended)?)?;
    let h2 = layer.post_attention_layernorm.forward(&x2)?;
    let gate = run(Proj::Gate, &h2)?;
    let up = run(Proj::Up, &h2)?;
    let hidden = ops::silu_mul(&gate, &up)?;
    // The backward needs the down projection's input, not its output.
    let down = &projs[Proj::Down.index()];
    let out = if output {
        let (y, s) = down.forward(&hidden)?;
        saved[Proj::Down.index()] = Some(s);
        Some(ops::add(&x2, &y)?)
    } else {
        saved[Proj::Down.index()] = Some(down.save(&hidden)?);
        None
    };
    Ok(Activations {
        saved,
        q,
        k,
        q_grouped,
        k_rot,
        v,
        probs,
        x2,
        gate,
        up,
        out,
    })
}

/// `layer` on `x` (`[B, L, hidden]`, sequences from position 0), without a graph: the
/// checkpointed forward, the same arithmetic as [`layer_backward`]'s recomputation. With `keep`,
/// also what the backward reads, so that it need not recompute the layer.
pub(super) fn layer_forward(
    layer: &DecoderLayer,
    x: &Tensor,
    rope: &RopeTables,
    adapter: &LoraAdapter,
    casts: &LayerCasts,
    keep: bool,
) -> Result<(Tensor, Option<Activations>)> {
    let (b, l, hidden) = x.dims3()?;
    let projs = projections(layer, casts, adapter);
    let mut act = activations(
        layer,
        &x.reshape((b * l, hidden))?,
        (b, l),
        rope,
        &projs,
        true,
    )?;
    let out = act.out.take().expect("asked for the output");
    Ok((out.reshape((b, l, hidden))?, keep.then_some(act)))
}

/// The gradient of `x` (`[B, L, hidden]`, sequences from position 0), `layer`'s input, for
/// `grad` (the gradient of the layer's output), storing the gradients of the layer's adapter
/// matrices in `grads`. The layer is recomputed on `x` unless its activations were `kept`.
#[allow(clippy::too_many_arguments)]
pub(super) fn layer_backward(
    layer: &DecoderLayer,
    x: &Tensor,
    kept: Option<Activations>,
    grad: &Tensor,
    rope: &RopeTables,
    adapter: &LoraAdapter,
    casts: &LayerCasts,
    grads: &mut GradStore,
) -> Result<Tensor> {
    let (b, l, hidden) = x.dims3()?;
    let t = b * l;
    let attn = &layer.self_attn;
    let (h, kv, hd) = (attn.num_heads, attn.num_kv_heads, attn.head_dim);
    let x = x.reshape((t, hidden))?;
    let projs = projections(layer, casts, adapter);
    let Activations {
        mut saved,
        q,
        k,
        q_grouped,
        k_rot,
        v,
        probs,
        x2,
        gate,
        up,
        out: _,
    } = match kept {
        Some(act) => act,
        None => activations(layer, &x, (b, l), rope, &projs, false)?,
    };
    let mut back = |proj: Proj, dy: &Tensor, sum: Option<Tensor>, grads: &mut GradStore| {
        let s = saved[proj.index()]
            .take()
            .expect("every projection ran forward");
        projs[proj.index()].backward(s, dy, sum, grads)
    };

    // The MLP and its residual.
    let grad = grad.reshape((t, hidden))?;
    let d_hidden = back(Proj::Down, &grad, None, grads)?;
    let (d_gate, d_up) = ops::silu_mul_grad(&gate, &up, &d_hidden)?;
    let d_h2 = back(Proj::Gate, &d_gate, None, grads)?;
    let d_h2 = back(Proj::Up, &d_up, Some(d_h2), grads)?;
    let d_x2 = ops::add(
        &grad,
        &norm_grad(&layer.post_attention_layernorm, &x2, &d_h2)?,
    )?;

    // Attention and its residual.
    let d_grouped = ops::transpose12(&back(Proj::O, &d_x2, None, grads)?.reshape((b, l, h, hd))?)?
        .reshape((b, kv, (h / kv) * l, hd))?;
    let d_probs = d_grouped.matmul(&v.t()?)?;
    let d_v = probs.t()?.matmul(&d_grouped)?;
    let d_scores = ops::softmax_grad(&probs, &d_probs)?;
    let softmax_scale = 1.0 / (hd as f64).sqrt();
    let d_q_rot = (d_scores.matmul(&k_rot)?.reshape((b, h, l, hd))? * softmax_scale)?;
    let d_k_rot = d_scores.t()?.matmul(&q_grouped)?;
    let d_q = ops::transpose12(&ops::rope_grad(&d_q_rot, &rope.cos, &rope.sin)?)?;
    let d_k = ops::transpose12(&ops::rope_grad(&d_k_rot, &rope.cos, &rope.sin)?)?;
    let d_q = match &attn.q_norm {
        Some(n) => norm_grad(n, &q, &d_q)?,
        None => d_q,
    };
    let d_k = match &attn.k_norm {
        Some(n) => norm_grad(n, &k, &d_k)?,
        None => d_k,
    };
    let d_q = d_q.reshape((t, h * hd))?;
    let d_k = d_k.reshape((t, kv * hd))?;
    let d_v = ops::transpose12(&d_v)?.reshape((t, kv * hd))?;
    let d_h1 = back(Proj::Q, &d_q, None, grads)?;
    let d_h1 = back(Proj::K, &d_k, Some(d_h1), grads)?;
    let d_h1 = back(Proj::V, &d_v, Some(d_h1), grads)?;
    let d_x = ops::add(&d_x2, &norm_grad(&layer.input_layernorm, &x, &d_h1)?)?;
    Ok(d_x.reshape((b, l, hidden))?)
}
