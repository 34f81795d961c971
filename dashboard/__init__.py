"""chunkscope dashboard: ``streamlit run dashboard`` (entry ``dashboard/streamlit_app.py``).

Watch an engine step by step from the telemetry store and steer its token budget through the
collector. See docs/architecture.md, section dashboard/.
"""
