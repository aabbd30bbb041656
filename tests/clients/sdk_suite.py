"""The official OpenAI and Anthropic Python SDKs against a zerolayer gateway.

Run by tests/tests/sdk_clients.rs (from the project's .venv, where
`cargo xtask setup` installs the pinned SDKs, tools/requirements-clients.txt)
against the chain in real Envoy (every form) and in ngx_wasm_module:

    python tests/clients/sdk_suite.py --gateway http://127.0.0.1:PORT \
        --jwt TOKEN --api-key KEY --bad-key KEY --run RUN

Every call is what an application writes with the SDK's defaults: keys
through `api_key=` (sent as `Authorization: Bearer`), Anthropic's typed calls
(no `temperature`), retries on. Sync and async clients, streamed and not.
Each check raises with a message naming what the SDK saw; the last line of
stdout is a JSON report of every request (the id the SDK read and the usage
it parsed), which the Rust side compares with the gateway's access log.
"""

import argparse
import asyncio
import json
import sys
import time
import traceback

import anthropic
import openai

MIB = 1024 * 1024


class Attempts:
    """Counts the HTTP requests a client sends (its retries included)."""

    def __init__(self):
        self.count = 0

    def hook(self, _request):
        self.count += 1

    async def async_hook(self, _request):
        self.count += 1


