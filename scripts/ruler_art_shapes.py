#!/usr/bin/env python3
"""RULER as OpenPipe ART's own package runs it, recorded for art-core/tests/ruler.rs.

ART's `ruler_score_group` (openpipe-art, unmodified) judges a fixed group of three trajectories;
its call to the judge (litellm's `acompletion`) is answered here with a judge's answer in ART's
`Response` shape, ids out of order as a real judge may give them. The fixture holds what ART sent
(messages, the JSON schema of its `response_format`), that answer, and what ART made of it
(rewards, metrics, logs), so that the Rust test can check that our RULER sends the same kind of
request and turns the same answer into the same group.

  python scripts/ruler_art_shapes.py            writes art-core/tests/fixtures/ruler_art.json
  python scripts/ruler_art_shapes.py --check    exits 1 when the installed ART records otherwise
"""

import asyncio
import importlib
import importlib.metadata
import json
import os
import pathlib
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import

import art  # noqa: E402

# The module itself: `art.rewards.ruler` is also the name of the function the package exports.
art_ruler = importlib.import_module("art.rewards.ruler")

FIXTURE = pathlib.Path(__file__).resolve().parent.parent / "art-core/tests/fixtures/ruler_art.json"

ANSWERS = [("7", 1.0), ("12", 0.0), ("seven", 0.5)]
JUDGE_ANSWER = art_ruler.Response(scores=[
    art_ruler.TrajectoryScore(trajectory_id="2", explanation="12 is wrong.", score=0.1),
    art_ruler.TrajectoryScore(trajectory_id="1", explanation="Correct and brief.", score=0.9),
    art_ruler.TrajectoryScore(trajectory_id="3", explanation="Right, but in words.", score=0.6),
]).model_dump_json()


async def main() -> int:
    recorded = {}

    async def judge(**kwargs):
        recorded["messages"] = kwargs["messages"]
        recorded["response_format_schema"] = kwargs["response_format"].model_json_schema()
        return art_ruler.ModelResponse(choices=[{"message": {"role": "assistant",
                                                             "content": JUDGE_ANSWER}}])

    art_ruler.acompletion = judge
    art_ruler._record_ruler_cost = lambda *args, **kwargs: None
    group = art.TrajectoryGroup([
        art.Trajectory(messages_and_choices=[
            {"role": "system", "content": "Answer with one number."},
            {"role": "user", "content": "What is 3 + 4?"},
            {"role": "assistant", "content": answer}], reward=reward)
        for answer, reward in ANSWERS])
    judged = await art_ruler.ruler_score_group(group, judge_model="openai/judge")
    fixture = {
        "art_version": importlib.metadata.version("openpipe-art"),
        "trajectories": [[{"role": "system", "content": "Answer with one number."},
                          {"role": "user", "content": "What is 3 + 4?"},
                          {"role": "assistant", "content": a}] for a, _ in ANSWERS],
        "rewards": [r for _, r in ANSWERS],
        "request": recorded,
        "judge_answer": JUDGE_ANSWER,
        "result": [{"reward": t.reward, "metrics": t.metrics, "logs": t.logs}
                   for t in judged.trajectories],
    }
    text = json.dumps(fixture, indent=1, sort_keys=True) + "\n"
    if "--check" in sys.argv:
        if FIXTURE.read_text() != text:
            print(f"{FIXTURE} differs from what the installed ART records; rerun without --check")
            return 1
        print(json.dumps({"ok": True, "art_version": fixture["art_version"]}))
        return 0
    FIXTURE.write_text(text)
    print(f"wrote {FIXTURE}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
