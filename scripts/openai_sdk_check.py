"""Drives an `art serve` endpoint with the official `openai` Python SDK, as a user's agent would.

usage: python scripts/openai_sdk_check.py BASE_URL MODEL API_KEY
Exits non-zero, with the failed check's message, at the first thing that does not behave.
"""
import json
import sys

import openai


def main(base_url: str, model: str, api_key: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": "Say hi"}]

    # Plain chat.
    done = client.chat.completions.create(model=model, messages=messages, max_tokens=8, seed=1)
    choice = done.choices[0]
    assert choice.message.role == "assistant", choice
    assert isinstance(choice.message.content, str), choice
    assert choice.finish_reason in ("stop", "length"), choice.finish_reason
    assert done.usage.completion_tokens >= 1, done.usage
    # Our extension: the sampled token ids come along (the SDK keeps unknown fields).
    token_ids = choice.model_extra["token_ids"]
    assert len(token_ids) == done.usage.completion_tokens, (token_ids, done.usage)

    # Streaming gives the same text as the same seeded request in one piece.
    pieces, finish = [], None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=8, seed=1, stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == choice.message.content, (pieces, choice.message.content)
    assert finish == choice.finish_reason, finish

    # Logprobs and n.
    many = client.chat.completions.create(model=model, messages=messages, max_tokens=6, n=4, logprobs=True, top_logprobs=2, seed=3)
    assert len(many.choices) == 4 and sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    for c in many.choices:
        assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in c.logprobs.content), c.logprobs

    # Errors arrive as the SDK's typed exceptions with the server's message.
    expect_error(openai.NotFoundError, "model_not_found",
                 lambda: client.chat.completions.create(model="no-such-model", messages=messages))
    expect_error(openai.BadRequestError, "context_length_exceeded",
                 lambda: client.chat.completions.create(model=model, messages=[{"role": "user", "content": "word " * 5000}]))
    expect_error(openai.BadRequestError, None,
                 lambda: client.chat.completions.create(model=model, messages=messages, temperature=9))
    wrong_key = openai.OpenAI(base_url=base_url, api_key="sk-wrong", max_retries=0)
    expect_error(openai.AuthenticationError, "invalid_api_key",
                 lambda: wrong_key.chat.completions.create(model=model, messages=messages))

    models = [m.id for m in client.models.list()]
    assert model in models, models
    print(json.dumps({"ok": True, "checks": ["chat", "stream", "logprobs+n", "errors", "models"]}))


def expect_error(kind, code, call) -> None:
    try:
        call()
    except kind as error:
        if code is not None:
            assert error.code == code, (error.code, code, error)
        return
    raise AssertionError(f"expected {kind.__name__}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
