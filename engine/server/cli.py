"""``python -m engine``: flags, engine config from them, and the blocking server run."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import threading
import time
from typing import Any

from engine.process.client import EngineClient, EngineStartError
from engine.process.core import freeze_startup_objects
from engine.process.transport import default_core_threads
from engine.server.app import build_app
from engine.server.multimodal import DEFAULT_MAX_IMAGE_BYTES
from engine.server.serve import bind_socket, uvicorn_server
from engine.server.state import DEFAULT_LIMIT_IMAGES_PER_PROMPT, DEFAULT_MAX_BODY_BYTES
from wire import credentials
from wire.ready import engine_ready_line


def _mm_limit(text: str) -> int:
    """``--limit-mm-per-prompt '{"image": N}'`` (vLLM's form) -> N."""
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f'expected JSON such as {{"image": 4}}: {exc}') from exc
    n = value.get("image") if isinstance(value, dict) else None
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise argparse.ArgumentTypeError(f'expected {{"image": N}} with N >= 0, got {text!r}')
    return n


_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--model", {"default": "tiny", "help": "preset name (tiny, demo, llama3-8b, ...) or a "
                 "local Hugging Face model folder"}),
    ("--host", {"default": "127.0.0.1", "help": "address to listen on (0.0.0.0: all)"}),
    ("--port", {"type": int, "default": 8000, "help": "port to listen on; 0 picks a free one"}),
    ("--token-budget", {"type": int, "default": 512,
                        "help": "tokens one step may schedule (change live: PUT /v1/scheduler)"}),
    ("--max-token-budget", {"type": int, "default": 8192,
                            "help": "highest token budget a live change may set"}),
    ("--policy", {"choices": ("chunked", "unchunked"), "default": "chunked",
                  "help": "chunked splits long prompts across steps; unchunked prefills a "
                  "prompt in one step"}),
    ("--long-prefill-token-threshold", {"type": int, "default": None,
                                        "help": "most prefill tokens one request may take in a "
                                        "step while other prompts wait for budget; 0: no cap "
                                        "(default: EngineConfig's; change live: PUT "
                                        "/v1/scheduler)"}),
    ("--max-model-len", {"type": int, "default": None,
                         "help": "context length, prompt plus output (default: the model's)"}),
    ("--block-size", {"type": int, "default": 16, "help": "tokens per KV cache block"}),
    ("--max-num-seqs", {"type": int, "default": 256, "help": "most requests running at once"}),
    ("--max-waiting", {"type": int, "default": 1024,
                       "help": "most requests waiting; more get 503 with Retry-After"}),
    ("--no-prefix-caching", {"action": "store_true", "help": "turn off prefix caching"}),
    ("--device", {"choices": ("auto", "cpu", "cuda"), "default": "auto",
                  "help": "where the model runs"}),
    ("--dtype", {"choices": ("auto", "float32", "bfloat16", "float16"), "default": "auto",
                 "help": "model dtype"}),
    ("--attention-backend", {"choices": ("auto", "sdpa", "flash", "flex", "split"),
                             "default": "auto",
                             "help": "attention kernel (auto: split on CPU, flash or sdpa on "
                             "CUDA)"}),
    ("--seed", {"type": int, "default": 0, "help": "seed for synthetic weights and sampling"}),
    ("--image-token-cap", {"type": int, "default": 1280,
                           "help": "most image tokens per image (one per 28x28 pixels after "
                           "resizing)"}),
    ("--image-token-cost", {"type": float, "default": None,
                            "help": "what one image token takes from the token budget, in "
                            "tokens (default: 1 + the vision encoder's work per image token "
                            "over the language model's per token, from their sizes)"}),
    ("--engine-id", {"default": None,
                     "help": "name of this engine in metrics and events (default: HOST-PID)"}),
    ("--collector-url", {"default": None,
                         "help": "telemetry collector to stream every engine event to, e.g. "
                         "ws://127.0.0.1:8765 (/ingest is appended), or a comma-separated "
                         "failover list (the first that answers, the next when it goes away); "
                         "none: no telemetry"}),
    ("--publish-token", {"default": None,
                         "help": "the collector's --publish-token, sent in the hello; falls back "
                         "to $CHUNKSCOPE_PUBLISH_TOKEN, then $CHUNKSCOPE_AUTH_TOKEN"}),
    ("--collector-token", {"default": None, "dest": "publish_token",
                           "help": "older name of --publish-token"}),
    ("--telemetry-spill-dir", {"default": None,
                               "help": "folder for telemetry events the collector has not "
                               "acknowledged once 20,000 are held in memory (default: a "
                               "temporary folder)"}),
    ("--control-token", {"default": None,
                         "help": "the steering credential: PUT /v1/scheduler needs it as a "
                         "Bearer token and relayed controls a MAC under it; falls back to "
                         "$CHUNKSCOPE_CONTROL_TOKEN (keeps it out of ps); neither: no token"}),
    ("--api-key", {"action": "append", "default": None,
                   "help": "key the /v1 routes need as 'Authorization: Bearer KEY' (vLLM's "
                   "flag; repeat it for several keys); /health and /metrics stay open; falls "
                   "back to $CHUNKSCOPE_API_KEY"}),
    ("--allow-unauthenticated", {"action": "store_true",
                                 "help": "listen on an address other than loopback without "
                                 "--api-key (only on a network you trust; docs/security.md)"}),
    ("--max-body-bytes", {"type": int, "default": DEFAULT_MAX_BODY_BYTES,
                          "help": "largest request body accepted; larger gets 413"}),
    ("--max-image-bytes", {"type": int, "default": DEFAULT_MAX_IMAGE_BYTES,
                           "help": "largest encoded image accepted; larger gets 400"}),
    ("--limit-mm-per-prompt", {"type": _mm_limit, "default": DEFAULT_LIMIT_IMAGES_PER_PROMPT,
                               "metavar": "JSON",
                               "help": "images one request may carry, as vLLM spells it: "
                               "'{\"image\": N}'; more gets 400 before any is decoded"}),
    ("--cpu-threads", {"type": int, "default": None,
                       "help": "torch threads the engine core steps with (default: one per "
                       "usable CPU but one, which is left to the HTTP side: a step split over "
                       "every CPU waits for whichever thread the server preempts)"}),
    ("--engine-in-thread", {"action": "store_true",
                            "help": "run the engine core on a thread of the HTTP server process "
                            "instead of in its own process (by default the engine core runs "
                            "in a child process, so HTTP handling and the steps do not share "
                            "one GIL); the same core loop either way"}),
    ("--log-level", {"default": "info", "choices": ("debug", "info", "warning", "error"),
                     "help": "log level"}),
]  # fmt: skip


