"""Fixtures for tests against real NIXL: a local S3 server the tests start and stop themselves.

NIXL missing is a skip on a developer's machine and a failure under ``CI=true``: the real-NIXL
tests must never be silently skipped in CI.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvfsm.nixl_agents import StoreConfig, nixl_available

ACCESS_KEY, SECRET_KEY = "kvfsm-access", "kvfsm-secret"


def require_nixl() -> None:
    """Skip (or under CI=true, fail) when the real NIXL bindings are missing."""
    if nixl_available():
        return
    if os.environ.get("CI") == "true":
        pytest.fail("NIXL is not installed, and CI must run the real-NIXL tests "
                    "(scripts/setup installs nixl-cu12==1.5.1)")
    pytest.skip("NIXL is not installed")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class S3Server:
    """A moto S3 server on 127.0.0.1, owned by the test session."""

    port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.process.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"moto_server did not listen on {self.endpoint} within 30 s")

    def freeze(self) -> None:
        """Stop the server without closing its socket: connections are accepted (by the kernel)
        and never answered, the way a hung store behaves."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def client(self) -> Any:
        import boto3  # noqa: PLC0415 - only the real-NIXL tests need it

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def new_bucket(self) -> str:
        bucket = f"kvfsm-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=bucket)
        return bucket

    def config(self, bucket: str, **options: Any) -> StoreConfig:
        return StoreConfig(bucket, endpoint=self.endpoint, access_key=ACCESS_KEY,
                           secret_key=SECRET_KEY, **options)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One S3 server for the session, started on a free port and stopped at the end."""
    require_nixl()
    server = S3Server(free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_s3_server() -> Iterator[S3Server]:
    """An S3 server of the test's own, which the test may kill."""
    require_nixl()
    server = S3Server(free_port())
    server.start()
    yield server
    server.stop()


def no_aws_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No S3 credentials anywhere the default chain looks; its files are ``tmp_path``'s
    ``credentials`` and ``config`` (not written)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE",
                 "AWS_DEFAULT_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
