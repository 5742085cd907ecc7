"""The reference `gpu_bench train --compare-hf` measures us against: Hugging Face transformers
with peft's LoRA (r=8, alpha 16, on the seven linear layers of every block, as our trainer's
default), one training step on BATCH x SEQ random tokens (forward, the language-model loss,
backward, AdamW), on the same random-weight Qwen2.5 shapes as gpu_bench (the table of
scripts/hf_decode_reference.py), in bf16 on a GPU. With liger-kernel installed, the same again
with Liger's fused kernels (RMSNorm, RoPE, SwiGLU and the fused linear cross-entropy), which are
what a user who tunes plain transformers adds.

Prints one JSON object per variant: {"shape", "train", "tok_s", "peak_gb"}; tok/s is BATCH x SEQ
over the mean time of 5 steps after 2 warm-up steps, peak_gb the most memory torch allocated.

usage: python3 scripts/hf_train_reference.py SHAPE [BATCH] [SEQ] [DEVICE]
  e.g. python3 scripts/hf_train_reference.py qwen2.5-0.5b 8 512
  DEVICE: cuda (default) or cpu (f32; a check that the script runs, not a reference)
"""
import json
import sys
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2ForCausalLM

from hf_decode_reference import qwen2_config

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WARMUP, STEPS = 2, 5


def build(shape, device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = Qwen2ForCausalLM(qwen2_config(shape)).to(device, dtype)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS))


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def measure(shape, batch, seq, device, variant):
    torch.manual_seed(0)
    model = build(shape, device)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    ids = torch.randint(0, 32000, (batch, seq), device=device)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(WARMUP):
        step()
    sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.time()
    for _ in range(STEPS):
        step()
    sync(device)
    seconds = (time.time() - start) / STEPS
    peak = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None
    print(
        json.dumps(
            {
                "shape": shape,
                "train": variant,
                "tok_s": round(batch * seq / seconds, 1),
                "peak_gb": None if peak is None else round(peak, 2),
            }
        ),
        flush=True,
    )
    del model, optimizer
    if device == "cuda":
        torch.cuda.empty_cache()


def main():
    shape = sys.argv[1]
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    seq = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    device = sys.argv[4] if len(sys.argv) > 4 else "cuda"
    measure(shape, batch, seq, device, "hf+peft")
    if device != "cuda":
        return
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2
    except ImportError:
        print("liger-kernel is not installed: no Liger figure", file=sys.stderr)
        return
    apply_liger_kernel_to_qwen2(
        rope=True,
        rms_norm=True,
        swiglu=True,
        cross_entropy=False,
        fused_linear_cross_entropy=True,
    )
    measure(shape, batch, seq, device, "hf+peft+liger")


if __name__ == "__main__":
    main()
