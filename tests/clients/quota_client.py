"""The official OpenAI and Anthropic Python SDKs spending a quota budget.

Run by tests/tests/quota_envoy.rs from the project's .venv (where
`cargo xtask setup` installs the pinned SDKs):

    python tests/clients/quota_client.py --gateway http://127.0.0.1:PORT \
        --openai-jwt TOKEN --anthropic-jwt TOKEN

Each SDK, with its defaults (retries on, the JWT as `Authorization: Bearer`:
OpenAI's `api_key=`, Anthropic's `auth_token=`; Anthropic's typed call
without `temperature`), sends requests as its own tenant until the gateway
refuses one. The last line of stdout is a JSON report: per SDK, the
requests that succeeded, the error class, status and code the SDK raised,
the `x-should-retry` it saw, the HTTP attempts it made in all and for the
refused call (an exhausted budget must not be retried).
"""

import argparse
import json

import anthropic
import openai


class Attempts:
    """Counts the HTTP requests a client sends (its retries included)."""

    def __init__(self):
        self.count = 0

    def hook(self, _request):
        self.count += 1


def spend(call, attempts, limit=200):
    ok = 0
    for i in range(limit):
        before = attempts.count
        try:
            call(i)
            ok += 1
        except (openai.APIStatusError, anthropic.APIStatusError) as e:
            body = e.body if isinstance(e.body, dict) else {}
            error = body.get("error", body) if isinstance(body, dict) else {}
            return {
                "ok": ok,
                "error": type(e).__name__,
                "status": e.status_code,
                "code": error.get("code") if isinstance(error, dict) else None,
                "type": error.get("type") if isinstance(error, dict) else None,
                "should_retry": e.response.headers.get("x-should-retry"),
                "attempts": attempts.count,
                # HTTP requests the refused call made (1: not retried).
                "refused_attempts": attempts.count - before,
            }
    return {"ok": ok, "error": None, "attempts": attempts.count}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gateway", required=True)
    parser.add_argument("--openai-jwt", required=True)
    parser.add_argument("--anthropic-jwt", required=True)
    args = parser.parse_args()
    gateway = args.gateway.rstrip("/")
    report = {}

    attempts = Attempts()
    client = openai.OpenAI(
        base_url=f"{gateway}/v1",
        api_key=args.openai_jwt,
        http_client=openai.DefaultHttpxClient(event_hooks={"request": [attempts.hook]}),
    )
    report["openai"] = spend(
        lambda i: client.chat.completions.create(
            model="gpt-test",
            messages=[{"role": "user", "content": f"openai question {i}"}],
            max_tokens=16,
        ),
        attempts,
    )

    attempts = Attempts()
    client = anthropic.Anthropic(
        base_url=gateway,
        auth_token=args.anthropic_jwt,
        http_client=anthropic.DefaultHttpxClient(event_hooks={"request": [attempts.hook]}),
    )
    report["anthropic"] = spend(
        lambda i: client.messages.create(
            model="claude-test",
            max_tokens=16,
            messages=[{"role": "user", "content": f"anthropic question {i}"}],
        ),
        attempts,
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
