"""compose.yaml and the Dockerfile agree with each other and with Settings.

No Docker engine is needed: the files are parsed and checked for what `docker compose up` depends on (start
order, health checks, ports, bucket) and every LORAPLEX_* name is checked against Settings' fields, so a
renamed or misspelled setting fails here instead of being silently ignored at run time (Settings ignores
unknown variables).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from loraplex.engine.serve.cli import engine_serve
from loraplex.platform.cli import main
from loraplex.platform.settings import ENV_PREFIX, Settings, load_settings, placeholder_secrets

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
COMPOSE_TEXT = (REPO / "compose.yaml").read_text()
COMPOSE: dict[str, Any] = yaml.safe_load(COMPOSE_TEXT)
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
DOCKERFILE = REPO / "Dockerfile"

LONG_RUNNING = ("postgres", "redis", "minio", "platform", "engine")
ONE_SHOT = ("minio-init", "migrate")
# What the wheel is built from (the same list as tests/test_packaging.py's): all of it must reach the image.
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "platform", "engine", "kernels", "migrations")
PLATFORM_PORT = 8000
ENGINE_PORT = 8100
# `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?message}`, `${VAR?message}`; `$$` is a literal `$`.
_INTERPOLATION = re.compile(r"(?<!\$)\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def settings_env_names() -> set[str]:
    """The variables Settings reads: LORAPLEX_ + the upper-cased field name."""
    return {ENV_PREFIX + name.upper() for name in Settings.model_fields}


def unknown_settings_names(names: Iterable[str]) -> set[str]:
    """The LORAPLEX_* names among `names` that no Settings field reads."""
    known = settings_env_names()
    return {name for name in names if name.startswith(ENV_PREFIX) and name not in known}


def environment(service: Mapping[str, Any]) -> dict[str, str | None]:
    """A service's environment as a mapping, from either compose form (mapping or list of NAME=value)."""
    raw = service.get("environment") or {}
    if isinstance(raw, Mapping):
        return {str(name): None if value is None else str(value) for name, value in raw.items()}
    pairs = (entry.split("=", 1) for entry in raw)
    return {pair[0]: pair[1] if len(pair) == 2 else None for pair in pairs}


def with_defaults(value: str) -> str:
    """`value` as compose interpolates it when the host sets none of its variables."""

    def substitute(match: re.Match[str]) -> str:
        op, arg = match["op"], match["arg"]
        if op in (":-", "-"):
            return arg
        if op in (":?", "?"):
            return f"required-{match['name'].lower()}"  # the user must set it; any value will do here
        return ""

    return _INTERPOLATION.sub(substitute, value).replace("$$", "$")


def service_settings(monkeypatch: pytest.MonkeyPatch, name: str) -> Settings:
    """The Settings a service's process reads: its environment as compose interpolates it without a .env, and
    nothing of the host's LORAPLEX_* variables."""
    for variable in settings_env_names():
        monkeypatch.delenv(variable, raising=False)
    for variable, value in environment(SERVICES[name]).items():
        assert value is not None, f"{name}: {variable} has no value"
        monkeypatch.setenv(variable, with_defaults(value))
    return load_settings()


def depends_on(service: Mapping[str, Any]) -> dict[str, str]:
    """Dependency -> condition; the short list form means `service_started`."""
    raw = service.get("depends_on") or {}
    if isinstance(raw, list):
        return dict.fromkeys(raw, "service_started")
    return {name: spec.get("condition", "service_started") for name, spec in raw.items()}


def published_ports(service: Mapping[str, Any]) -> set[int]:
    """Container ports a service publishes, from the short ("[ip:]host:container") or the long syntax."""
    ports: set[int] = set()
    for entry in service.get("ports") or []:
        if isinstance(entry, Mapping):
            ports.add(int(entry["target"]))
        else:
            ports.add(int(str(entry).rsplit(":", 1)[-1].split("/")[0]))
    return ports


def container_path(volume: str | Mapping[str, Any]) -> str:
    """Where a volume is mounted, from the short ("[source:]target[:mode]") or the long syntax."""
    if isinstance(volume, Mapping):
        return str(volume["target"])
    parts = with_defaults(volume).split(":")
    return parts[1] if len(parts) >= 2 else parts[0]


