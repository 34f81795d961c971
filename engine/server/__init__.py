"""The OpenAI-compatible HTTP server (``python -m engine``), over an engine core it reaches
through ``engine.process.client.EngineClient``. ``generation`` consumes one request's queue (text
deltas, stop strings, aborts on disconnect); ``routes_openai`` / ``routes_control`` are the
endpoints, ``control`` the one implementation of a live scheduler change, ``publishing`` the
telemetry wiring; ``app`` wires them into FastAPI, ``serve`` runs the app on a background thread
and ``cli`` is ``python -m engine``."""
