//! The model's training passes: layers run with recomputation (gradient checkpointing), their
//! backward, and the head's input gradient, for a trainer that runs the backward itself.

use super::*;

impl Model {
    /// Whether training layers run the hand-written backward ([`backward::layer_backward`]),
    /// which can keep layers' activations instead of recomputing them: the fused kernels exist
    /// for this device and dtype and are switched on.
    pub fn has_layer_backward(&self) -> bool {
        MANUAL_BACKWARD.on() && crate::engine::ops::supported_for(self.device(), self.dtype())
    }

    /// The gradient of [`Model::logits`]' input (`[N, hidden]`) given the logits' (`[N, vocab]`),
    /// for a trainer that runs the head's backward itself.
    pub fn logits_input_grad(&self, grad: &Tensor) -> Result<Tensor> {
        Ok(grad.matmul(self.lm_head.weight())?)
    }

    /// [`Model::forward_hidden`]'s layers (rows packed as `packing` says) for training with
    /// recomputation (gradient checkpointing): run without a graph, keeping each layer's input
    /// and, for as many of the last layers as `keep_bytes` holds, the activations their backward
    /// reads; [`Model::backward_layers`] recomputes the other layers one at a time (a second
    /// forward pass of theirs, to hold one layer's activations instead of all). Returns the last
    /// layer's output as a variable, where the graph of the head and the loss starts (apply
    /// [`Model::final_norm`] to it), and what [`Model::backward_layers`] needs.
    ///
    /// Activations are kept only where the hand-written layer backward runs (an adapter, the
    /// fused kernels for this device and dtype).
    pub fn forward_layers_checkpointed(
        &self,
        input_ids: &Tensor,
        packing: Option<&PackedRows>,
        adapter: Option<&LoraAdapter>,
        keep_bytes: usize,
    ) -> Result<(Var, LayerInputs)> {
        self.check_ids(input_ids)?;
        let rope = self.row_tables(input_ids.dims2()?, packing)?;
        let fwd = Forward {
            adapter,
            train: false,
            quantized: false,
        };
        let mut x = self.embed(input_ids)?;
        let num_layers = self.layers.len();
        let mut inputs = Vec::with_capacity(num_layers);
        let mut casts = Vec::new();
        let mut kept = Vec::with_capacity(num_layers);
        // Layers whose activations are kept: the last ones, whose backward runs first, so that
        // their memory is free again before the others are recomputed. Every layer's
        // activations are the same size: layer 0's (computed either way) decide how many.
        let mut keep_from = num_layers;
        let mut layer_bytes = 0;
        let manual = adapter.filter(|_| self.has_layer_backward());
        for (i, layer) in self.layers.iter().enumerate() {
            inputs.push(x.clone());
            let Some(adapter) = manual else {
                x = layer.forward(&x, &rope, None, None, &fwd)?;
                continue;
            };
            casts.push(backward::LayerCasts::new(adapter, i, x.dtype())?);
            let measure = i == 0 && keep_bytes > 0;
            let (out, act) = backward::layer_forward(
                layer,
                &x,
                &rope,
                adapter,
                &casts[i],
                measure || i >= keep_from,
            )?;
            if measure {
                layer_bytes = act.as_ref().map_or(0, backward::Activations::bytes);
                keep_from = num_layers - (keep_bytes / layer_bytes.max(1)).min(num_layers);
            }
            kept.push(act.filter(|_| i >= keep_from));
            x = out;
        }
        let inputs = LayerInputs {
            inputs,
            kept,
            layer_bytes,
            rope,
            casts,
        };
        Ok((Var::from_tensor(&x)?, inputs))
    }

    /// The final RMS norm, differentiable: the step from the last layer's output to the hidden
    /// states the language-model head reads.
    pub fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        self.norm.forward(x)
    }

    /// The backward of [`Model::forward_layers_checkpointed`]: given `grad`, the gradient of the
    /// last layer's output, rebuilds each layer's graph from its saved input (last layer first),
    /// backpropagates through it, and stores the gradient of every `adapter` variable in
    /// `grads`. One layer's graph lives at a time.
    pub fn backward_layers(
        &self,
        inputs: LayerInputs,
        grad: Tensor,
        adapter: &LoraAdapter,
        grads: &mut GradStore,
    ) -> Result<()> {
        let rope = inputs.rope;
        let fwd = Forward {
            adapter: Some(adapter),
            train: true,
            quantized: false,
        };
        let mut grad = grad.detach();
        let mut casts = inputs.casts;
        let mut kept = inputs.kept;
        for (i, x) in inputs.inputs.into_iter().enumerate().rev() {
            if let Some(cast) = casts.pop() {
                let layer = &self.layers[i];
                let act = kept.pop().flatten();
                grad =
                    backward::layer_backward(layer, &x, act, &grad, &rope, adapter, &cast, grads)?;
                continue;
            }
            // Elsewhere (no fused kernels): candle's autograd over one layer's rebuilt graph.
            // The embedding (layer 0's input) needs no gradient.
            let x = if i > 0 {
                Var::from_tensor(&x)?.into_inner()
            } else {
                x
            };
            let y = self.layers[i].forward(&x, &rope, None, None, &fwd)?;
            // d/dtheta sum(y * grad) = grad^T dy/dtheta: the vector-Jacobian product wanted.
            let layer_grads = (y * &grad)?.sum_all()?.backward()?;
            for proj in Proj::ALL {
                let Some(pair) = adapter.get(i, proj) else {
                    continue;
                };
                for var in [&pair.a, &pair.b] {
                    if let Some(g) = layer_grads.get(var.as_tensor()) {
                        grads.insert(var.as_tensor(), g.clone());
                    }
                }
            }
            if i > 0 {
                grad = layer_grads
                    .get(&x)
                    .ok_or_else(|| {
                        candle_core::Error::Msg(format!("no gradient reached layer {i}'s input"))
                    })?
                    .clone();
            }
        }
        Ok(())
    }
}
