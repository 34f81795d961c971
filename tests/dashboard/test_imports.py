"""The dashboard never imports torch (it starts fast and runs where torch is missing)."""

from __future__ import annotations

import subprocess
import sys


def test_dashboard_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import dashboard.charts, dashboard.control, dashboard.data, dashboard.live\n"
        "import dashboard.processes, dashboard.services, dashboard.settings, dashboard.ui\n"
        "import storage.queries, storage.db\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
