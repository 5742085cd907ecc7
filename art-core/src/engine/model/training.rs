//! The model's training passes: layers run with recomputation (gradient checkpointing), their
//! backward, and the head's input gradient, for a trainer that runs the backward itself.

use super::*;

impl Model {
    /// The gradient of [`Model::logits`]' input (`[N, hidden]`) given the logits' (`[N, vocab]`),
    /// for a trainer that runs the head's backward itself.
    pub fn logits_input_grad(&self, grad: &Tensor) -> Result<Tensor> {
        Ok(grad.matmul(self.lm_head.weight())?)
    }

    /// [`Model::forward_hidden`]'s layers (rows packed as `packing` says) for training with
    /// recomputation (gradient checkpointing): run without a graph, keeping only each layer's input, so that a step holds
    /// one layer's activations at a time instead of every layer's. Returns the last layer's
    /// output as a variable, where the graph of the head and the loss starts (apply
    /// [`Model::final_norm`] to it), and the inputs that [`Model::backward_layers`] needs.
    pub fn forward_layers_checkpointed(
        &self,
        input_ids: &Tensor,
        packing: Option<&PackedRows>,
        adapter: Option<&LoraAdapter>,
    ) -> Result<(Var, LayerInputs)> {
        self.check_ids(input_ids)?;
        let rope = self.row_tables(input_ids.dims2()?, packing)?;
        let fwd = Forward {
            adapter,
            train: false,
            quantized: false,
        };
        let mut x = self.embed(input_ids)?;
        let mut inputs = Vec::with_capacity(self.layers.len());
        let mut casts = Vec::new();
        let manual = adapter.filter(|_| backward::available(&x) && MANUAL_BACKWARD.on());
        for (i, layer) in self.layers.iter().enumerate() {
            inputs.push(x.clone());
            x = match manual {
                Some(adapter) => {
                    casts.push(backward::LayerCasts::new(adapter, i, x.dtype())?);
                    backward::layer_forward(layer, &x, &rope, adapter, &casts[i])?
                }
                None => layer.forward(&x, &rope, None, None, &fwd)?,
            };
        }
        let inputs = LayerInputs {
            inputs,
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
        for (i, x) in inputs.inputs.into_iter().enumerate().rev() {
            if let Some(cast) = casts.pop() {
                let layer = &self.layers[i];
                grad = backward::layer_backward(layer, &x, &grad, &rope, adapter, &cast, grads)?;
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