def build_parser(prog: str = "python -m engine") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Serve a chunked-prefill engine behind an OpenAI-compatible HTTP API "
        "(/v1/completions, /v1/chat/completions, /v1/models, /v1/scheduler, /metrics, /health). "
        "The engine core (model, scheduler, step loop) runs in a child process and the HTTP "
        "server process is a thin client of it; --engine-in-thread keeps both in one process.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for flag, kwargs in _FLAGS:
        p.add_argument(flag, **kwargs)
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-blocks", type=int, default=None, help="number of KV cache blocks")
    kv.add_argument(
        "--kv-memory-fraction",
        type=float,
        default=None,
        help="fraction of device memory for the KV cache (GPU), instead of --kv-blocks",
    )
    return p


def config_from_args(args: argparse.Namespace) -> Any:
    from engine.core.config import EngineConfig

    return EngineConfig(
        model=args.model,
        token_budget=args.token_budget,
        max_token_budget=args.max_token_budget,
        policy=args.policy,
        **(
            {}
            if args.long_prefill_token_threshold is None
            else {"long_prefill_token_threshold": args.long_prefill_token_threshold}
        ),
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_kv_blocks=args.kv_blocks,
        kv_memory_fraction=args.kv_memory_fraction,
        max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting,
        enable_prefix_caching=not args.no_prefix_caching,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        seed=args.seed,
        engine_id=args.engine_id,
        image_token_cap=args.image_token_cap,
        image_token_cost=args.image_token_cost,
        cpu_threads=args.cpu_threads,
    ).validate()


