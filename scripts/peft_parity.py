#!/usr/bin/env python3
"""PEFT parity: a LoRA adapter written by our trainer loads in Python `peft` on the same base
weights and gives the same logits as our engine.

The fixture directory (default: art-core/tests/fixtures/peft_parity, written by
`cargo test -p art-core --features train --test train -- --ignored write_peft_parity_fixture`)
holds:
  model/        a tiny random Hugging Face model (config.json, model.safetensors, tokenizer)
  adapter/      adapter_config.json + adapter_model.safetensors from a Trainer checkpoint
  expected.safetensors  input_ids [B, L] (int64) and our engine's logits [B, L, vocab] (f32),
                        with the adapter (`logits`) and without it (`base_logits`)

Run with a Python that has torch, transformers and peft:
  python scripts/peft_parity.py [FIXTURE_DIR] [--tolerance 1e-4]
Exit status 0 when the largest absolute logit difference is within the tolerance.
"""

import argparse
import pathlib
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main() -> int:
    root = pathlib.Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "fixture",
        nargs="?",
        default=root / "art-core/tests/fixtures/peft_parity",
        type=pathlib.Path,
    )
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()

    expected = load_file(str(args.fixture / "expected.safetensors"))
    input_ids = expected["input_ids"].to(torch.long)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(
        str(args.fixture / "model"), torch_dtype=torch.float32, attn_implementation="eager"
    )
    base.eval()
    with torch.no_grad():
        base_logits = base(input_ids=input_ids).logits
    model = PeftModel.from_pretrained(base, str(args.fixture / "adapter"))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits

    ok = True
    for name, ours, theirs in [
        ("base", expected["base_logits"], base_logits),
        ("adapter", expected["logits"], logits),
    ]:
        diff = (ours - theirs).abs().max().item()
        print(f"{name}: max |ours - transformers/peft| = {diff:.3e} (tolerance {args.tolerance:g})")
        ok &= diff <= args.tolerance
    # The adapter must matter, or the comparison proves nothing about it.
    effect = (expected["logits"] - expected["base_logits"]).abs().max().item()
    print(f"adapter effect: max |adapter - base| = {effect:.3e}")
    ok &= effect > 100 * args.tolerance
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
