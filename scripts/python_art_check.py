"""Python ART (openpipe-art 0.5.23, unmodified) trains on `art serve` through ServerlessBackend.

    python_art_check.py ART_BINARY MODEL_FILE

Starts `art serve` itself (so that it can kill and restart it), then, as an ART user would:
registers a model, samples with ART's own OpenAI client, trains on a legacy group (step 1) and on
a captured-exchange group (step 2), logs, reads the step, deletes checkpoints, samples from
`...:step2`, deletes the model; and checks the bad paths (unknown base model, unsupported config
field, unknown step, wrong key) and a server killed during a training job. Prints one JSON line
with `"ok": true` at the end; any failed check raises.
"""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import art
import openai
from art.serverless.backend import ServerlessBackend

ART_BINARY, MODEL_FILE = sys.argv[1], sys.argv[2]
KEY = "sk-python-art"
# The name a Python ART program gives the default model; `art serve --alias` accepts it.
BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = [
    {"role": "system", "content": "Answer with one number."},
    {"role": "user", "content": "What is 3 + 4?"},
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`art serve` on a fixed port (a restart keeps the clients' base URL)."""

    def __init__(self, art_dir: str):
        self.art_dir, self.port, self.process = art_dir, free_port(), None
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [ART_BINARY, "serve", "--model", MODEL_FILE, "--alias", BASE_MODEL,
             "--api-key", KEY, "--port", str(self.port), "--art-dir", self.art_dir],
            stdout=subprocess.PIPE, stderr=sys.stderr, text=True,
        )
        line = self.process.stdout.readline()
        assert "listening on" in line, f"art serve did not start: {line!r}"

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()


def expect(error_type, awaitable_factory, *needles):
    """Runs the coroutine, which must raise `error_type` with every needle in its message."""

    async def run():
        try:
            await awaitable_factory()
        except error_type as e:
            for needle in needles:
                assert needle in str(e), f"{needle!r} not in {e}"
            return str(e)
        raise AssertionError(f"expected {error_type.__name__}")

    return run()


async def sample(client, model_name: str, n: int = 1):
    return await client.chat.completions.create(
        model=model_name, messages=QUESTION, max_tokens=8, temperature=1.0,
        logprobs=True, n=n,
    )


def reward_of(text: str) -> float:
    return 1.0 if "7" in text else 0.1 * (len(text) % 5)


async def legacy_group(client, model_name: str) -> art.TrajectoryGroup:
    """Four rollouts as messages_and_choices (the Choice objects ART's client returned)."""
    trajectories = []
    for i in range(4):
        completion = await sample(client, model_name)
        choice = completion.choices[0]
        trajectories.append(art.Trajectory(
            messages_and_choices=[*QUESTION, choice],
            reward=reward_of(choice.message.content or "") + 0.01 * i,
        ))
    return art.TrajectoryGroup(trajectories)


async def captured_group(client, model_name: str) -> art.TrajectoryGroup:
    """Four rollouts captured by ART from the HTTP calls made inside `with art.Trajectory()`."""
    trajectories = []
    for i in range(4):
        with art.Trajectory() as trajectory:
            completion = await sample(client, model_name)
        assert len(trajectory.exchanges.chat_completions) == 1, trajectory
        trajectory.reward = reward_of(completion.choices[0].message.content or "") + 0.01 * i
        trajectories.append(trajectory)
    return art.TrajectoryGroup(trajectories)


async def steps_listed(backend, model) -> list[int]:
    return [c.step async for c in backend._client.models.checkpoints.list(model_id=model.id)]


async def main() -> None:
    report = {}
    with tempfile.TemporaryDirectory() as work:
        server = Server(os.path.join(work, "server-art"))
        server.start()
        try:
            await checks(server, work, report)
        finally:
            if server.process.poll() is None:
                server.process.terminate()
                server.process.wait()
    print(json.dumps({"ok": True, **report}))


async def checks(server: Server, work: str, report: dict) -> None:
    backend = ServerlessBackend(api_key=KEY, base_url=server.base_url)
    new_model = lambda run_name, base_model=BASE_MODEL: art.TrainableModel(  # noqa: E731
        name="sums", run_name=run_name, project="python-art", base_model=base_model,
        base_path=os.path.join(work, "client-art"),
    )

    # Bad paths before anything exists: an unknown base model, a wrong key.
    await expect(openai.BadRequestError,
                 lambda: new_model("r0", "Qwen/Qwen2.5-7B-Instruct").register(backend),
                 "Qwen/Qwen2.5-7B-Instruct", BASE_MODEL)
    await expect(openai.AuthenticationError,
                 lambda: new_model("r0").register(ServerlessBackend(api_key="wrong",
                                                                    base_url=server.base_url)))

    model = new_model("run-1")
    await model.register(backend)
    assert model.id == "run-1" and model.entity == "local", (model.id, model.entity)
    assert await model.get_step() == 0
    client = model.openai_client()
    name = model.get_inference_name()
    assert name == "wandb-artifact:///local/python-art/run-1", name

    # Four completions as ART's client asks for them (token ids, ids as logprob tokens).
    for _ in range(4):
        completion = await sample(client, name)
        raw = completion.model_dump()
        choice = raw["choices"][0]
        assert raw["prompt_token_ids"], raw
        assert len(choice["token_ids"]) == raw["usage"]["completion_tokens"], raw
        tokens = [t["token"] for t in choice["logprobs"]["content"]]
        assert tokens == [f"token_id:{i}" for i in choice["token_ids"]], (tokens, choice)

    result = await backend.train(model, [await legacy_group(client, name)], learning_rate=1e-5)
    assert result.step == 1, result
    report["legacy_step_metrics"] = {k: v for k, v in result.metrics.items() if "loss" in k}

    captured = await captured_group(client, name)
    # PPO, and ART's KL-penalised advantages against the step-1 checkpoint.
    result = await backend.train(model, [captured], learning_rate=1e-5, loss_fn="ppo",
                                 kl_penalty_coef=0.05, kl_penalty_reference_step=1)
    assert result.step == 2 and await model.get_step() == 2, result

    await model.log([captured], split="train")
    await backend._client.models.log(model_id=model.id, trajectory_groups=[captured],
                                     split="val")
    assert os.path.isdir(os.path.join(server.art_dir, "python-art", "models", "run-1",
                                      "trajectories", "val")), "the val split was not logged"

    # Bad paths of a registered model: an unsupported setting, an unknown step.
    await expect(openai.BadRequestError,
                 lambda: backend.train(model, [captured], plot_tensors=True), "plot_tensors")
    await expect(openai.NotFoundError, lambda: sample(client, f"{name}:step9"), "step9")

    assert await steps_listed(backend, model) == [1, 2]
    await model.delete_checkpoints()  # keeps the latest (and the best, by the client's history)
    assert await steps_listed(backend, model) == [2], await steps_listed(backend, model)
    deleted = await backend._client.models.checkpoints.delete(model_id=model.id, steps=[1, 9])
    assert deleted.deleted_count == 0 and deleted.not_found_steps == [1, 9], deleted
    await expect(openai.NotFoundError, lambda: sample(client, f"{name}:step1"))
    assert (await sample(client, f"{name}:step2")).choices[0].message is not None

    # Supervised fine-tuning through ART's own SFT job client, on a JSONL file written as
    # ServerlessBackend._train_sft writes it (W&B's artifact upload replaced by a file URL).
    data = os.path.join(work, "sft.jsonl")
    with open(data, "w") as f:
        for question, answer in [("2+2?", "4"), ("3+3?", "6"), ("5+4?", "9")]:
            trajectory = art.Trajectory(
                messages_and_choices=[{"role": "user", "content": question},
                                      {"role": "assistant", "content": answer}],
                reward=0.0)
            f.write(json.dumps({"messages": trajectory.messages()}) + "\n")
    job = await backend._client.sft_training_jobs.create(
        model_id=model.id, training_data_url=f"file://{data}",
        config={"batch_size": 2, "learning_rate": 1e-5, "assistant_turns": "all"})
    kinds = []
    while not kinds or kinds[-1] not in ("training_ended", "training_failed"):
        await asyncio.sleep(0.2)
        async for event in backend._client.sft_training_jobs.events.list(
                training_job_id=job.id, after=str(len(kinds)) if kinds else openai.NOT_GIVEN):
            kinds.append(event.type)
    assert kinds == ["training_started", "gradient_step", "gradient_step", "training_ended"], kinds
    assert await model.get_step() == 3
    assert (await sample(client, f"{name}:step3")).choices[0].message is not None
    report["sft_events"] = kinds

    await backend.delete(model)
    await expect(openai.NotFoundError, lambda: sample(client, name))
    await expect(openai.NotFoundError, model.get_step)
    report["steps"] = 3

    # A server killed during a training job, then restarted on the same port: the client's
    # poll ends (failed, or completed when the checkpoint was written), it does not hang.
    model = new_model("run-killed")
    await model.register(backend)
    client = model.openai_client()
    group = await legacy_group(client, model.get_inference_name())
    jobs_dir = os.path.join(server.art_dir, "training-jobs")
    known = set(os.listdir(jobs_dir))
    train = asyncio.create_task(backend.train(model, [group], learning_rate=1e-5))
    # Killed once the step is computing (its job recorded `training_started`).
    deadline = time.monotonic() + 60
    while not any("training_started" in open(os.path.join(jobs_dir, job)).read()
                  for job in set(os.listdir(jobs_dir)) - known):
        assert time.monotonic() < deadline, "no training job started"
        await asyncio.sleep(0.01)
    server.kill()
    server.start()
    started = time.monotonic()
    try:
        outcome = f"completed at step {(await asyncio.wait_for(train, 60)).step}"
    except RuntimeError as e:
        assert "Training job failed" in str(e) and "server stopped" in str(e), e
        outcome = "training_failed"
    report["killed_job"] = outcome
    report["killed_job_seconds_to_answer"] = round(time.monotonic() - started, 2)
    # The restarted server resumes the model from its last complete checkpoint.
    await model.register(backend)
    step = await model.get_step()
    assert step == (1 if outcome.startswith("completed") else 0), (outcome, step)
    result = await backend.train(model, [group], learning_rate=1e-5)
    assert result.step == step + 1, result
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
