"""Building a C kernel that ships as source: compiled at first use with the system C compiler.

The library goes into a cache folder (``~/.cache/chunkscope/kernels``, or
``$CHUNKSCOPE_KERNEL_CACHE``) under a name keyed by the source, the compiler, the flags and, for
flags that target the host (``-march=native``), the CPU's model and flags, so a cache shared by
different machines never loads code built for another CPU. It is written under a temporary name
and renamed into place, so two processes never load half a file. No torch headers, no build step
at install time; the caller loads it with ctypes.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    env = os.environ.get("CHUNKSCOPE_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "chunkscope" / "kernels"


def _host_identity() -> bytes:
    """The CPU's model name and flags (first processor of /proc/cpuinfo), or b"" elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return b""
    keep = [
        line
        for line in text.split("\n\n", 1)[0].splitlines()
        if line.startswith(("model name", "flags", "Features", "CPU part"))
    ]
    return "\n".join(keep).encode()


@functools.cache
def _cpuinfo() -> str:
    """``/proc/cpuinfo``, read once (the kernels' checks run on every step)."""
    return Path("/proc/cpuinfo").read_text()


def x86_unavailable(switch: str, features: tuple[str, ...]) -> str | None:
    """Why an x86-64 kernel needing CPU ``features`` (``/proc/cpuinfo`` flag names) cannot run
    here, or None: the ``switch`` environment variable set to 0, not x86-64 Linux, or a flag
    the CPU lacks."""
    if os.environ.get(switch, "1") == "0":
        return f"{switch}=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"not x86-64 Linux ({platform.system()} {platform.machine()})"
    try:
        flags = _cpuinfo()
    except OSError as e:
        return f"cannot read /proc/cpuinfo ({e})"
    missing = [f for f in features if f" {f}" not in flags]
    return "the CPU lacks " + ", ".join(missing) if missing else None


def cpu_vendor(cpuinfo: str | None = None) -> str | None:
    """The CPU's ``vendor_id`` (``GenuineIntel``, ``AuthenticAMD``, ...) from ``cpuinfo`` (the
    text of ``/proc/cpuinfo``, read when None), or None where there is none (not Linux x86)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        if line.startswith("vendor_id"):
            return line.partition(":")[2].strip() or None
    return None


_LOCAL_INCLUDE = re.compile(rb'^#include "([^"]+)"', re.MULTILINE)


def build(source: Path, flags: list[str], compiler: str | None = None) -> Path:
    """Compile ``source`` into a shared library (once per source, compiler, flags and host CPU)
    and return its path. Raises RuntimeError with the compiler's message when the build fails."""
    cc = compiler or os.environ.get("CC") or "cc"
    text = source.read_bytes()
    for name in _LOCAL_INCLUDE.findall(text):  # headers next to it are part of the source
        text += (source.parent / name.decode()).read_bytes()
    key = hashlib.sha256(text + " ".join([cc, *flags]).encode() + _host_identity()).hexdigest()[:16]
    folder = cache_dir()
    lib = folder / f"{source.stem}-{key}.so"
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=lib.name + ".", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        cmd = [cc, *flags, "-shared", "-fPIC", "-o", tmp, str(source), "-lm"]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"cannot run the C compiler {cc!r}: {e}") from e
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {run.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)  # atomic: another process sees no file or the whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def build_threaded(source: Path, flags: list[str], compiler: str | None = None) -> Path:
    """``build`` with OpenMP (``-fopenmp``: the library can share its work out to threads, on
    the OpenMP runtime torch has loaded), or without it where the compiler has none (the
    library then runs on the calling thread; each kernel says which through its ``*_threaded``
    function). Raises RuntimeError when neither builds."""
    try:
        return build(source, [*flags, "-fopenmp"], compiler)
    except RuntimeError as e:
        path = build(source, flags, compiler)
        logger.info("%s built without OpenMP (one thread): %s", source.name, e)
        return path
