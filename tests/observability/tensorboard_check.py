"""Reads a model's TensorBoard events with TensorBoard's own EventAccumulator and compares them with
its history.jsonl: the same tags, steps and values (as float32). Prints a JSON summary; exits 1 on a
difference.

    python tensorboard_check.py MODEL_DIR
"""

import json
import math
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

model_dir = Path(sys.argv[1])
accumulator = EventAccumulator(str(model_dir / "tensorboard"), size_guidance={"scalars": 0})
accumulator.Reload()
ours = {
    tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
    for tag in accumulator.Tags()["scalars"]
}

expected = {}
for line in (model_dir / "history.jsonl").read_text().splitlines():
    entry = json.loads(line)
    for key, number in entry.items():
        if key in ("step", "split", "recorded_at") or not isinstance(number, (int, float)):
            continue
        tag = key if "/" in key else f"{entry.get('split', '')}/{key}".lstrip("/")
        expected.setdefault(tag, []).append((entry["step"], number))

problems = []
if set(ours) != set(expected):
    problems.append(f"tags differ: only in TensorBoard {sorted(set(ours) - set(expected))}, "
                    f"only in history {sorted(set(expected) - set(ours))}")
for tag, points in expected.items():
    got = ours.get(tag, [])
    if [s for s, _ in got] != [s for s, _ in points]:
        problems.append(f"{tag}: steps {[s for s, _ in got]} != {[s for s, _ in points]}")
        continue
    for (step, value), (_, want) in zip(got, points):
        if not math.isclose(value, want, rel_tol=1e-6, abs_tol=1e-6):
            problems.append(f"{tag} at step {step}: {value} != {want}")
print(json.dumps({"tags": len(ours), "points": sum(map(len, ours.values())),
                  "steps": sorted({s for p in ours.values() for s, _ in p}), "problems": problems}))
sys.exit(1 if problems else 0)
