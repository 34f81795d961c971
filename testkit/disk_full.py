"""``python -m testkit.disk_full [collector options]``: the collector (``python -m storage``)
in a process whose disk can be made full and freed again, for the storage fault tests.

SIGUSR2 sets the process's soft ``RLIMIT_FSIZE`` to 1 byte (SIGXFSZ ignored), so from then on
every write the kernel is asked to make past the first byte of any file fails (``EFBIG``, or a
short write), the way writes fail on a file system with no free blocks: SQLite reports it as
``database or disk is full`` / a disk I/O error through its own error paths (WAL append,
checkpoint), nothing in chunkscope is patched. SIGUSR1 raises the limit back to the hard limit
("space freed"). Each change prints a line (``disk full`` / ``disk has space``) once applied.
Only regular files are limited: the pipes the ready line and the logs go to are not.
"""

from __future__ import annotations

import resource
import signal
import sys
from typing import Any


def _full(_signum: int, _frame: Any) -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1, hard))
    print("disk full", flush=True)


def _space(_signum: int, _frame: Any) -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    print("disk has space", flush=True)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
    signal.signal(signal.SIGUSR2, _full)
    signal.signal(signal.SIGUSR1, _space)
    from storage.cli import main as storage_main

    return storage_main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
