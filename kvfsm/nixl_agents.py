"""Real NIXL agents: the only module of kvfsm that imports NIXL.

kvfsm imports and its fake agent works without NIXL installed; these factories raise
:class:`NixlUnavailable` then. They import ``nixl_cu12`` directly: the ``nixl`` meta package picks
the cu13 build on a machine without a CUDA torch, and that build's OBJ backend cannot load.
"""

from __future__ import annotations

import http.client
import math
import os
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BucketUnreachable",
    "NixlUnavailable",
    "NoCredentialsWarning",
    "StoreConfig",
    "check_bucket",
    "make_agent",
    "nixl_available",
]

# NIXL's Python logger prints INFO lines to stdout by default. The S3 client of the OBJ backend
# asks the cloud instance metadata service (169.254.169.254) for settings unless told not to;
# off a cloud instance that request only waits. Both only apply when set before NIXL loads.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


class NixlUnavailable(RuntimeError):
    """NIXL (``nixl-cu12``) is not installed or cannot load."""


class BucketUnreachable(RuntimeError):
    """The object store's endpoint or bucket cannot be reached."""


class NoCredentialsWarning(UserWarning):
    """An object store tier was made where no S3 credentials are found: unless an instance
    role answers, every transfer fails with ``NIXL_ERR_BACKEND``."""


def _api() -> Any:
    try:
        from nixl_cu12 import _api  # noqa: PLC0415 - NIXL is optional; imported on first use
    except ImportError as error:
        raise NixlUnavailable(
            "NIXL is not installed: pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1 "
            f"({error})") from error
    return _api


def nixl_available() -> bool:
    """True when the real NIXL bindings import."""
    try:
        _api()
    except NixlUnavailable:
        return False
    return True


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Where and how an object-store tier stores blocks.

    Args:
        bucket: the bucket (it must exist).
        endpoint: ``http://host:port`` of an S3-compatible server; None for AWS itself.
        access_key: with ``secret_key``; None uses the default credential chain
            (environment, profile, instance role).
        secret_key: the secret for ``access_key``.
        region: the bucket's region.
        use_virtual_addressing: ``bucket.host`` addressing instead of ``host/bucket``.
        req_checksum: NIXL's request checksum mode; "required" (PUTs of 64 MiB or more to some
            servers never complete without it) or "when_supported".
        io_threads: the OBJ backend's I/O threads; None for NIXL's default.
        key_prefix: prepended to every object name (an :class:`~kvfsm.tiers.ObjectStoreTier`
            then adds the folder of its block size).
    """

    bucket: str
    endpoint: str | None = None
    access_key: str | None = None
    secret_key: str | None = None
    region: str = "us-east-1"
    use_virtual_addressing: bool = False
    req_checksum: str = "required"
    io_threads: int | None = None
    key_prefix: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.bucket, str) or not self.bucket:
            raise ValueError(f"StoreConfig.bucket must be a non-empty str, got {self.bucket!r}")
        for field in ("endpoint", "access_key", "secret_key"):  # (a configuration file's
            value = getattr(self, field)  # values: each its type, or named)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"StoreConfig.{field} must be a str or None, got {value!r}")
        for field in ("region", "key_prefix"):
            if not isinstance(getattr(self, field), str):
                raise ValueError(f"StoreConfig.{field} must be a str, got "
                                 f"{getattr(self, field)!r}")
        if type(self.use_virtual_addressing) is not bool:  # "false" is no False
            raise ValueError(f"StoreConfig.use_virtual_addressing must be True or False, got "
                             f"{self.use_virtual_addressing!r}")
        if self.io_threads is not None and (type(self.io_threads) is not int
                                            or self.io_threads < 1):
            raise ValueError(f"StoreConfig.io_threads must be an int of at least 1 or None, "
                             f"got {self.io_threads!r}")
        if self.endpoint is not None:
            try:
                parsed = urllib.parse.urlsplit(self.endpoint)
                port = parsed.port  # (a port that is not a number, or out of range, raises)
            except ValueError as error:
                raise ValueError(f"StoreConfig.endpoint must be http(s)://host[:port], got "
                                 f"{self.endpoint!r} ({error})") from None
            if parsed.scheme not in {"http", "https"} or not parsed.hostname or port == 0:
                raise ValueError(f"StoreConfig.endpoint must be http(s)://host[:port], got "
                                 f"{self.endpoint!r}")
        if (self.access_key is None) != (self.secret_key is None):
            raise ValueError("StoreConfig: give access_key and secret_key together, or neither "
                             "(for the default credential chain)")
        if self.req_checksum not in {"required", "when_supported"}:
            raise ValueError(f"StoreConfig.req_checksum must be 'required' or 'when_supported', "
                             f"got {self.req_checksum!r}")

    @property
    def scheme(self) -> str:
        """http or https, from the endpoint (https for AWS)."""
        return urllib.parse.urlsplit(self.endpoint).scheme if self.endpoint else "https"

    def backend_params(self) -> dict[str, str]:
        """The OBJ backend's initialization parameters."""
        params = {
            "bucket": self.bucket,
            "scheme": self.scheme,
            "region": self.region,
            "use_virtual_addressing": "true" if self.use_virtual_addressing else "false",
            "req_checksum": self.req_checksum,
        }
        if self.endpoint:
            params["endpoint_override"] = self.endpoint
        if self.access_key is not None and self.secret_key is not None:
            params["access_key"] = self.access_key
            params["secret_key"] = self.secret_key
        if self.io_threads is not None:
            params["num_threads"] = str(self.io_threads)
        return params


