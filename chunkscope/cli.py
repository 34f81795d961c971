"""The `chunkscope` console script: one entry point, one subcommand per process.

Subcommands import their process lazily so that `chunkscope loadgen`, `chunkscope collector` and
`chunkscope export` never import torch.
"""

from __future__ import annotations

import sys

_USAGE = """usage: chunkscope {engine,loadgen,collector,export,prune,vllm,autopilot} [options]

subcommands:
  engine    run the OpenAI-compatible chunked-prefill engine server (python -m engine)
  loadgen   replay chat / RAG / VLM / mixed traffic against an OpenAI-compatible server
            (python -m loadgen)
  collector store engines' telemetry (websockets) in SQLite / PostgreSQL and relay controls
            (python -m storage)
  export    write stored telemetry as a Chrome trace (Perfetto) or CSV / Parquet tables
            (python -m storage export)
  prune     delete old telemetry from a store, by age and/or size (python -m storage prune)
  vllm      start vLLM's OpenAI server with chunkscope's scheduler bridge reporting to a
            collector: chunkscope vllm [--collector-url URL] -- --model M [vLLM options]
  autopilot set an engine's token budget and cap live to SLOs, through a collector:
            chunkscope autopilot --collector ws://HOST:PORT --engine ID --slo-itl-ms N
            --slo-ttft-ms M [--db URL]

Run `chunkscope SUBCOMMAND --help` for the options of each.
"""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "engine":
        from engine.server.cli import main as engine_main

        return engine_main(rest)
    if command == "loadgen":
        from loadgen.cli import main as loadgen_main

        return loadgen_main(rest)
    if command == "collector":
        from storage.cli import main as storage_main

        return storage_main(rest)
    if command == "export":
        from storage.export import main as export_main

        return export_main(rest)
    if command == "prune":
        from storage.cli import run_prune

        return run_prune(rest, prog="chunkscope prune")
    if command == "vllm":
        from chunkscope.integrations.vllm_launch import main as vllm_main

        return vllm_main(rest)
    if command == "autopilot":
        from advisor.autopilot_run import main as autopilot_main

        return autopilot_main(rest)
    print(f"chunkscope: unknown subcommand {command!r}\n\n{_USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
