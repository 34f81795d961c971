"""The OpenAI-compatible HTTP server, one job per module.

``engine_loop`` runs ``engine.step()`` on its own thread and feeds per-request asyncio queues;
``generation`` consumes one request's queue (text deltas, stop strings, aborts on disconnect);
``routes_openai`` / ``routes_control`` are the endpoints; ``app`` wires them into FastAPI;
``serve`` runs the app on a background thread and ``cli`` is ``python -m engine``.
``engine.server`` re-exports the public names.
"""
