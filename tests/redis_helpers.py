"""A real ``redis-server`` on loopback for the fleet tests (Debian's ``redis-server`` package; ``.ci/run``
installs it). Tests that need one skip, saying why, where none can be started."""

from __future__ import annotations

import os
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

    def __init__(self, directory: str, password: str | None = None, tls: bool = False):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.skip("no redis-server here: apt-get install redis-server (.ci/run does)")
        try:
            import redis  # noqa: F401 (only: is it there?)
        except ImportError:
            pytest.skip("redis-py is not installed: pip install redis (the dev extra has it)")
        self.dir, self.port, self.password, self.tls = directory, _free_port(), password, tls
        self.proc: subprocess.Popen | None = None
        if tls:  # a self-signed certificate for 127.0.0.1, which the client is told to trust
            self.cert = os.path.join(directory, "cert.pem")
            key = os.path.join(directory, "key.pem")
            made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out",
                                   self.cert, "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
                                   "subjectAltName=IP:127.0.0.1"], capture_output=True) if shutil.which("openssl") else None
            if made is None or made.returncode != 0:
                pytest.skip("no openssl to make a test certificate")
            self.key = key

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.cert}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        port = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.cert, "--tls-key-file", self.key,
                "--tls-auth-clients", "no"] if self.tls else ["--port", str(self.port)]
        args = [self.binary, *port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
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
