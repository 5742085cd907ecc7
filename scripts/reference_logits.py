#!/usr/bin/env python3
"""Reference logits for the engine's parity tests, from an independent implementation.

A plain numpy (float64) forward of the llama / qwen2 / qwen3 decoder, written from the
Hugging Face modelling code, not from the Rust engine. Weights come either from a Hugging Face
directory (config.json + model.safetensors) or from a GGUF file, dequantized by the `gguf`
package (llama.cpp's own Python library) and with llama.cpp's q/k row permutation reversed the
way transformers' GGUF loader does it. For the GGUF file the token ids come from the Python
`tokenizers` package set up as SmolLM2's tokenizer.json is, so tokenization is checked too.

Setup (CPU only, no torch needed):
    python3 -m venv /work/.venv-ref && /work/.venv-ref/bin/pip install gguf numpy safetensors tokenizers
Usage:
    reference_logits.py hf   MODEL_DIR  OUT.json  [TOKEN_IDS...]
    reference_logits.py gguf MODEL.gguf OUT.json  PROMPT
"""
import json
import sys
from pathlib import Path

import numpy as np


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, positions, theta, head_dim):
    """Non-interleaved RoPE (rotate_half) on x [heads, L, head_dim]."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = positions[:, None] * inv_freq[None, :]
    cos = np.concatenate([np.cos(angles)] * 2, -1)
    sin = np.concatenate([np.sin(angles)] * 2, -1)
    half = head_dim // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def forward(cfg, w, tokens):
    """Logits [L, vocab] for one sequence starting at position 0."""
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    eps, theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)
    L = len(tokens)
    pos = np.arange(L, dtype=np.float64)
    x = w["model.embed_tokens.weight"][tokens]
    mask = np.triu(np.full((L, L), -np.inf), 1)

    def lin(name, v):
        y = v @ w[name + ".weight"].T
        if name + ".bias" in w:
            y = y + w[name + ".bias"]
        return y

    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = rms_norm(x, w[f"{p}.input_layernorm.weight"], eps)
        q = lin(f"{p}.self_attn.q_proj", a).reshape(L, nh, hd).transpose(1, 0, 2)
        k = lin(f"{p}.self_attn.k_proj", a).reshape(L, nkv, hd).transpose(1, 0, 2)
        v = lin(f"{p}.self_attn.v_proj", a).reshape(L, nkv, hd).transpose(1, 0, 2)
        if f"{p}.self_attn.q_norm.weight" in w:
            q = rms_norm(q, w[f"{p}.self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[f"{p}.self_attn.k_norm.weight"], eps)
        q, k = rope(q, pos, theta, hd), rope(k, pos, theta, hd)
        k = np.repeat(k, nh // nkv, axis=0)
        v = np.repeat(v, nh // nkv, axis=0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        o = (s @ v).transpose(1, 0, 2).reshape(L, nh * hd)
        x = x + lin(f"{p}.self_attn.o_proj", o)
        a = rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        g = lin(f"{p}.mlp.gate_proj", a)
        x = x + lin(f"{p}.mlp.down_proj", g / (1.0 + np.exp(-g)) * lin(f"{p}.mlp.up_proj", a))
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


def load_hf(model_dir):
    from safetensors.numpy import load_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items()}
    if cfg["model_type"] == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in w
    return cfg, w


GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def reverse_permute(weights, n_head):
    # transformers.integrations.ggml: undo convert_hf_to_gguf.py's LlamaModel.permute.
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def load_gguf(path):
    import gguf

    r = gguf.GGUFReader(path)
    field = lambda k: r.fields[k].contents()
    arch = field("general.architecture")
    nh = int(field(f"{arch}.attention.head_count"))
    nkv = int(field(f"{arch}.attention.head_count_kv"))
    h = int(field(f"{arch}.embedding_length"))
    cfg = {
        "model_type": arch,
        "hidden_size": h,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "num_hidden_layers": int(field(f"{arch}.block_count")),
        "rms_norm_eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field(f"{arch}.rope.freq_base")),
    }
    w = {}
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        a = a.reshape([int(d) for d in reversed(t.shape)]) if a.ndim > 1 or len(t.shape) > 1 else a.reshape(-1)
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        else:
            _, layer, kind, suffix = t.name.split(".")
            name = f"model.layers.{layer}.{GGUF_NAMES[kind]}.{suffix}"
            if arch == "llama" and kind in ("attn_q", "attn_k"):
                a = reverse_permute(a, nh if kind == "attn_q" else nkv)
        w[name] = a
    return cfg, w


def gguf_tokenizer(path):
    """SmolLM2's tokenizer as its Hugging Face tokenizer.json defines it (BPE; pre-tokenizer:
    single digits, then byte-level with GPT-2's regex; control tokens special), assembled with
    the Python `tokenizers` package from the vocabulary and merges stored in the GGUF file."""
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    r = gguf.GGUFReader(path)
    assert r.fields["tokenizer.ggml.pre"].contents() == "smollm", "only SmolLM2's pre-tokenizer is written here"
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in r.fields["tokenizer.ggml.merges"].contents()]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(tokens, types) if ty == 3])
    return tok


def checks(logits, tokens):
    """Top-50 ids at the last position, plus top-10 and 16 spread ids at a few others."""
    L, V = logits.shape
    out = []
    for p in sorted({0, L // 2, L - 1}):
        row = logits[p]
        k = 50 if p == L - 1 else 10
        ids = [int(i) for i in np.argsort(-row, kind="stable")[:k]]
        ids += [int(i) for i in np.linspace(0, V - 1, 16).astype(int) if int(i) not in ids]
        out.append({"position": p, "ids": ids, "logits": [float(row[i]) for i in ids]})
    return out


def main():
    mode, src, out = sys.argv[1:4]
    fixture = {"source": Path(src).name, "implementation": "numpy float64 (scripts/reference_logits.py)"}
    if mode == "hf":
        cfg, w = load_hf(src)
        tokens = [int(t) for t in sys.argv[4:]]
    elif mode == "gguf":
        cfg, w = load_gguf(src)
        prompt = sys.argv[4]
        tok = gguf_tokenizer(src)
        texts = [prompt, "Hello, world! 12345 naïve café\n\n  indented", "<|im_start|>user\nHi<|im_end|>\n"]
        fixture["tokenizer"] = [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids} for t in texts]
        tokens = fixture["tokenizer"][0]["ids"]
        fixture["prompt"] = prompt
    else:
        sys.exit("mode is hf or gguf")
    logits = forward(cfg, w, np.array(tokens))
    fixture["tokens"] = tokens
    fixture["checks"] = checks(logits, tokens)
    Path(out).write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {out}: {len(tokens)} tokens, argmax at last position {int(logits[-1].argmax())}")


if __name__ == "__main__":
    main()
