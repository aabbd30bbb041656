"""The official OpenAI and Anthropic Python SDKs reading a stream that quota
cuts (`stream: hard`, a budget smaller than the stream).

Run by tests/tests/quota_envoy.rs from the project's .venv:

    python tests/clients/quota_hard_client.py --gateway http://127.0.0.1:PORT \
        --openai-jwt TOKEN --anthropic-jwt TOKEN

Each SDK streams one long answer with its own typed streaming API (OpenAI
`chat.completions.create(stream=True)` asking `include_usage`; Anthropic
`messages.stream()` and its final message). The last line of stdout is a
JSON report per SDK: the text's UTF-8 bytes, the finish/stop reason, the
usage the SDK parsed, the events it read, or the exception it raised.
"""

import argparse
import json

import anthropic
import openai


def openai_stream(gateway, jwt):
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=jwt)
    text, finish, usage, chunks = "", None, None, 0
    stream = client.chat.completions.create(
        model="gpt-test",
        messages=[{"role": "user", "content": "write a long story"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        chunks += 1
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
        if chunk.usage is not None:
            usage = {
                "input": chunk.usage.prompt_tokens,
                "output": chunk.usage.completion_tokens,
            }
    return {
        "text_bytes": len(text.encode()),
        "reason": finish,
        "usage": usage,
        "events": chunks,
    }


def anthropic_stream(gateway, jwt):
    client = anthropic.Anthropic(base_url=gateway, auth_token=jwt)
    events = 0
    with client.messages.stream(
        model="claude-test",
        max_tokens=4000,
        messages=[{"role": "user", "content": "write a long story"}],
    ) as stream:
        for _ in stream:
            events += 1
        message = stream.get_final_message()
    text = "".join(b.text for b in message.content if b.type == "text")
    return {
        "text_bytes": len(text.encode()),
        "reason": message.stop_reason,
        "usage": {
            "input": message.usage.input_tokens,
            "output": message.usage.output_tokens,
        },
        "events": events,
    }


def run(f, *args):
    try:
        return f(*args)
    except Exception as e:  # reported, not raised: the test shows it
        return {"error": f"{type(e).__name__}: {e}"}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gateway", required=True)
    parser.add_argument("--openai-jwt", required=True)
    parser.add_argument("--anthropic-jwt", required=True)
    args = parser.parse_args()
    gateway = args.gateway.rstrip("/")
    report = {
        "openai": run(openai_stream, gateway, args.openai_jwt),
        "anthropic": run(anthropic_stream, gateway, args.anthropic_jwt),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
