"""``chunkscope vllm [options] -- <vLLM args>``: start vLLM's OpenAI server with the bridge.

It runs ``python -m vllm.entrypoints.openai.api_server <vLLM args> --scheduler-cls
chunkscope.integrations.vllm.ChunkscopeScheduler`` with ``CHUNKSCOPE_COLLECTOR_URL`` (and the
engine id, tokens and spill folder) set, in place of this process, and ``--shutdown-timeout 5``
unless given (so that a SIGTERM lets the bridge send its last events and a goodbye). The
python is this one when it can import vllm, else the venv ``scripts/setup_vllm.sh`` made.
Imports no vllm itself.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

SCHEDULER_CLS = "chunkscope.integrations.vllm.ChunkscopeScheduler"
DEFAULT_COLLECTOR_URL = "ws://127.0.0.1:8765"
# vLLM's default --shutdown-timeout 0 SIGKILLs the engine core right after its SIGTERM (no code
# of the core runs: the run ends without a goodbye and unacknowledged events are lost); with N > 0
# vLLM drains in-flight requests up to N s, then tears the core down, which closes the bridge.
DEFAULT_SHUTDOWN_TIMEOUT_S = 5


def vllm_venv_python() -> Path:
    venv = os.environ.get("CHUNKSCOPE_VLLM_VENV") or str(
        Path.home() / ".cache/chunkscope/vllm-venv"
    )
    return Path(venv) / "bin" / "python"


def find_python(explicit: str | None) -> str:
    """The interpreter to run vLLM with, or ValueError saying how to get one."""
    if explicit:
        return explicit
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    candidate = vllm_venv_python()
    if candidate.exists():
        return str(candidate)
    raise ValueError(
        "vLLM is not installed for this python and there is no vLLM venv at "
        f"{candidate.parent.parent}: run scripts/setup_vllm.sh, or pass --python PATH"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="chunkscope vllm",
        description="Start vLLM's OpenAI-compatible server (python -m "
        "vllm.entrypoints.openai.api_server) with chunkscope's scheduler bridge, reporting "
        "steps, chunks and token times to a collector that can change its token budget live. "
        "Everything after -- goes to vLLM (e.g. --model M --max-num-batched-tokens 2048: "
        "start at the largest budget you want; the live budget goes from 1 up to it).",
    )
    p.add_argument(
        "--collector-url",
        default=os.environ.get("CHUNKSCOPE_COLLECTOR_URL") or DEFAULT_COLLECTOR_URL,
        help="the collector, or a comma-separated failover list of collectors (default "
        "$CHUNKSCOPE_COLLECTOR_URL, else %(default)s)",
    )
    p.add_argument("--engine-id", default=None, help="the engine id in the store")
    p.add_argument(
        "--publish-token",
        "--collector-token",
        default=None,
        help="the collector's --publish-token, sent in the hello (passed to vLLM's process as "
        "$CHUNKSCOPE_PUBLISH_TOKEN, not on its command line)",
    )
    p.add_argument(
        "--control-token", default=None, help="the steering token relayed controls are MACed with"
    )
    p.add_argument("--spill-dir", default=None, help="where unacknowledged events spill")
    p.add_argument("--python", default=None, help="the python of vLLM's environment")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then vLLM's arguments")
    return p


def _flag(args: list[str], name: str) -> str | None:
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def vllm_metrics_url(vllm_args: list[str]) -> str:
    """vLLM's ``/metrics`` URL from its ``--host`` and ``--port`` (8000 by default; the host
    name when it binds every address)."""
    import socket

    host = _flag(vllm_args, "--host") or ""
    port = _flag(vllm_args, "--port") or "8000"
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/metrics"


def build_command(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment additions; ValueError for bad arguments."""
    args = build_parser().parse_args(argv)
    rest = list(args.vllm_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if any(a == "--scheduler-cls" or a.startswith("--scheduler-cls=") for a in rest):
        raise ValueError("chunkscope vllm sets --scheduler-cls itself; leave it out")
    if not any(a == "--model" or a.startswith("--model=") for a in rest):
        raise ValueError("give vLLM a model: chunkscope vllm -- --model PATH_OR_NAME ...")
    from engine.telemetry.publisher import collector_urls

    env = {"CHUNKSCOPE_COLLECTOR_URL": ",".join(collector_urls(args.collector_url))}
    for key, value in (
        ("CHUNKSCOPE_ENGINE_ID", args.engine_id),
        ("CHUNKSCOPE_PUBLISH_TOKEN", args.publish_token),
        ("CHUNKSCOPE_CONTROL_TOKEN", args.control_token),
        ("CHUNKSCOPE_SPILL_DIR", args.spill_dir),
    ):
        if value:
            env[key] = value
    env["CHUNKSCOPE_METRICS_URL"] = vllm_metrics_url(rest)
    if not any(a == "--shutdown-timeout" or a.startswith("--shutdown-timeout=") for a in rest):
        rest += ["--shutdown-timeout", str(DEFAULT_SHUTDOWN_TIMEOUT_S)]
    python = find_python(args.python)
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *rest,
        "--scheduler-cls",
        SCHEDULER_CLS,
    ]
    return cmd, env


def main(argv: list[str] | None = None) -> int:
    try:
        cmd, env = build_command(list(sys.argv[1:] if argv is None else argv))
    except ValueError as exc:
        print(f"chunkscope vllm: {exc}", file=sys.stderr)
        return 2
    print(f"chunkscope vllm: {' '.join(cmd)} (collector {env['CHUNKSCOPE_COLLECTOR_URL']})",
          file=sys.stderr)  # fmt: skip
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, {**os.environ, **env})
    return 0  # not reached
