"""A real ``redis-server`` on loopback for the fleet tests (Debian's ``redis-server`` package; ``.ci/run``
installs it). Tests that need one skip, saying why, where none can be started."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server`` process in ``directory`` on a free loopback port; :meth:`stop` and
    :meth:`start` again (same port) simulate an outage."""

    def __init__(self, directory: str, password: str | None = None):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.skip("no redis-server here: apt-get install redis-server (.ci/run does)")
        try:
            import redis  # noqa: F401 (only: is it there?)
        except ImportError:
            pytest.skip("redis-py is not installed: pip install redis (the dev extra has it)")
        self.dir, self.port, self.password = directory, _free_port(), password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self.dir, "--daemonize", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                if self.proc.poll() is not None:
                    pytest.skip(f"redis-server exited at start (code {self.proc.returncode})")
                time.sleep(0.05)
        pytest.skip("redis-server did not listen within 10 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)