class Suite:
    def __init__(self, args):
        self.gateway = args.gateway.rstrip("/")
        self.jwt = args.jwt
        self.api_key = args.api_key
        self.bad_key = args.bad_key
        self.run = args.run
        # One record per request the SDK completed: what it saw.
        self.seen = []
        self.attempts = Attempts()

    # --- clients, as an application makes them -----------------------------

    def openai(self, key, **kwargs):
        client = openai.DefaultHttpxClient(event_hooks={"request": [self.attempts.hook]})
        return openai.OpenAI(base_url=f"{self.gateway}/v1", api_key=key, http_client=client, **kwargs)

    def async_openai(self, key, **kwargs):
        client = openai.DefaultAsyncHttpxClient(
            event_hooks={"request": [self.attempts.async_hook]}, timeout=60
        )
        return openai.AsyncOpenAI(
            base_url=f"{self.gateway}/v1", api_key=key, http_client=client, **kwargs
        )

    def anthropic(self, key=None, **kwargs):
        client = anthropic.DefaultHttpxClient(event_hooks={"request": [self.attempts.hook]})
        return anthropic.Anthropic(base_url=self.gateway, api_key=key, http_client=client, **kwargs)

    def async_anthropic(self, key, **kwargs):
        client = anthropic.DefaultAsyncHttpxClient(
            event_hooks={"request": [self.attempts.async_hook]}, timeout=60
        )
        return anthropic.AsyncAnthropic(
            base_url=self.gateway, api_key=key, http_client=client, **kwargs
        )

    def prompt(self, what):
        return f"{self.run}: {what}"

    def note(self, case, request_id, usage, cache=None):
        if not request_id:
            raise AssertionError(f"{case}: the SDK read no request id (`_request_id` is None)")
        self.seen.append(
            {"case": case, "request_id": request_id, "usage": usage, "cache": cache}
        )

    # --- OpenAI -------------------------------------------------------------

    def openai_json(self, case, key):
        """A plain call, then the same again: MISS then HIT, parsed alike."""
        client = self.openai(key)
        messages = [{"role": "user", "content": self.prompt(case)}]
        first = client.chat.completions.with_raw_response.create(
            model="gpt-sdk", messages=messages, max_tokens=8
        )
        completion = first.parse()
        usage = completion.usage
        assert usage and usage.prompt_tokens > 0, f"{case}: no usage in {completion}"
        self.note(case, completion._request_id, [usage.prompt_tokens, usage.completion_tokens],
                  first.headers.get("x-cache"))
        again = client.chat.completions.with_raw_response.create(
            model="gpt-sdk", messages=messages, max_tokens=8
        )
        hit = again.parse()
        cache = again.headers.get("x-cache")
        if key == self.jwt:
            # A verified tenant's repeat is served by the gateway.
            assert cache == "HIT", f"{case}: the repeat was {cache}, not HIT"
            assert again.headers.get("x-cache-origin-request-id") == completion._request_id, (
                f"{case}: the hit names {again.headers.get('x-cache-origin-request-id')} as its "
                f"origin, not {completion._request_id}"
            )
            assert hit._request_id and hit._request_id != completion._request_id, (
                f"{case}: a hit's own request id is {hit._request_id!r}"
            )
        assert hit.choices[0].message.content == completion.choices[0].message.content, (
            f"{case}: {cache} parsed another answer"
        )
        assert hit.usage == completion.usage, f"{case}: {cache} parsed other usage"
        if cache != "HIT":
            self.note(case + " again", hit._request_id,
                      [hit.usage.prompt_tokens, hit.usage.completion_tokens], cache)

    def openai_stream(self, case, key, include_usage):
        client = self.openai(key)
        extra = {"stream_options": {"include_usage": True}} if include_usage else {}
        stream = client.chat.completions.create(
            model="gpt-sdk",
            messages=[{"role": "user", "content": self.prompt(case)}],
            max_tokens=8,
            stream=True,
            **extra,
        )
        text, usage = "", None
        for chunk in stream:
            if chunk.usage is not None:
                usage = [chunk.usage.prompt_tokens, chunk.usage.completion_tokens]
            for choice in chunk.choices:
                text += choice.delta.content or ""
        request_id = stream.response.headers.get("x-request-id")
        assert text, f"{case}: an empty stream"
        if include_usage:
            assert usage, f"{case}: asked for usage, the stream carried none"
        else:
            # The gateway asked for it on the client's behalf and took the
            # chunk out again: the client sees the stream it asked for.
            assert usage is None, f"{case}: a usage chunk the client never asked for"
        self.note(case, request_id, usage)

    def refused(self, what, error, call):
        """Calls until the gateway refuses (a credential nobody verified yet
        may be admitted once, lazy-auth's bound, until its verdict lands);
        returns the error and how many requests the refused call sent."""
        deadline = time.monotonic() + 10
        while True:
            before = self.attempts.count
            try:
                call()
            except error as err:
                return err, self.attempts.count - before
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: never refused")
            time.sleep(0.05)

    def openai_sampled(self):
        """A sampled request is not cached unless it opts in."""
        client = self.openai(self.jwt)

        def ask(case, headers):
            raw = client.chat.completions.with_raw_response.create(
                model="gpt-sdk",
                messages=[{"role": "user", "content": self.prompt(case)}],
                max_tokens=8,
                temperature=0.9,
                extra_headers=headers,
            )
            completion = raw.parse()
            cache = raw.headers.get("x-cache")
            if cache != "HIT":
                # What reached the backend is metered (a hit is not).
                self.note(case, completion._request_id,
                          [completion.usage.prompt_tokens, completion.usage.completion_tokens],
                          cache)
            return cache

        plain = [ask("sampled", {}), ask("sampled", {})]
        assert plain == ["BYPASS", "BYPASS"], f"temperature 0.9 without opting in: {plain}"
        opted = {"zerolayer-cache": "sampled"}
        cache = [ask("sampled opt-in", opted), ask("sampled opt-in", opted)]
        assert cache == ["MISS", "HIT"], f"temperature 0.9, opted in: {cache}"

    def openai_errors(self):
        # A key nobody issued: 401 in OpenAI's format, never retried.
        err, sent = self.refused(
            "bad key",
            openai.AuthenticationError,
            lambda: self.openai(self.bad_key).chat.completions.create(
                model="gpt-sdk", messages=[{"role": "user", "content": "x"}], max_tokens=8
            ),
        )
        assert err.status_code == 401, err
        assert isinstance(err.body, dict) and err.body.get("type") == "authentication_error", (
            f"bad key: body {err.body!r}"
        )
        assert err.request_id, "bad key: no request id on the 401"
        assert err.response.headers.get("x-should-retry") == "false", err.response.headers
        assert sent == 1, f"bad key: sent {sent} times"
        # No credential at all (the SDK insists on a key: its header is
        # taken off, as a misconfigured client would send).
        try:
            self.openai("unused").chat.completions.create(
                model="gpt-sdk",
                messages=[{"role": "user", "content": "x"}],
                max_tokens=8,
                extra_headers={"Authorization": openai.omit},
            )
            raise AssertionError("no credential got an answer")
        except openai.AuthenticationError as err:
            assert err.status_code == 401, err
            assert "missing credential" in err.message, err.message
        # The backend's 503: retried twice, as the SDK does, then raised.
        before = self.attempts.count
        try:
            self.openai(self.jwt).chat.completions.create(
                model="gpt-sdk",
                messages=[{"role": "user", "content": self.prompt("backend 503")}],
                max_tokens=8,
                extra_headers={"x-stub-fault": "503", "x-stub-retry-after": "0"},
            )
            raise AssertionError("a failing backend got an answer")
        except openai.APIStatusError as err:
            assert err.status_code == 503, err
        sent = self.attempts.count - before
        assert sent == 3, f"backend 503: sent {sent} times, not 3"
        # The gateway's own 504 for only-if-cached with nothing stored:
        # final, so not retried.
        before = self.attempts.count
        try:
            self.openai(self.jwt).chat.completions.create(
                model="gpt-sdk",
                messages=[{"role": "user", "content": self.prompt("never stored")}],
                max_tokens=8,
                extra_headers={"cache-control": "only-if-cached"},
            )
            raise AssertionError("only-if-cached with nothing stored got an answer")
        except openai.APIStatusError as err:
            assert err.status_code == 504, err
            assert err.response.headers.get("x-should-retry") == "false", err.response.headers
        sent = self.attempts.count - before
        assert sent == 1, f"only-if-cached: sent {sent} times"

    def openai_large(self, key):
        content = "A" * (MIB + MIB // 4)
        completion = self.openai(key).chat.completions.create(
            model="gpt-sdk", messages=[{"role": "user", "content": content}], max_tokens=8
        )
        self.note(
            "openai large body",
            completion._request_id,
            [completion.usage.prompt_tokens, completion.usage.completion_tokens],
        )

    async def openai_concurrent_streams(self, key, n):
        client = self.async_openai(key)

        async def one(i):
            stream = await client.chat.completions.create(
                model="gpt-sdk",
                messages=[{"role": "user", "content": self.prompt(f"concurrent {i}")}],
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage = None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = [chunk.usage.prompt_tokens, chunk.usage.completion_tokens]
            assert usage, f"concurrent {i}: no usage"
            return stream.response.headers.get("x-request-id"), usage

        results = await asyncio.gather(*(one(i) for i in range(n)))
        for i, (request_id, usage) in enumerate(results):
            self.note(f"openai async stream {i}", request_id, usage)
        await client.close()

    # --- Anthropic ----------------------------------------------------------

    def anthropic_json(self, case, client):
        messages = [{"role": "user", "content": self.prompt(case)}]
        first = client.messages.with_raw_response.create(
            model="claude-sdk", max_tokens=8, messages=messages
        )
        message = first.parse()
        self.note(case, message._request_id,
                  [message.usage.input_tokens, message.usage.output_tokens],
                  first.headers.get("x-cache"))
        again = client.messages.with_raw_response.create(
            model="claude-sdk", max_tokens=8, messages=messages
        )
        hit = again.parse()
        cache = again.headers.get("x-cache")
        assert hit.content == message.content, f"{case}: {cache} parsed another answer"
        assert hit.usage == message.usage, f"{case}: {cache} parsed other usage"
        assert hit._request_id, f"{case}: {cache} without a request id"
        if cache != "HIT":
            self.note(case + " again", hit._request_id,
                      [hit.usage.input_tokens, hit.usage.output_tokens], cache)
        return cache

    def anthropic_stream(self, case, client):
        with client.messages.stream(
            model="claude-sdk",
            max_tokens=8,
            messages=[{"role": "user", "content": self.prompt(case)}],
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
            request_id = stream.response.headers.get("request-id")
        assert text, f"{case}: an empty stream"
        self.note(case, request_id, [final.usage.input_tokens, final.usage.output_tokens])

    def anthropic_errors(self):
        err, sent = self.refused(
            "bad key",
            anthropic.AuthenticationError,
            lambda: self.anthropic(self.bad_key).messages.create(
                model="claude-sdk", max_tokens=8, messages=[{"role": "user", "content": "x"}]
            ),
        )
        assert err.status_code == 401, err
        assert err.body.get("type") == "error", f"bad key: body {err.body!r}"
        assert err.body["error"]["type"] == "authentication_error", err.body
        assert err.request_id, "bad key: no request id on the 401"
        assert sent == 1, f"bad key: sent {sent} times"
        before = self.attempts.count
        try:
            self.anthropic(self.jwt).messages.create(
                model="claude-sdk",
                max_tokens=8,
                messages=[{"role": "user", "content": self.prompt("backend 429")}],
                extra_headers={"x-stub-fault": "429", "x-stub-retry-after": "0"},
            )
            raise AssertionError("a rate-limited backend got an answer")
        except anthropic.RateLimitError as err:
            assert err.status_code == 429, err
        sent = self.attempts.count - before
        assert sent == 3, f"backend 429: sent {sent} times, not 3"

    def anthropic_large(self, key):
        content = "B" * (MIB + MIB // 4)
        message = self.anthropic(key).messages.create(
            model="claude-sdk", max_tokens=8, messages=[{"role": "user", "content": content}]
        )
        self.note("anthropic large body", message._request_id,
                  [message.usage.input_tokens, message.usage.output_tokens])

    async def anthropic_async(self, key):
        client = self.async_anthropic(key)
        message = await client.messages.create(
            model="claude-sdk",
            max_tokens=8,
            messages=[{"role": "user", "content": self.prompt("async json")}],
        )
        self.note("anthropic async json", message._request_id,
                  [message.usage.input_tokens, message.usage.output_tokens])
        async with client.messages.stream(
            model="claude-sdk",
            max_tokens=8,
            messages=[{"role": "user", "content": self.prompt("async stream")}],
        ) as stream:
            final = await stream.get_final_message()
            request_id = stream.response.headers.get("request-id")
        self.note("anthropic async stream", request_id,
                  [final.usage.input_tokens, final.usage.output_tokens])
        await client.close()

    # --- the suite ----------------------------------------------------------

    def all(self):
        checks = [
            ("openai json, JWT", lambda: self.openai_json("openai json jwt", self.jwt)),
            ("openai json, API key as Bearer",
             lambda: self.openai_json("openai json key", self.api_key)),
            ("openai stream", lambda: self.openai_stream("openai stream", self.jwt, False)),
            ("openai stream, include_usage",
             lambda: self.openai_stream("openai stream usage", self.api_key, True)),
            ("openai sampled, opted in or not", self.openai_sampled),
            ("openai errors", self.openai_errors),
            ("openai large body", lambda: self.openai_large(self.api_key)),
            ("openai 20 concurrent async streams",
             lambda: asyncio.run(self.openai_concurrent_streams(self.jwt, 20))),
            ("anthropic json, JWT",
             lambda: self.expect_hit(self.anthropic_json("anthropic json jwt",
                                                         self.anthropic(self.jwt)))),
            ("anthropic json, API key as Bearer",
             lambda: self.anthropic_json("anthropic json key", self.anthropic(self.api_key))),
            ("anthropic json, API key in x-api-key",
             lambda: self.anthropic_json(
                 "anthropic json x-api-key",
                 self.anthropic(None, default_headers={"x-api-key": self.api_key}))),
            ("anthropic stream", lambda: self.anthropic_stream("anthropic stream",
                                                               self.anthropic(self.jwt))),
            ("anthropic errors", self.anthropic_errors),
            ("anthropic large body", lambda: self.anthropic_large(self.api_key)),
            ("anthropic async", lambda: asyncio.run(self.anthropic_async(self.api_key))),
        ]
        failures = []
        for name, check in checks:
            try:
                check()
                print(f"ok    {name}", file=sys.stderr)
            except Exception as err:  # noqa: BLE001 - every failure is reported
                failures.append(f"{name}: {type(err).__name__}: {err}")
                print(f"FAIL  {name}: {type(err).__name__}: {err}", file=sys.stderr)
                traceback.print_exc(file=sys.stderr)
        return failures

    @staticmethod
    def expect_hit(cache):
        # Typed calls send no temperature: the shipped configuration caches them.
        assert cache == "HIT", f"the Anthropic SDK's default call was {cache} on its repeat"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", required=True)
    parser.add_argument("--jwt", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--bad-key", required=True)
    parser.add_argument("--run", required=True, help="makes every prompt of this run unique")
    args = parser.parse_args()
    print(f"openai {openai.__version__}, anthropic {anthropic.__version__}", file=sys.stderr)
    suite = Suite(args)
    failures = suite.all()
    print(json.dumps({"failures": failures, "seen": suite.seen, "attempts": suite.attempts.count}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
