"""Budget advisor: fit the step cost model from the store, replay the observed traffic through the
engine's own scheduler at other token budgets, and recommend the budget that meets the latency
SLOs with the highest throughput (``python -m advisor predict``). No torch.

The package imports nothing on its own: ``advisor.recommend`` and ``advisor.pareto`` are plain
Python (the load generator's sweep uses them); ``advisor.fit``, ``advisor.traffic`` and
``advisor.simulate`` read the store and drive ``engine.core.scheduler`` (torch-free modules).
"""

from __future__ import annotations

__all__: list[str] = []
