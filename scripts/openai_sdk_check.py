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
    # The same prompt again comes from the server's prefix cache, reported as OpenAI does.
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=8, seed=1)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens, again.usage
    assert again.choices[0].message.content == choice.message.content, again.choices[0]

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

    # Structured output: the reply parses against the schema.
    schema = {
        "type": "object",
        # Bounded, so that even a random-weight model finishes the object within max_tokens.
        "properties": {"answer": {"type": "string", "maxLength": 12},
                       "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["answer", "confidence"],
    }
    structured = client.chat.completions.create(
        model=model, messages=messages, max_tokens=60, seed=4,
        response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}})
    assert structured.choices[0].finish_reason == "stop", structured.choices[0]
    reply = json.loads(structured.choices[0].message.content)
    assert isinstance(reply["answer"], str) and isinstance(reply["confidence"], int), reply

    # Tools: the model calls one (forced), the client runs it and sends the result, the model answers.
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"]}}}]
    conversation = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.chat.completions.create(model=model, messages=conversation, tools=tools,
                                            tool_choice="required", max_tokens=120, seed=5)
    call_choice = called.choices[0]
    assert call_choice.finish_reason == "tool_calls", call_choice
    call = call_choice.message.tool_calls[0]
    assert call.function.name == "get_weather", call
    assert isinstance(json.loads(call.function.arguments)["city"], str), call.function.arguments
    named = client.chat.completions.create(
        model=model, messages=conversation, tools=tools, max_tokens=120, seed=6,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather", named
    conversation.append(call_choice.message.model_dump(exclude_none=True))
    conversation.append({"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"})
    answered = client.chat.completions.create(model=model, messages=conversation, tools=tools,
                                              tool_choice="none", max_tokens=12, seed=7)
    assert isinstance(answered.choices[0].message.content, str), answered
    assert not answered.choices[0].message.tool_calls, answered
    expect_error(openai.BadRequestError, None,
                 lambda: client.chat.completions.create(model=model, messages=conversation, tool_choice="required"))
    expect_error(openai.BadRequestError, None,
                 lambda: client.chat.completions.create(
                     model=model, messages=conversation, tools=tools,
                     tool_choice={"type": "function", "function": {"name": "no_such_tool"}}))

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
    print(json.dumps({"ok": True, "checks": ["chat", "stream", "logprobs+n", "json_schema", "tools", "errors", "models"]}))


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