def command_option(service: Mapping[str, Any], option: str) -> str:
    command = service["command"]
    args = shlex.split(command) if isinstance(command, str) else [str(arg) for arg in command]
    return args[args.index(option) + 1]


def healthcheck_text(service: Mapping[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    return test if isinstance(test, str) else " ".join(test)


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, with continuation lines joined and comments dropped."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    instructions = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, args = line.strip().partition(" ")
            instructions.append((keyword.upper(), args.strip()))
    return instructions


def dockerfile_args(keyword: str) -> list[str]:
    return [args for kw, args in dockerfile_instructions() if kw == keyword]


class TestServices:
    def test_expected_services_exist(self) -> None:
        assert set(SERVICES) == {*LONG_RUNNING, *ONE_SHOT}

    @pytest.mark.parametrize("name", LONG_RUNNING)
    def test_long_running_service_has_healthcheck_and_restarts(self, name: str) -> None:
        healthcheck = SERVICES[name].get("healthcheck") or {}
        assert healthcheck.get("test"), f"{name} needs a healthcheck: others wait on service_healthy"
        assert not healthcheck.get("disable")
        assert SERVICES[name].get("restart") == "unless-stopped"

    @pytest.mark.parametrize("name", ONE_SHOT)
    def test_one_shot_service_is_not_restarted(self, name: str) -> None:
        # A restarted one-shot never reaches service_completed_successfully's "exited 0" for long.
        assert SERVICES[name].get("restart", "no") == "no"

    @pytest.mark.parametrize("name", ["platform", "engine"])
    def test_http_healthchecks_hit_healthz(self, name: str) -> None:
        assert "/healthz" in healthcheck_text(SERVICES[name])

    def test_loraplex_services_share_one_image_built_here(self) -> None:
        for name in ("migrate", "platform", "engine"):
            assert SERVICES[name]["build"] == "."
        assert len({SERVICES[name]["image"] for name in ("migrate", "platform", "engine")}) == 1


class TestPorts:
    def test_platform_publishes_its_port(self) -> None:
        platform = SERVICES["platform"]
        assert PLATFORM_PORT in published_ports(platform)
        assert environment(platform)["LORAPLEX_PORT"] == str(PLATFORM_PORT)
        assert environment(platform)["LORAPLEX_HOST"] == "0.0.0.0"
        assert f":{PLATFORM_PORT}/healthz" in healthcheck_text(platform)

    def test_engine_publishes_the_port_it_listens_on(self) -> None:
        engine = SERVICES["engine"]
        assert command_option(engine, "--port") == str(ENGINE_PORT)
        assert command_option(engine, "--host") == "0.0.0.0"
        assert ENGINE_PORT in published_ports(engine)
        assert f":{ENGINE_PORT}/healthz" in healthcheck_text(engine)

    def test_engine_model_comes_from_a_mounted_volume(self) -> None:
        engine = SERVICES["engine"]
        model = command_option(engine, "--model")
        mounts = [container_path(volume) for volume in engine["volumes"]]
        assert any(model.startswith(mount.rstrip("/") + "/") for mount in mounts), (model, mounts)

    def test_engine_port_is_published_on_loopback_only(self) -> None:
        # The platform reaches the engine on the compose network; from outside only this host may.
        for entry in SERVICES["engine"]["ports"]:
            assert isinstance(entry, str) and entry.startswith("127.0.0.1:"), entry

    def test_published_ports_reads_both_syntaxes(self) -> None:
        service = {"ports": ["127.0.0.1:9000:9000", "8080:80/tcp", {"target": 443, "published": 8443}]}
        assert published_ports(service) == {9000, 80, 443}


class TestStartOrder:
    def test_platform_waits_for_state_bucket_and_schema(self) -> None:
        assert depends_on(SERVICES["platform"]) == {
            "postgres": "service_healthy",
            "redis": "service_healthy",
            "minio-init": "service_completed_successfully",
            "migrate": "service_completed_successfully",
        }

    def test_migrate_runs_db_upgrade_after_postgres(self) -> None:
        migrate = SERVICES["migrate"]
        assert migrate["command"] == ["db", "upgrade"]
        assert depends_on(migrate) == {"postgres": "service_healthy"}
        assert (
            environment(migrate)["LORAPLEX_DATABASE_URL"] == environment(SERVICES["platform"])["LORAPLEX_DATABASE_URL"]
        )

    def test_engine_waits_for_redis_and_bucket(self) -> None:
        assert depends_on(SERVICES["engine"]) == {
            "redis": "service_healthy",
            "minio-init": "service_completed_successfully",
        }

    def test_bucket_init_waits_for_healthy_minio(self) -> None:
        assert depends_on(SERVICES["minio-init"]) == {"minio": "service_healthy"}


class TestSettingsNames:
    def test_environment_names_are_settings_fields(self) -> None:
        used = {name for service in SERVICES.values() for name in environment(service)}
        assert {name for name in used if name.startswith(ENV_PREFIX)}, "no LORAPLEX_* variable found at all"
        assert unknown_settings_names(used) == set()

    def test_interpolated_loraplex_names_are_settings_fields(self) -> None:
        # `${LORAPLEX_ADMIN_TOKEN:-...}`: what a user sets in .env must be what the docs call the setting.
        names = {match["name"] for match in _INTERPOLATION.finditer(COMPOSE_TEXT)}
        assert unknown_settings_names(names) == set()

    def test_dockerfile_env_names_are_settings_fields(self) -> None:
        names = {token.split("=", 1)[0] for args in dockerfile_args("ENV") for token in shlex.split(args)}
        assert {name for name in names if name.startswith(ENV_PREFIX)}
        # The native operators' variables are read by kernels/native.py, below the settings (the engine alone).
        native = {name for name in names if name.startswith(f"{ENV_PREFIX}NATIVE_")}
        source = (REPO / "kernels" / "native.py").read_text()
        assert native and all(f'"{name}"' in source for name in native)
        assert unknown_settings_names(names - native) == set()

    def test_a_misspelled_name_is_caught(self) -> None:
        assert unknown_settings_names(["LORAPLEX_DATABSE_URL", "LORAPLEX_DATABASE_URL", "POSTGRES_DB"]) == {
            "LORAPLEX_DATABSE_URL"
        }

    def test_the_names_come_from_settings(self) -> None:
        names = settings_env_names()
        assert {"LORAPLEX_DATABASE_URL", "LORAPLEX_S3_BUCKET", "LORAPLEX_ENGINE_MODE"} <= names
        assert len(names) == len(Settings.model_fields)


class TestSettingsValues:
    @pytest.mark.parametrize("name", ["migrate", "platform", "engine"])
    def test_environment_with_defaults_is_valid(self, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
        service_settings(monkeypatch, name)  # raises SettingsError naming the bad variable

    def test_platform_settings_select_the_shared_services(self, monkeypatch: pytest.MonkeyPatch) -> None:
        settings = service_settings(monkeypatch, "platform")
        assert settings.engine_mode == "fleet"
        assert settings.effective_database_url.startswith("postgresql+asyncpg://")
        assert settings.redis_url is not None
        assert settings.s3_endpoint_url == "http://minio:9000"
        assert settings.admin_token is not None
        assert settings.secret_key is not None

    def test_placeholder_secrets_are_refused_unless_the_profile_is_dev(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """`docker compose up` without a .env starts a platform with the placeholders: `platform serve` refuses to
        serve with them, unless LORAPLEX_PROFILE=dev says the deployment is a throwaway one."""
        settings = service_settings(monkeypatch, "platform")
        assert settings.profile == "production"
        names = {"LORAPLEX_ADMIN_TOKEN", "LORAPLEX_SECRET_KEY", "LORAPLEX_ENGINE_API_KEY"}
        assert set(placeholder_secrets(settings)) == names
        result = CliRunner().invoke(main, ["platform", "serve"])
        assert result.exit_code != 0
        assert all(name in result.output for name in names), result.output
        monkeypatch.setenv("LORAPLEX_PROFILE", "dev")
        assert load_settings().profile == "dev"

    def test_platform_and_engine_share_the_engine_api_key(self) -> None:
        platform, engine = environment(SERVICES["platform"]), environment(SERVICES["engine"])
        assert platform["LORAPLEX_ENGINE_API_KEY"] == engine["LORAPLEX_ENGINE_API_KEY"]
        (option,) = [param for param in engine_serve.params if param.name == "api_key"]
        assert option.envvar == "LORAPLEX_ENGINE_API_KEY"  # what `engine serve` reads from that environment

    def test_with_defaults(self) -> None:
        assert with_defaults("a${X:-b}c${Y-d}") == "abcd"
        assert with_defaults("${TOKEN:?set it}") == "required-token"
        assert with_defaults("$$HOME ${UNSET}") == "$HOME "


class TestBucket:
    def test_bucket_init_creates_the_platforms_bucket(self) -> None:
        script = " ".join(SERVICES["minio-init"]["command"])
        created = re.findall(r"mc mb (?:--\S+ )*\w+/([\w.-]+)", script)
        assert created, f"minio-init does not create a bucket: {script}"
        assert created == [environment(SERVICES["platform"])["LORAPLEX_S3_BUCKET"]]
        # The engine reads adapters only under the platform's tenants/ prefix of that bucket.
        assert command_option(SERVICES["engine"], "--adapter-root") == f"s3://{created[0]}/tenants/"

    def test_s3_credentials_are_minios(self) -> None:
        minio, platform = environment(SERVICES["minio"]), environment(SERVICES["platform"])
        assert platform["LORAPLEX_S3_ACCESS_KEY_ID"] == minio["MINIO_ROOT_USER"]
        assert platform["LORAPLEX_S3_SECRET_ACCESS_KEY"] == minio["MINIO_ROOT_PASSWORD"]
        assert environment(SERVICES["minio-init"]) == minio

    def test_engine_reads_adapters_from_the_platforms_s3(self) -> None:
        minio, platform = environment(SERVICES["minio"]), environment(SERVICES["platform"])
        engine = environment(SERVICES["engine"])
        assert engine["AWS_ACCESS_KEY_ID"] == minio["MINIO_ROOT_USER"]
        assert engine["AWS_SECRET_ACCESS_KEY"] == minio["MINIO_ROOT_PASSWORD"]
        assert command_option(SERVICES["engine"], "--s3-endpoint-url") == platform["LORAPLEX_S3_ENDPOINT_URL"]


class TestFleet:
    def test_engine_registers_where_the_platform_looks(self) -> None:
        platform, engine = environment(SERVICES["platform"]), SERVICES["engine"]
        assert platform["LORAPLEX_ENGINE_MODE"] == "fleet"
        assert command_option(engine, "--redis-url") == platform["LORAPLEX_REDIS_URL"]
        platform_prefix = platform.get("LORAPLEX_REDIS_PREFIX") or Settings.model_fields["redis_prefix"].default
        (option,) = [param for param in engine_serve.params if param.name == "redis_prefix"]
        engine_prefix = command_option(engine, "--redis-prefix") if "--redis-prefix" in engine["command"] else None
        assert (engine_prefix or option.default) == platform_prefix

    def test_engine_is_called_at_its_service_name_and_port(self) -> None:
        assert command_option(SERVICES["engine"], "--public-url") == f"http://engine:{ENGINE_PORT}"

    def test_platform_can_read_the_engines_model_folder(self) -> None:
        engine_mounts = {container_path(volume) for volume in SERVICES["engine"]["volumes"]}
        platform_mounts = {container_path(volume) for volume in SERVICES["platform"]["volumes"]}
        assert engine_mounts <= platform_mounts


class TestDockerfile:
    def test_entrypoint_and_default_command(self) -> None:
        assert [json.loads(args) for args in dockerfile_args("ENTRYPOINT")] == [["loraplex"]]
        assert [json.loads(args) for args in dockerfile_args("CMD")] == [["platform", "serve"]]

    def test_healthcheck_uses_python_against_healthz(self) -> None:
        (healthcheck,) = dockerfile_args("HEALTHCHECK")
        assert "python" in healthcheck
        assert "/healthz" in healthcheck

    def test_runs_as_a_non_root_user(self) -> None:
        users = dockerfile_args("USER")
        assert users
        assert users[-1] not in ("root", "0")

    def test_base_image_and_cpu_torch(self) -> None:
        assert dockerfile_args("FROM")[0].startswith("python:3.11-slim")
        assert any("download.pytorch.org/whl/cpu" in args for args in dockerfile_args("ARG"))

    def test_copies_every_build_input_and_installs_non_editable(self) -> None:
        copied = {
            source.removeprefix("./").rstrip("/")
            for args in dockerfile_args("COPY")
            for source in shlex.split(args)[:-1]
        }
        assert set(BUILD_INPUTS) <= copied
        installs = [args for args in dockerfile_args("RUN") if "pip install" in args and " ." in args]
        assert installs
        assert not any(re.search(r"(^|\s)(-e|--editable)(\s|$)", args) for args in installs)

    def test_dockerignore_keeps_local_state_out(self) -> None:
        ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
        assert {".venv", "build", ".git", ".loraplex", ".env"} <= ignored


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Each named stage's instructions (the unnamed final stage under ""), and the global ARGs under "ARG"."""
    stages: dict[str, list[tuple[str, str]]] = {"ARG": []}
    current = "ARG"
    for keyword, args in dockerfile_instructions():
        if keyword == "FROM":
            words = args.split()
            current = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            stages[current] = [(keyword, args)]
        else:
            stages[current].append((keyword, args))
    return stages


def global_args() -> dict[str, str]:
    pairs = (args.split("=", 1) for keyword, args in dockerfile_stages()["ARG"] if keyword == "ARG")
    return {name: value for name, value in pairs}


class TestImageFlavors:
    """Issue 37, point 2: one Dockerfile, a CPU and a CUDA flavor of the image; compose.gpu.yaml runs the engine on
    the second with a GPU, as deploy/k8s does. Checked offline: no Docker engine here."""

    def test_each_flavor_installs_its_torch_and_both_share_every_other_step(self) -> None:
        stages, args = dockerfile_stages(), global_args()
        assert args["TORCH_FLAVOR"] == "cpu"  # the default image is the CPU one
        assert args["CPU_TORCH_INDEX_URL"].endswith("/whl/cpu")
        assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d{3}", args["CUDA_TORCH_INDEX_URL"])
        for flavor, index in (("cpu", "CPU_TORCH_INDEX_URL"), ("cuda", "CUDA_TORCH_INDEX_URL")):
            runs = [a for k, a in stages[f"torch-{flavor}"] if k == "RUN"]
            assert any('"torch==${TORCH_VERSION}"' in run and f"${{{index}}}" in run for run in runs), runs
        assert any("import triton" in a for k, a in stages["torch-cuda"] if k == "RUN")  # Triton comes with it
        # The operators and the image are built on the flavor's torch (the libraries' names record it).
        assert stages["native"][0] == ("FROM", "torch-${TORCH_FLAVOR} AS native")
        assert stages[""][0] == ("FROM", "torch-${TORCH_FLAVOR}")
        assert not any("torch==" in a for k, a in stages[""] if k == "RUN")

    def test_the_gpu_override_changes_the_engine_alone(self) -> None:
        override = yaml.safe_load((REPO / "compose.gpu.yaml").read_text())
        assert set(override) == {"services"} and set(override["services"]) == {"engine"}
        engine = override["services"]["engine"]
        assert engine["build"]["args"]["TORCH_FLAVOR"] == "cuda" and "TORCH_FLAVOR" in global_args()
        assert f"torch-{engine['build']['args']['TORCH_FLAVOR']}" in dockerfile_stages()
        (device,) = engine["deploy"]["resources"]["reservations"]["devices"]
        assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
        # compose.yaml's engine picks its device (auto: the GPU when the image and the host have one).
        command = [str(arg) for arg in SERVICES["engine"]["command"]]
        assert "--device" not in command or command_option(SERVICES["engine"], "--device") == "auto"

    def test_kubernetes_engines_run_the_cuda_flavor(self) -> None:
        engine = yaml.safe_load((REPO / "compose.gpu.yaml").read_text())["services"]["engine"]
        manifests = [doc for doc in yaml.safe_load_all((REPO / "deploy/k8s/engine-loraplex-demo.yaml").read_text())]
        (deployment,) = [doc for doc in manifests if doc and doc["kind"] == "Deployment"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["image"] == engine["image"] == "loraplex:cuda"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