def main(argv: list[str] | None = None, prog: str = "python -m engine") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    refusal = bind_refusal(args)
    if refusal:
        print(f"chunkscope engine: {refusal}", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
        if args.collector_url:
            from engine.telemetry import collector_urls

            collector_urls(args.collector_url)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    try:
        engine = _start_engine(config, in_thread=args.engine_in_thread)
    except (OSError, ValueError, EngineStartError) as exc:
        print(f"chunkscope engine: cannot start: {exc}", file=sys.stderr)
        return 2
    try:
        return _serve(engine, args)
    finally:
        engine.shutdown()  # idempotent: the app's shutdown stops it already


def _start_engine(config: Any, *, in_thread: bool) -> EngineClient:
    if config.cpu_threads is None:  # either way the HTTP side needs a CPU of its own
        config = dataclasses.replace(config, cpu_threads=default_core_threads())
    return EngineClient.in_thread(config) if in_thread else EngineClient.spawn(config)


def _credentials(args: argparse.Namespace) -> tuple[list[str], str | None, str | None]:
    """(API keys, control token, publish token): flags over environment variables."""
    keys = [k for k in (args.api_key or [credentials.from_env(credentials.API_KEY_ENV)]) if k]
    control = args.control_token or credentials.from_env(credentials.CONTROL_ENV)
    publish = args.publish_token or credentials.from_env(credentials.PUBLISH_ENV, legacy=True)
    return keys, control, publish


def bind_refusal(args: argparse.Namespace) -> str:
    """Why this engine may not listen on ``--host`` ("" when it may)."""
    keys, _, _ = _credentials(args)
    missing = {} if keys else {"--api-key": "who may generate"}
    return credentials.bind_refusal(
        "chunkscope engine", args.host, missing, allowed=args.allow_unauthenticated
    )


SERVER_SWITCH_INTERVAL_S = 0.0005


def _serve(engine: EngineClient, args: argparse.Namespace) -> int:
    keys, control, publish = _credentials(args)
    app = build_app(
        engine,
        control_token=control,
        api_keys=keys,
        collector_url=args.collector_url,
        collector_token=publish,
        telemetry_spill_dir=args.telemetry_spill_dir,
        max_body_bytes=args.max_body_bytes,
        max_image_bytes=args.max_image_bytes,
        engine_id=args.engine_id,
        limit_images_per_prompt=args.limit_mm_per_prompt,
    )
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        print(
            f"chunkscope engine: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr
        )
        return 2
    port = int(sock.getsockname()[1])
    app.state.server.metrics_url = metrics_address(args.host, port)
    server = uvicorn_server(app, "warning" if args.log_level != "debug" else "debug")
    _announce_when_started(server, engine_ready_line(args.host, port))
    freeze_startup_objects()  # this process only serves from here on: no full-GC pauses
    # Three threads share this process's GIL: the event loop writing tokens to clients, the
    # reader of the core's step batches and the telemetry publisher encoding events. At
    # Python's default 5 ms switch interval a token could wait that long behind the encoder
    # (several steps at a few ms a step: tokens in bunches); 0.5 ms keeps the wait under a step.
    sys.setswitchinterval(SERVER_SWITCH_INTERVAL_S)
    server.run(sockets=[sock])
    return 0


def metrics_address(host: str, port: int) -> str:
    """This server's ``/metrics`` URL as another machine reaches it (the host name when bound
    to every address), for the hello: the collector lists it for Prometheus (``GET /sd``)."""
    if host in ("", "0.0.0.0", "::"):
        import socket

        host = socket.gethostname()
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/metrics"


def _announce_when_started(server: Any, line: str) -> None:
    def watch() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        if server.started:
            print(line, file=sys.stderr, flush=True)

    threading.Thread(target=watch, name="chunkscope-ready", daemon=True).start()