def credentials_found(config: StoreConfig) -> bool:
    """Whether S3 credentials are to be had for ``config`` without asking a network service:
    its own keys, ``AWS_ACCESS_KEY_ID`` with ``AWS_SECRET_ACCESS_KEY``, a profile, a web
    identity or container credentials, or a credentials or config file. False leaves only an
    instance role, which AWS itself honours and a server of one's own (moto, MinIO) does not:
    without credentials NIXL's OBJ backend signs nothing, and every transfer fails with
    ``NIXL_ERR_BACKEND``, naming no cause."""
    if config.access_key and config.secret_key:
        return True
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return True
    if any(env.get(name) for name in (
            "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")):
        return True
    files = (env.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"),
             env.get("AWS_CONFIG_FILE", "~/.aws/config"))
    return any(_gives_credentials(os.path.expanduser(path)) for path in files)


#: the settings of an AWS credentials or config file that give credentials
_CREDENTIAL_SETTINGS = ("aws_access_key_id", "credential_process", "role_arn", "sso_",
                        "web_identity_token_file", "credential_source")


def _gives_credentials(path: str) -> bool:
    """Whether an AWS credentials or config file sets any of :data:`_CREDENTIAL_SETTINGS` (a
    config file with a region alone gives none)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            text = file.read(1 << 20).lower()
    except OSError:
        return False
    return any(setting in text for setting in _CREDENTIAL_SETTINGS)


#: what to do when no credentials are found: for the messages that say so
NO_CREDENTIALS = ("no S3 credentials found (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a "
                  "profile, or ~/.aws/credentials); a local server such as moto takes any, "
                  "e.g. AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test")


def check_bucket(config: StoreConfig, timeout: float = 5.0) -> None:
    """Raise :class:`BucketUnreachable` unless the endpoint answers for the bucket within
    ``timeout`` seconds in all: the name lookup, the connection and the answer together.

    An unsigned ``HEAD`` of the bucket: any answer but 404 shows the server is there and the
    bucket exists (403 only says the request was unsigned). It is made on a daemon thread of
    its own, so a name lookup that hangs or a server that answers a byte at a time does not
    hold the caller past ``timeout``; such a request is left to end there (each socket
    operation is bounded by ``timeout`` too), and no NIXL call is made on that thread.

    Raises:
        ValueError: ``timeout`` is not a finite number of seconds > 0.
    """
    if (isinstance(timeout, bool) or not isinstance(timeout, int | float)
            or not 0 < timeout < math.inf):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    endpoint = config.endpoint or f"https://s3.{config.region}.amazonaws.com"
    where = f"bucket {config.bucket!r} at {endpoint}"
    answer: list[int | BaseException] = []

    def ask() -> None:
        try:
            answer.append(_head_status(config, endpoint, timeout))
        except BaseException as error:  # handed to the caller
            answer.append(error)

    asking = threading.Thread(target=ask, name="kvfsm-check-bucket", daemon=True)
    asking.start()
    asking.join(timeout)
    if not answer:
        raise BucketUnreachable(f"cannot reach {where}: no answer within {timeout} s")
    status = answer[0]
    if isinstance(status, OSError | http.client.HTTPException):
        raise BucketUnreachable(f"cannot reach {where}: {status}") from status
    if isinstance(status, BaseException):
        raise status
    if status == 404:
        raise BucketUnreachable(f"{where} does not exist (HTTP 404)")
    if status >= 500:
        raise BucketUnreachable(f"{where} answered HTTP {status}")


def _head_status(config: StoreConfig, endpoint: str, timeout: float) -> int:
    """The HTTP status of an unsigned ``HEAD`` of the bucket (each socket operation bounded
    by ``timeout``)."""
    parsed = urllib.parse.urlsplit(endpoint)
    host = parsed.hostname or ""
    path = f"/{config.bucket}"
    if config.use_virtual_addressing:
        host, path = f"{config.bucket}.{host}", "/"
    connection_class = (http.client.HTTPSConnection if parsed.scheme == "https"
                        else http.client.HTTPConnection)
    connection = connection_class(host, parsed.port, timeout=timeout)
    try:
        connection.request("HEAD", path)
        return connection.getresponse().status
    finally:
        connection.close()


def make_agent(name: str, backend: str, params: dict[str, str] | None = None,
               io_threads: int = 0) -> Any:
    """A real ``nixl_agent`` with one backend ("OBJ", "POSIX" or "UCX"), no progress thread.

    Raises:
        ValueError: NIXL has no such backend (naming those it has), or the OBJ backend was
            given no parameters (a :class:`StoreConfig`'s ``backend_params()``).
        NixlUnavailable: NIXL is not installed.
    """
    api = _api()
    config = api.nixl_agent_config(enable_prog_thread=False, backends=[],
                                   num_threads=io_threads)
    agent = api.nixl_agent(name, config)
    plugins = agent.get_plugin_list()
    if backend not in plugins:  # (NIXL answers a bare NIXL_ERR_NOT_FOUND)
        near = [p for p in plugins if p.lower() == str(backend).lower()]
        raise ValueError(f"make_agent: NIXL has no backend {backend!r}"
                         + (f" (its names are in capitals: {near[0]!r})" if near else "")
                         + f"; it has {', '.join(plugins)}")
    try:
        agent.create_backend(backend, params or {})
    except Exception as error:
        if backend == "OBJ" and not params:  # (a bare NIXL_ERR_BACKEND otherwise)
            raise ValueError("make_agent: the OBJ backend needs the store's parameters: "
                             "make_agent(name, 'OBJ', StoreConfig(bucket, ...)."
                             f"backend_params()) ({type(error).__name__}: {error})") from None
        raise
    return agent
