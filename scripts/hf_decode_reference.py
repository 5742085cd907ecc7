"""The reference `gpu_bench decode --compare-hf` measures us against: Hugging Face transformers
sampling with a static KV cache, its forward compiled by torch.compile into CUDA graphs (what a
user gets from plain transformers at its fastest), on the same random-weight Qwen2.5 shapes,
prompt length, token count and temperature as gpu_bench.

Needs torch and transformers on a CUDA machine. Prints one JSON object per batch size:
{"shape", "batch", "tok_s", "compile_s"}; tok/s counts every sampled token over the whole
generate call (prefill included), as gpu_bench does.

usage: python3 scripts/hf_decode_reference.py SHAPE BATCHES [PROMPT] [TOKENS]
  e.g. python3 scripts/hf_decode_reference.py qwen2.5-0.5b 1,64 128 256
"""
import json
import sys
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

# The public Qwen2.5 configurations (hidden, MLP, layers, heads, KV heads, vocabulary, tying).
SHAPES = {
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064, False),
}


def qwen2_config(shape):
    """The model configuration of `shape`, with PyTorch's fused attention (SDPA)."""
    hidden, mlp, layers, heads, kv, vocab, tied = SHAPES[shape]
    config = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        max_position_embeddings=4096,
        rope_theta=1e6,
    )
    config._attn_implementation = "sdpa"
    return config


def build(shape):
    return Qwen2ForCausalLM(qwen2_config(shape)).to("cuda", torch.bfloat16).eval()


def main():
    shape = sys.argv[1]
    batches = [int(b) for b in sys.argv[2].split(",")]
    prompt = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 256
    torch.manual_seed(0)
    model = build(shape)
    for batch in batches:
        ids = torch.randint(0, 1000, (batch, prompt), device="cuda")
        options = dict(
            do_sample=True,
            temperature=1.0,
            pad_token_id=0,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            # A static cache makes generate() compile its forward (CUDA graphs).
            cache_implementation="static",
        )
        start = time.time()
        for _ in range(2):  # compilation and graph capture, then one more to settle
            model.generate(ids, **options)
        torch.cuda.synchronize()
        compile_s = time.time() - start
        start = time.time()
        model.generate(ids, **options)
        torch.cuda.synchronize()
        rate = batch * tokens / (time.time() - start)
        print(
            json.dumps(
                {
                    "shape": shape,
                    "batch": batch,
                    "tok_s": round(rate, 1),
                    "compile_s": round(compile_s, 1),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
