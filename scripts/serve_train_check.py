"""End-to-end check of a running `art serve` over HTTP, with nothing but Python's standard library
(so it runs on a bare GPU machine): sample a group of answers with logprobs, train one GRPO step
on them, and sample again from the trained adapter (`name@1`) without restarting the server.

    art serve --model DIR --device cuda --port 8000 &
    python3 scripts/serve_train_check.py [http://127.0.0.1:8000] [base-model-name]
"""
import json
import sys
import time
import urllib.request

BASE = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"


def call(method, path, body=None):
    request = urllib.request.Request(
        BASE + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method=method,
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return response.read().decode()


def wait_until_healthy(seconds=300):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            call("GET", "/health")
            return
        except OSError:
            time.sleep(1)
    sys.exit("the server did not come up")


def main():
    wait_until_healthy()
    models = json.loads(call("GET", "/v1/models"))["data"]
    base = sys.argv[2] if len(sys.argv) > 2 else models[0]["id"]
    prompt = [{"role": "user", "content": "Say a number."}]
    started = time.time()
    completion = json.loads(call("POST", "/v1/chat/completions", {
        "model": base, "messages": prompt, "n": 4, "max_tokens": 8, "temperature": 1.0,
        "logprobs": True, "seed": 1,
    }))
    choices = completion["choices"]
    assert len(choices) == 4, completion
    assert all(c["logprobs"]["content"] for c in choices), "every choice carries logprobs"
    print(f"sampled 4 choices from {base} in {time.time() - started:.2f}s:",
          [c["message"]["content"] for c in choices])

    name = f"check-{int(time.time())}"
    call("POST", "/v1/art/models", {"name": name, "project": "serve-check", "base_model": base})
    group = {"trajectories": [
        {"messages_and_choices": prompt + [choice], "reward": float(i)}
        for i, choice in enumerate(choices)
    ]}
    started = time.time()
    lines = call("POST", f"/v1/art/models/{name}/train",
                 {"trajectory_groups": [group], "config": {"learning_rate": 1e-4}})
    events = [json.loads(line) for line in lines.splitlines() if line.strip()]
    result = events[-1]
    assert result["type"] == "result", events[-1]
    print(f"trained step {result.get('step')} in {time.time() - started:.2f}s:",
          {k: v for k, v in result.items() if k != "type"})

    trained = f"{name}@1"
    again = json.loads(call("POST", "/v1/chat/completions", {
        "model": trained, "messages": prompt, "max_tokens": 8, "temperature": 0.0,
    }))
    assert again["model"] == trained, again["model"]
    print(f"{trained} answers:", again["choices"][0]["message"]["content"])
    print("ok")


if __name__ == "__main__":
    main()
