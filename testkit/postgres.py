"""A private, throwaway PostgreSQL server for the storage tests and benchmarks."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

# ---- a private PostgreSQL server --------------------------------------------------------------


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server could be started here (the message says why)."""


@dataclass
class PostgresServer:
    """A throwaway PostgreSQL server (``initdb`` + ``pg_ctl`` from Debian's packages) on
    127.0.0.1, trust authentication, data in a temporary folder; as the ``postgres`` OS user
    when running as root. ``create_database()`` returns a ``postgresql+psycopg://`` URL."""

    bindir: Path
    datadir: Path
    port: int
    as_user: str | None
    _count: int = 0
    _opts: str = ""

    @classmethod
    def start(cls, timeout: float = 60.0) -> PostgresServer:
        import shutil
        import socket
        import tempfile

        candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        if not candidates:
            found = shutil.which("initdb")
            if found is None:
                raise PostgresUnavailable(
                    "no initdb: install Debian's postgresql package (apt-get install postgresql)"
                )
            candidates = [Path(found)]
        bindir = candidates[-1].parent
        as_user = None
        if os.geteuid() == 0:
            import pwd

            try:
                pw = pwd.getpwnam("postgres")
            except KeyError as exc:
                raise PostgresUnavailable("running as root and there is no postgres user") from exc
            as_user = "postgres"
        root = Path(tempfile.mkdtemp(prefix="chunkscope-pg-"))
        datadir = root / "data"
        if as_user is not None:
            os.chown(root, pw.pw_uid, pw.pw_gid)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = cls(bindir=bindir, datadir=datadir, port=port, as_user=as_user)
        try:
            server._run(
                [
                    str(bindir / "initdb"),
                    "-D",
                    str(datadir),
                    "-A",
                    "trust",
                    "-U",
                    "postgres",
                    "--no-sync",
                    "-E",
                    "UTF8",
                ],
                timeout,
            )
            opts = (
                f"-p {port} -c listen_addresses=127.0.0.1 -k {root} -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
            )
            server._opts = opts
            server.resume(timeout)
        except PostgresUnavailable:
            shutil.rmtree(root, ignore_errors=True)
            raise
        return server

    def _run(self, cmd: list[str], timeout: float) -> None:
        if self.as_user is not None:
            cmd = ["runuser", "-u", self.as_user, "--", *cmd]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PostgresUnavailable(f"{cmd[0]} failed: {exc}") from exc
        if proc.returncode != 0:
            log = self.datadir.parent / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise PostgresUnavailable(
                f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout}{proc.stderr}{tail}"
            )

    def pause(self, timeout: float = 60.0) -> None:
        """Stop the server the way a restart does (``pg_ctl stop -m fast``: clients are
        disconnected, committed data kept); ``resume()`` starts it again on the same port."""
        self._run(
            [str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-m", "fast", "-w", "stop"],
            timeout,
        )

    def resume(self, timeout: float = 60.0) -> None:
        self._run(
            [
                str(self.bindir / "pg_ctl"),
                "-D",
                str(self.datadir),
                "-o",
                self._opts,
                "-l",
                str(self.datadir.parent / "server.log"),
                "-w",
                "-t",
                str(int(timeout)),
                "start",
            ],
            timeout + 10,
        )

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def create_database(self, name: str | None = None) -> str:
        import psycopg

        self._count += 1
        name = name or f"chunkscope_{os.getpid()}_{self._count}"
        with psycopg.connect(
            f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        import shutil

        try:
            self._run(
                [
                    str(self.bindir / "pg_ctl"),
                    "-D",
                    str(self.datadir),
                    "-m",
                    "immediate",
                    "-w",
                    "stop",
                ],
                60,
            )
        finally:
            shutil.rmtree(self.datadir.parent, ignore_errors=True)
