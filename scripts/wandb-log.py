"""Sends a model's curves to Weights & Biases: every line of its history.jsonl (the same scalars
as its TensorBoard events, tagged `train/reward`, `val/reward`, `train/loss`, ...) logged to one W&B
run at its step. Run it again after more steps with the same --run-id to continue that run.

    pip install wandb                  # and `wandb login`, or WANDB_API_KEY
    python scripts/wandb-log.py .art/main-job/models/adder-1733356800 --project art-runs
    python scripts/wandb-log.py MODEL_DIR --project P --offline   # no network: then `wandb sync <printed dir>`

(wandb 0.31's `wandb sync` uploads W&B run folders only, not TensorBoard event files.)
"""

import argparse
import json
import os
import sys

import wandb


def history_by_step(model_dir):
    """{step: {tag: value}} from history.jsonl, in step order (W&B steps only go forward)."""
    steps = {}
    with open(os.path.join(model_dir, "history.jsonl")) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as error:
                sys.exit(f"line {number} of history.jsonl is not JSON ({error}); fix or delete it")
            for key, value in entry.items():
                if key in ("step", "split", "recorded_at") or not isinstance(value, (int, float)):
                    continue
                tag = key if "/" in key else f"{entry.get('split', '')}/{key}".lstrip("/")
                steps.setdefault(entry["step"], {})[tag] = value
    return dict(sorted(steps.items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="<art-dir>/<project>/models/<name>")
    parser.add_argument("--project", required=True, help="the W&B project")
    parser.add_argument("--entity", help="the W&B entity (default: your default entity)")
    parser.add_argument("--run-id", help="the run to create or continue (default: the model's name)")
    parser.add_argument("--offline", action="store_true", help="write the run locally, for `wandb sync`")
    args = parser.parse_args()
    model_dir = os.path.abspath(args.model_dir)
    name = os.path.basename(model_dir.rstrip("/"))
    steps = history_by_step(model_dir)
    if not steps:
        sys.exit(f"{model_dir}/history.jsonl has no steps to log yet")
    run = wandb.init(
        project=args.project,
        entity=args.entity,
        name=name,
        id=args.run_id or name,
        resume="allow",
        mode="offline" if args.offline else "online",
        config={"model_dir": model_dir},
    )
    # A continued run resumes at its last step: log only what it has not seen.
    first = run.step if run.resumed else 0
    logged = 0
    for step, metrics in steps.items():
        if step >= first:
            run.log(metrics, step=step)
            logged += 1
    run.finish()
    print(f"logged {logged} steps of {name} to W&B project {args.project}")


if __name__ == "__main__":
    main()
