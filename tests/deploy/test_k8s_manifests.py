"""deploy/k8s agrees with the Kubernetes API, with Settings, with `loraplex engine serve` and with itself.

No cluster and no kustomize binary are needed: the kustomization is built by tests/_support/kustomize.py, every
core object is validated offline against Kubernetes' own schemas (kubernetes-validate, strict: an unknown field is
an error, as kubectl's field validation makes it), and the Gateway API Inference Extension's objects against schemas
written from its CRD (tests/deploy/schemas/, each says where it came from). Then what a cluster would only show at
run time: every LORAPLEX_* name is a Settings field (Settings ignores unknown variables), every engine flag is one
`loraplex engine serve` has, probes hit routes the apps serve, Services, budgets, the autoscaler and the pool select
or target objects that exist, and the engine registers where the platform looks, as compose.yaml's does.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from _support.engine_server import running_engine_server
from _support.kustomize import CLUSTER_SCOPED, KustomizeError, Manifest, build
from click.testing import CliRunner
from kubernetes_validate.utils import latest_version
from litestar import Litestar
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.core.config import EngineConfig
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.serve.cli import engine_serve
from loraplex.engine.serve.server import create_engine_app
from loraplex.platform.app import create_app
from loraplex.platform.cli import main
from loraplex.platform.settings import ENV_PREFIX, Settings, load_settings, placeholder_secrets

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
INFERENCE_POOL = "components/inference-pool"
COMPOSE: dict[str, Any] = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
# The oldest Kubernetes minor the manifests are written for, and the newest one kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.30", latest_version())
# The objects the Gateway API Inference Extension defines, with the schema each is checked against.
CRD_SCHEMAS = {("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json"}
# The plugin types the pinned EPP image (v1.0) registers (cmd/epp/runner/runner.go, registerInTreePlugins).
EPP_PLUGIN_TYPES = {
    "prefix-cache-scorer",
    "max-score-picker",
    "random-picker",
    "weighted-random-picker",
    "single-profile-handler",
    "kv-cache-utilization-scorer",
    "queue-scorer",
    "lora-affinity-scorer",
}


@dataclass(frozen=True)
class PickerMetric:
    """A metric the EPP reads from each engine's /metrics (a gauge), and the scorer that routes by it."""

    flag: str  # names the metric; an empty value switches it off
    default: str  # v1.0's name when the flag is not given
    scorer: str  # the plugin type that scores engines by it
    labels: frozenset[str] = frozenset()  # labels whose values the picker parses


# The pinned EPP's (v1.0) metric flags (cmd/epp/runner/runner.go) and their defaults (pkg/epp/server/runserver.go):
# vLLM's names of the time, so the KV-cache one is vllm:gpu_cache_usage_perc, which vLLM has since deprecated for
# vllm:kv_cache_usage_perc (the extension's default from a later release on). The LoRA labels are the model-server
# protocol's (pkg/epp/backend/metrics/metrics.go).
EPP_METRICS = (
    PickerMetric("--total-queued-requests-metric", "vllm:num_requests_waiting", "queue-scorer"),
    PickerMetric("--kv-cache-usage-percentage-metric", "vllm:gpu_cache_usage_perc", "kv-cache-utilization-scorer"),
    PickerMetric(
        "--lora-info-metric",
        "vllm:lora_requests_info",
        "lora-affinity-scorer",
        frozenset({"running_lora_adapters", "waiting_lora_adapters", "max_lora"}),
    ),
)
# Values Kubernetes gives the downward API's fields, for expanding $(NAME) in arguments.
FIELD_VALUES = {"metadata.name": "engine-loraplex-demo-7d9f-x2k4q", "status.podIP": "10.1.2.3"}
_VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@functools.cache
def _built(with_pool: bool) -> tuple[str, ...]:
    objects = build(K8S, extra_components=[INFERENCE_POOL] if with_pool else [])
    return tuple(json.dumps(manifest) for manifest in objects)


def manifests(*, with_pool: bool = False) -> list[Manifest]:
    """The kustomization's objects (with the optional InferencePool component if asked), fresh for each caller."""
    return [json.loads(text) for text in _built(with_pool)]


def everything() -> list[Manifest]:
    return manifests(with_pool=True)


def named(objects: list[Manifest], kind: str, name: str) -> Manifest:
    found = [m for m in objects if m["kind"] == kind and m["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def of_kind(objects: list[Manifest], kind: str) -> list[Manifest]:
    return [m for m in objects if m["kind"] == kind]


def pod_spec(workload: Manifest) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: Manifest) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"].get("labels") or {}


def workloads(objects: list[Manifest]) -> list[Manifest]:
    return [m for m in objects if m["kind"] in ("Deployment", "Job")]


def containers(objects: list[Manifest]) -> Iterator[tuple[Manifest, dict[str, Any]]]:
    for workload in workloads(objects):
        spec = pod_spec(workload)
        for container in [*(spec.get("initContainers") or []), *spec["containers"]]:
            yield workload, container


def container_of(objects: list[Manifest], deployment: str, name: str) -> dict[str, Any]:
    (container,) = [c for c in pod_spec(named(objects, "Deployment", deployment))["containers"] if c["name"] == name]
    return container


def engine_deployments(objects: list[Manifest]) -> list[Manifest]:
    return [m for m in of_kind(objects, "Deployment") if pod_labels(m).get("app.kubernetes.io/component") == "engine"]


def engine_container(deployment: Manifest) -> dict[str, Any]:
    (container,) = pod_spec(deployment)["containers"]
    return container


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def selected_workloads(objects: list[Manifest], selector: Mapping[str, str]) -> list[Manifest]:
    return [m for m in of_kind(objects, "Deployment") if selects(selector, pod_labels(m))]


# --- what a container's environment holds ---


def config_data(objects: list[Manifest], kind: str, name: str) -> dict[str, str]:
    """A ConfigMap's data or a Secret's keys (stringData, and data decoded), as a pod would read them."""
    source = named(objects, kind, name)
    values = dict(source.get("data") or {})
    if kind == "Secret":
        values = {key: base64.b64decode(value).decode() for key, value in values.items()}
        values |= source.get("stringData") or {}
    return values


def environment(objects: list[Manifest], container: Mapping[str, Any]) -> dict[str, str]:
    """The container's variables as Kubernetes sets them: envFrom first, env over it. A missing ConfigMap, Secret
    or key fails (none of ours is optional); the downward API's fields get FIELD_VALUES."""
    values: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        kind, ref = referenced(source, "configMapRef", "secretRef")
        data = config_data(objects, kind, ref["name"])
        values |= {source.get("prefix", "") + key: value for key, value in data.items()}
    for variable in container.get("env") or []:
        name, source = variable["name"], variable.get("valueFrom") or {}
        if "value" in variable:
            values[name] = variable["value"]
        elif "fieldRef" in source:
            values[name] = FIELD_VALUES.get(source["fieldRef"]["fieldPath"], source["fieldRef"]["fieldPath"])
        else:
            kind, ref = referenced(source, "configMapKeyRef", "secretKeyRef")
            data = config_data(objects, kind, ref["name"])
            assert ref["key"] in data, f"{name}: {kind} {ref['name']} has no key {ref['key']}"
            values[name] = data[ref["key"]]
    return values


def referenced(source: Mapping[str, Any], config_map_field: str, secret_field: str) -> tuple[str, dict[str, Any]]:
    """("ConfigMap" or "Secret", the reference) of an env or envFrom source."""
    if config_map_field in source:
        return "ConfigMap", source[config_map_field]
    return "Secret", source[secret_field]


def variable_names(objects: list[Manifest], container: Mapping[str, Any]) -> set[str]:
    return set(environment(objects, container))


def expand(args: list[str], env: Mapping[str, str]) -> list[str]:
    """`args` as Kubernetes passes them: $(NAME) replaced by the variable's value."""
    return [_VARIABLE.sub(lambda match: env[match[1]], arg) for arg in args]


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def unknown_settings_names(names: set[str]) -> set[str]:
    known = {ENV_PREFIX + field.upper() for field in Settings.model_fields}
    return {name for name in names if name.startswith(ENV_PREFIX) and name not in known}


def loraplex_names(objects: list[Manifest]) -> set[str]:
    """Every LORAPLEX_* name a pod of the deployment would see, and every ConfigMap or Secret key so named."""
    names = {name for _, container in containers(objects) for name in variable_names(objects, container)}
    for kind in ("ConfigMap", "Secret"):
        for source in of_kind(objects, kind):
            names |= set(config_data(objects, kind, source["metadata"]["name"]))
    return {name for name in names if name.startswith(ENV_PREFIX)}


def serve_help_flags() -> set[str]:
    result = CliRunner().invoke(main, ["engine", "serve", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    return set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", result.output))


def unknown_engine_flags(args: list[str]) -> set[str]:
    """The --flags of an engine container's arguments that `loraplex engine serve --help` does not list."""
    assert args[:2] == ["engine", "serve"], args
    given = {arg.split("=", 1)[0] for arg in args[2:] if arg.startswith("--")}
    return given - serve_help_flags()


def platform_settings(monkeypatch: pytest.MonkeyPatch, objects: list[Manifest]) -> Settings:
    """The Settings a platform pod reads: its environment alone, none of this machine's LORAPLEX_* variables."""
    for field in Settings.model_fields:
        monkeypatch.delenv(ENV_PREFIX + field.upper(), raising=False)
    for name, value in environment(objects, container_of(objects, "platform", "platform")).items():
        monkeypatch.setenv(name, value)
    return load_settings()


# --- the apps the probes and scrapes reach ---


@pytest.fixture(scope="module")
def engine_server() -> Iterator[EngineServer]:
    """A real engine server on the committed demo model (a few MB), on uvicorn as `engine serve` runs it."""

    apps: list[Litestar] = []

    async def make_app(engine: AsyncEngine, _: str) -> Litestar:
        apps.append(create_engine_app(engine))
        return apps[-1]

    config = EngineConfig(model=REPO / "demo" / "model", device="cpu", kv_budget=2**20, num_threads=1)
    with running_engine_server(config, make_app) as (url, _), httpx.Client(base_url=url, timeout=10) as client:
        yield EngineServer(client, frozenset(get_routes(apps[0])))


@dataclass(frozen=True)
class EngineServer:
    client: httpx.Client
    get_routes: frozenset[str]


@pytest.fixture(scope="module")
def engine_families(engine_server: EngineServer) -> dict[str, Metric]:
    """Metric family name -> family (type and samples), as the engine server exports them on /metrics."""
    response = engine_server.client.get("/metrics")
    assert response.status_code == 200
    return {family.name: family for family in text_string_to_metric_families(response.text)}


@pytest.fixture(scope="module")
def engine_metrics(engine_families: dict[str, Metric]) -> dict[str, str]:
    """Metric family name -> type, as the engine server exports them on /metrics."""
    return {name: family.type for name, family in engine_families.items()}


def get_routes(app: Litestar) -> set[str]:
    return {route.path for route in app.routes if "GET" in getattr(route, "methods", set())}


def resolve_port(container: Mapping[str, Any], port: int | str) -> int:
    """A probe's or Service's port (a number, or a container port's name) as the container's port number."""
    numbers = {p["name"]: p["containerPort"] for p in container.get("ports") or [] if "name" in p}
    if isinstance(port, str):
        assert port in numbers, f"{container['name']} has no port named {port}"
        return int(numbers[port])
    assert port in {p["containerPort"] for p in container.get("ports") or []}, port
    return port


def http_probes(container: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    kinds = ("startupProbe", "livenessProbe", "readinessProbe")
    return {kind: container[kind]["httpGet"] for kind in kinds if "httpGet" in container.get(kind, {})}


# --- tests ---


class TestSchemas:
    @pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
    def test_every_object_validates_strictly(self, version: str) -> None:
        problems = []
        for manifest in everything():
            name = f"{manifest['kind']}/{manifest['metadata']['name']}"
            try:
                validate(manifest, version)
            except (jsonschema.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
                problems.append(f"{name}: {getattr(exc, 'message', exc)} at {list(getattr(exc, 'path', []))}")
        assert problems == []

    def test_a_misspelled_field_is_refused(self) -> None:
        platform = named(everything(), "Deployment", "platform")
        container = pod_spec(platform)["containers"][0]
        container["readinesProbe"] = container.pop("readinessProbe")
        with pytest.raises(jsonschema.ValidationError, match="readinesProbe"):
            validate(platform, KUBERNETES_VERSIONS[0])

    def test_the_pool_schema_refuses_what_the_crd_refuses(self) -> None:
        pool = named(everything(), "InferencePool", "loraplex-demo")
        validate(pool, KUBERNETES_VERSIONS[0])
        old_shape = copy.deepcopy(pool)
        old_shape["spec"]["targetPortNumber"] = old_shape["spec"].pop("targetPorts")[0]["number"]  # v1alpha2's
        without_port = copy.deepcopy(pool)
        del without_port["spec"]["endpointPickerRef"]["port"]  # a Service reference needs one
        for broken in (old_shape, without_port):
            with pytest.raises(jsonschema.ValidationError):
                validate(broken, KUBERNETES_VERSIONS[0])

    def test_an_unknown_kind_is_not_waved_through(self) -> None:
        unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            validate(unknown, KUBERNETES_VERSIONS[0])

    def test_endpoint_picker_config_is_one_the_picker_reads(self) -> None:
        config = epp_config(everything())
        jsonschema.Draft202012Validator(schema("endpointpickerconfig-v1alpha1.json")).validate(config)
        assert picker_config_problems(config) == []

    def test_an_unknown_or_undeclared_plugin_is_caught(self) -> None:
        config = epp_config(everything())
        # llm-d's scheduler calls its KV scorer kv-cache-scorer; v1.0 would refuse to start with it.
        config["plugins"] = [
            plugin | {"type": "kv-cache-scorer"} if plugin["type"] == "kv-cache-utilization-scorer" else plugin
            for plugin in config["plugins"]
        ]
        config["schedulingProfiles"][0]["plugins"].append({"pluginRef": "lora-affinity-scorer-2"})
        problems = picker_config_problems(config)
        assert any("kv-cache-scorer" in problem for problem in problems), problems
        assert any("lora-affinity-scorer-2" in problem for problem in problems), problems


def picker_config_problems(config: Mapping[str, Any]) -> list[str]:
    """Why the EPP v1.0 would refuse an EndpointPickerConfig: a plugin type it does not register, two plugins of one
    name, or a profile naming a plugin the config does not declare."""
    types = [plugin["type"] for plugin in config["plugins"]]
    problems = [f"plugin type {type_} is not one v1.0 registers" for type_ in types if type_ not in EPP_PLUGIN_TYPES]
    names = [plugin.get("name", plugin["type"]) for plugin in config["plugins"]]
    problems += [f"two plugins are named {name}" for name in sorted(set(names)) if names.count(name) > 1]
    for profile in config["schedulingProfiles"]:
        for ref in profile["plugins"]:
            if ref["pluginRef"] not in names:
                problems.append(f"profile {profile['name']}: no plugin is named {ref['pluginRef']}")
    return problems


@functools.cache
def schema(file: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((SCHEMAS / file).read_text())
    return loaded


def validate(manifest: Manifest, version: str) -> None:
    """Validate one object: a CRD's against our schema of it, any other against Kubernetes' (strict)."""
    crd_schema = CRD_SCHEMAS.get((manifest["apiVersion"], manifest["kind"]))
    if crd_schema is not None:
        jsonschema.Draft202012Validator(schema(crd_schema)).validate(manifest)
    else:
        kubernetes_validate.validate(manifest, version, strict=True)


def epp_config(objects: list[Manifest]) -> dict[str, Any]:
    """The file the endpoint picker's --config-file names, read from the ConfigMap mounted where it points."""
    deployment = named(objects, "Deployment", "loraplex-demo-epp")
    container = container_of(objects, "loraplex-demo-epp", "epp")
    path = Path(option(container["args"], "--config-file"))
    (mount,) = [m for m in container["volumeMounts"] if path.is_relative_to(m["mountPath"])]
    (volume,) = [v for v in pod_spec(deployment)["volumes"] if v["name"] == mount["name"]]
    data = config_data(objects, "ConfigMap", volume["configMap"]["name"])
    key = str(path.relative_to(mount["mountPath"]))
    assert key in data, f"--config-file {path}: the ConfigMap has no {key}"
    loaded: dict[str, Any] = yaml.safe_load(data[key])
    return loaded


class TestKustomization:
    def test_the_default_deployment(self) -> None:
        kinds = {(m["kind"], m["metadata"]["name"]) for m in manifests()}
        assert {
            ("Deployment", "platform"),
            ("Service", "platform"),
            ("PodDisruptionBudget", "platform"),
            ("Job", "loraplex-migrate"),
            ("Deployment", "engine-loraplex-demo"),
            ("Service", "engine-loraplex-demo"),
            ("PodDisruptionBudget", "engine-loraplex-demo"),
            ("HorizontalPodAutoscaler", "engine-loraplex-demo"),
            ("Secret", "loraplex-secrets"),
            ("Secret", "loraplex-s3"),
        } <= kinds
        assert not of_kind(manifests(), "InferencePool"), "the InferencePool is optional: a component"

    def test_the_component_adds_the_pool_and_its_picker(self) -> None:
        def ids(objects: list[Manifest]) -> set[tuple[str, str]]:
            return {(m["kind"], m["metadata"]["name"]) for m in objects}

        added = ids(everything()) - ids(manifests())
        assert {("InferencePool", "loraplex-demo"), ("Deployment", "loraplex-demo-epp")} <= added
        assert ids(manifests()) <= ids(everything())

    def test_everything_lands_in_one_namespace(self) -> None:
        namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
        objects = everything()
        named(objects, "Namespace", namespace)
        for manifest in objects:
            if manifest["kind"] not in CLUSTER_SCOPED:
                assert manifest["metadata"]["namespace"] == namespace, manifest["metadata"]
        for binding in of_kind(objects, "RoleBinding"):
            for subject in binding["subjects"]:
                if subject["kind"] == "ServiceAccount":
                    assert subject["namespace"] == namespace, binding["metadata"]["name"]

    def test_the_helper_refuses_what_it_does_not_do(self, tmp_path: Path) -> None:
        (tmp_path / "kustomization.yaml").write_text("resources: [a.yaml]\npatches: []\n")
        (tmp_path / "a.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n")
        with pytest.raises(KustomizeError, match="patches"):
            build(tmp_path)

    def test_the_helper_refuses_what_kustomize_refuses(self, tmp_path: Path) -> None:
        overlay = tmp_path / "overlay"
        overlay.mkdir()
        (tmp_path / "kustomization.yaml").write_text("resources: [a.yaml, a.yaml]\n")
        (tmp_path / "a.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n")
        with pytest.raises(KustomizeError, match="two objects"):
            build(tmp_path)
        (overlay / "kustomization.yaml").write_text("resources: [..]\n")  # a base that contains its overlay
        with pytest.raises(KustomizeError, match="cycle"):
            build(overlay)
        (overlay / "kustomization.yaml").write_text("resources: [../a.yaml]\n")
        with pytest.raises(KustomizeError, match="outside"):
            build(overlay)


class TestSettingsNames:
    def test_every_loraplex_name_is_a_settings_field(self) -> None:
        names = loraplex_names(everything())
        assert {"LORAPLEX_DATABASE_URL", "LORAPLEX_REDIS_URL", "LORAPLEX_ENGINE_MODE"} <= names
        assert unknown_settings_names(names) == set()

    def test_a_misspelled_setting_is_caught(self) -> None:
        objects = everything()
        data = named(objects, "ConfigMap", "loraplex-config")["data"]
        data["LORAPLEX_ENGNE_MODE"] = data.pop("LORAPLEX_ENGINE_MODE")
        assert unknown_settings_names(loraplex_names(objects)) == {"LORAPLEX_ENGNE_MODE"}

    def test_pods_get_no_service_variables(self) -> None:
        # Service links would set NAME_PORT=tcp://... per Service: a Service named loraplex would set LORAPLEX_PORT.
        for workload in workloads(everything()):
            assert pod_spec(workload).get("enableServiceLinks") is False, workload["metadata"]["name"]


class TestPlatform:
    def test_settings_are_valid_and_select_the_shared_services(self, monkeypatch: pytest.MonkeyPatch) -> None:
        settings = platform_settings(monkeypatch, manifests())
        assert settings.engine_mode == "fleet"
        assert settings.effective_database_url.startswith("postgresql+asyncpg://")
        assert settings.redis_url is not None
        assert settings.s3_bucket is not None
        assert settings.s3_access_key_id is not None
        assert (settings.host, settings.port) == ("0.0.0.0", 8000)

    def test_placeholder_secrets_are_refused_in_production(self, monkeypatch: pytest.MonkeyPatch) -> None:
        settings = platform_settings(monkeypatch, manifests())
        assert settings.profile == "production"
        names = {"LORAPLEX_ADMIN_TOKEN", "LORAPLEX_SECRET_KEY", "LORAPLEX_ENGINE_API_KEY"}
        assert set(placeholder_secrets(settings)) == names
        result = CliRunner().invoke(main, ["platform", "serve"])
        assert result.exit_code != 0
        assert all(name in result.output for name in names), result.output

    def test_runs_what_compose_runs(self) -> None:
        assert container_of(manifests(), "platform", "platform")["args"] == COMPOSE["platform"]["command"]

    def test_listens_where_its_port_and_service_point(self) -> None:
        objects = manifests()
        container = container_of(objects, "platform", "platform")
        port = int(environment(objects, container)["LORAPLEX_PORT"])
        service = named(objects, "Service", "platform")
        assert [resolve_port(container, p["targetPort"]) for p in service["spec"]["ports"]] == [port]

    def test_probes_hit_routes_the_platform_serves(self) -> None:
        objects = manifests()
        container = container_of(objects, "platform", "platform")
        probes = http_probes(container)
        assert probes["readinessProbe"]["path"] == "/readyz"
        assert probes["livenessProbe"]["path"] == "/healthz"
        routes = get_routes(create_app(Settings(engine_mode="off")))
        port = int(environment(objects, container)["LORAPLEX_PORT"])
        for kind, probe in probes.items():
            assert probe["path"] in routes, f"{kind}: the platform serves no GET {probe['path']}"
            assert resolve_port(container, probe["port"]) == port

    def test_migrations_job_runs_composes_migration_on_the_platforms_database(self) -> None:
        objects = manifests()
        job = named(objects, "Job", "loraplex-migrate")
        (container,) = pod_spec(job)["containers"]
        assert container["args"] == COMPOSE["migrate"]["command"]
        assert CliRunner().invoke(main, [*container["args"], "--help"]).exit_code == 0
        assert container["image"] == container_of(objects, "platform", "platform")["image"]
        platform_env = environment(objects, container_of(objects, "platform", "platform"))
        assert environment(objects, container)["LORAPLEX_DATABASE_URL"] == platform_env["LORAPLEX_DATABASE_URL"]


class TestEngine:
    def test_every_flag_is_in_engine_serve_help(self) -> None:
        for deployment in engine_deployments(everything()):
            assert unknown_engine_flags(engine_container(deployment)["args"]) == set()

    def test_a_misspelled_flag_is_caught(self) -> None:
        (deployment,) = engine_deployments(manifests())
        args = [arg.replace("--adapter-root", "--adapter-roots") for arg in engine_container(deployment)["args"]]
        assert unknown_engine_flags(args) == {"--adapter-roots"}

    def test_arguments_parse_as_engine_serve_parses_them(self) -> None:
        objects = manifests()
        for deployment in engine_deployments(objects):
            container = engine_container(deployment)
            args = expand(container["args"], environment(objects, container))
            # The model folder is on the cluster's volume; the committed demo model stands in for it here.
            args[args.index("--model") + 1] = str(REPO / "demo" / "model")
            context = engine_serve.make_context("serve", args[2:])
            assert context.params["port"] == resolve_port(container, "http")
            assert context.params["host"] == "0.0.0.0"

    def test_every_variable_in_the_arguments_is_set(self) -> None:
        objects = everything()
        for _, container in containers(objects):
            defined = {variable["name"] for variable in container.get("env") or []}
            used = {name for arg in container.get("args") or [] for name in _VARIABLE.findall(arg)}
            assert used <= defined, f"{container['name']}: $({', '.join(sorted(used - defined))}) is never set"

    def test_registers_where_the_platform_looks(self, monkeypatch: pytest.MonkeyPatch) -> None:
        objects = manifests()
        settings = platform_settings(monkeypatch, objects)
        (prefix_option,) = [param for param in engine_serve.params if param.name == "redis_prefix"]
        for deployment in engine_deployments(objects):
            container = engine_container(deployment)
            env = environment(objects, container)
            args = expand(container["args"], env)
            assert option(args, "--redis-url") == settings.redis_url
            redis_prefix = option(args, "--redis-prefix") if "--redis-prefix" in args else prefix_option.default
            assert redis_prefix == settings.redis_prefix
            # Each pod announces its own address and id: the platform routes to one engine, not to the Service.
            assert option(args, "--public-url") == f"http://{FIELD_VALUES['status.podIP']}:{option(args, '--port')}"
            assert option(args, "--engine-id") == FIELD_VALUES["metadata.name"]
            assert settings.engine_api_key is not None
            assert env["LORAPLEX_ENGINE_API_KEY"] == settings.engine_api_key.get_secret_value()

    def test_reads_adapters_from_the_platforms_bucket(self, monkeypatch: pytest.MonkeyPatch) -> None:
        objects = manifests()
        settings = platform_settings(monkeypatch, objects)
        assert settings.s3_secret_access_key is not None
        for deployment in engine_deployments(objects):
            container = engine_container(deployment)
            env = environment(objects, container)
            args = expand(container["args"], env)
            assert option(args, "--adapter-root") == f"s3://{settings.s3_bucket}/tenants/"
            assert option(args, "--s3-endpoint-url") == settings.s3_endpoint_url
            assert env["AWS_ACCESS_KEY_ID"] == settings.s3_access_key_id
            assert env["AWS_SECRET_ACCESS_KEY"] == settings.s3_secret_access_key.get_secret_value()
            assert env["AWS_DEFAULT_REGION"] == settings.s3_region

    def test_serves_composes_demo_model_from_a_mounted_volume(self) -> None:
        (deployment,) = engine_deployments(manifests())
        container = engine_container(deployment)
        compose_args = COMPOSE["engine"]["command"]
        for name in ("--model", "--base-model-name"):
            assert option(container["args"], name) == option(compose_args, name)
        model = option(container["args"], "--model")
        assert any(Path(model).is_relative_to(m["mountPath"]) for m in container["volumeMounts"])
        assert deployment["metadata"]["labels"]["loraplex/base-model"] == option(container["args"], "--base-model-name")

    def test_requests_one_gpu(self) -> None:
        for deployment in engine_deployments(everything()):
            resources = engine_container(deployment)["resources"]
            assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1

    def test_probes_hit_routes_the_engine_serves(self, engine_server: EngineServer) -> None:
        for deployment in engine_deployments(everything()):
            container = engine_container(deployment)
            probes = http_probes(container)
            assert {"startupProbe", "livenessProbe", "readinessProbe"} <= set(probes)
            port = int(option(container["args"], "--port"))
            for kind, probe in probes.items():
                assert probe["path"] in engine_server.get_routes, f"{kind}: the engine serves no GET {probe['path']}"
                assert engine_server.client.get(probe["path"]).status_code == 200
                assert resolve_port(container, probe["port"]) == port


class TestReferences:
    def test_services_select_pods_and_ports_that_exist(self) -> None:
        objects = everything()
        for service in of_kind(objects, "Service"):
            problems = service_problems(objects, service)
            assert problems == [], problems

    def test_a_service_selecting_nothing_is_caught(self) -> None:
        objects = manifests()
        service = named(objects, "Service", "platform")
        service["spec"]["selector"]["app.kubernetes.io/component"] = "plattform"
        assert service_problems(objects, service) != []

    def test_disruption_budgets_cover_deployments(self) -> None:
        objects = everything()
        budgets = of_kind(objects, "PodDisruptionBudget")
        assert {"platform", "engine-loraplex-demo"} <= {b["metadata"]["name"] for b in budgets}
        for budget in budgets:
            selector = budget["spec"]["selector"]
            assert set(selector) == {"matchLabels"}
            assert selected_workloads(objects, selector["matchLabels"]), budget["metadata"]["name"]
        for deployment in engine_deployments(objects):
            assert any(selects(b["spec"]["selector"]["matchLabels"], pod_labels(deployment)) for b in budgets)

    def test_autoscaler_scales_engines_on_a_gauge_they_export(self, engine_metrics: dict[str, str]) -> None:
        objects = everything()
        autoscalers = of_kind(objects, "HorizontalPodAutoscaler")
        scaled = set()
        for hpa in autoscalers:
            target = hpa["spec"]["scaleTargetRef"]
            assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
            deployment = named(objects, "Deployment", target["name"])
            scaled.add(target["name"])
            assert "replicas" not in deployment["spec"], "the HPA owns the count; an applied one would reset it"
            for metric in hpa["spec"]["metrics"]:
                assert metric["type"] == "Pods"
                name = metric["pods"]["metric"]["name"]
                assert engine_metrics.get(name) == "gauge", f"the engine exports no gauge {name}"
        assert {d["metadata"]["name"] for d in engine_deployments(objects)} <= scaled

    def test_volumes_and_accounts_exist(self) -> None:
        objects = everything()
        for workload in workloads(objects):
            spec = pod_spec(workload)
            volumes = {volume["name"]: volume for volume in spec.get("volumes") or []}
            for container in spec["containers"]:
                for mount in container.get("volumeMounts") or []:
                    assert mount["name"] in volumes, f"{container['name']}: no volume {mount['name']}"
            for volume in volumes.values():
                if "persistentVolumeClaim" in volume:
                    named(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
                if "configMap" in volume:
                    named(objects, "ConfigMap", volume["configMap"]["name"])
            if "serviceAccountName" in spec:
                named(objects, "ServiceAccount", spec["serviceAccountName"])
        for binding in of_kind(objects, "RoleBinding"):
            named(objects, binding["roleRef"]["kind"], binding["roleRef"]["name"])
            for subject in binding["subjects"]:
                named(objects, subject["kind"], subject["name"])


def service_problems(objects: list[Manifest], service: Manifest) -> list[str]:
    """Why a Service would route nowhere: no Deployment's pods match its selector, or a target port is not one of
    their containers' ports."""
    name = service["metadata"]["name"]
    selected = selected_workloads(objects, service["spec"]["selector"])
    if not selected:
        return [f"Service {name} selects no pods"]
    problems = []
    for port in service["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        for workload in selected:
            ports = [p for c in pod_spec(workload)["containers"] for p in c.get("ports") or []]
            if not any(target in (p.get("name"), p["containerPort"]) for p in ports):
                problems.append(f"Service {name}: {workload['metadata']['name']} has no port {target}")
    return problems


class TestInferencePool:
    def test_selects_the_engines_on_their_port(self) -> None:
        objects = everything()
        pool = named(objects, "InferencePool", "loraplex-demo")
        selected = selected_workloads(objects, pool["spec"]["selector"]["matchLabels"])
        assert selected == [named(objects, "Deployment", "engine-loraplex-demo")]
        container = engine_container(selected[0])
        assert [p["number"] for p in pool["spec"]["targetPorts"]] == [resolve_port(container, "http")]

    def test_endpoint_picker_serves_the_pool(self) -> None:
        objects = everything()
        pool = named(objects, "InferencePool", "loraplex-demo")
        ref = pool["spec"]["endpointPickerRef"]
        service = named(objects, ref.get("kind", "Service"), ref["name"])
        assert service_problems(objects, service) == []
        assert ref["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
        (picker,) = selected_workloads(objects, service["spec"]["selector"])
        container = container_of(objects, picker["metadata"]["name"], "epp")
        env = environment(objects, container)
        args = container["args"]
        assert option(args, "--pool-name") == pool["metadata"]["name"]
        assert expand([option(args, "--pool-namespace")], env | {"NAMESPACE": pool["metadata"]["namespace"]}) == [
            pool["metadata"]["namespace"]
        ]

    def test_picker_reads_metrics_the_engines_export(self, engine_families: dict[str, Metric]) -> None:
        args = container_of(everything(), "loraplex-demo-epp", "epp")["args"]
        assert picker_metric_problems(args, engine_families) == []

    def test_a_metric_the_engines_do_not_export_is_caught(self, engine_families: dict[str, Metric]) -> None:
        args = container_of(everything(), "loraplex-demo-epp", "epp")["args"]
        kv_flag = "--kv-cache-usage-percentage-metric"
        # Without its flag the KV-cache metric is v1.0's default, vLLM's deprecated name, which the engines export
        # too; a name they do not export is caught.
        at = args.index(kv_flag)
        without_kv_flag = args[:at] + args[at + 2 :]
        assert picker_metric_problems(without_kv_flag, engine_families) == []
        wrong_kv = [*without_kv_flag, kv_flag, "vllm:gpu_cache_usage_percent"]
        assert picker_metric_problems(wrong_kv, engine_families) == [
            f"{kv_flag}: the engines export no gauge vllm:gpu_cache_usage_percent"
        ]
        misspelled = [*args, "--lora-info-metric", "vllm:lora_request_info"]
        assert picker_metric_problems(misspelled, engine_families) == [
            "--lora-info-metric: the engines export no gauge vllm:lora_request_info"
        ]
        switched_off = [*args, "--total-queued-requests-metric", ""]
        assert picker_metric_problems(switched_off, engine_families) == [
            "--total-queued-requests-metric: switched off, so queue-scorer has nothing to score by"
        ]
        # An exported gauge is not enough for the LoRA info: the picker reads the adapters from its labels.
        unlabelled = [*args, "--lora-info-metric", "vllm:num_requests_waiting"]
        assert picker_metric_problems(unlabelled, engine_families) == [
            "--lora-info-metric: vllm:num_requests_waiting has no label max_lora, running_lora_adapters, "
            "waiting_lora_adapters"
        ]

    def test_profile_scores_by_every_metric_the_engines_give(self) -> None:
        # Each scorer of the default profile counts (weight > 0), and the queue, KV-cache, LoRA and prefix scorers
        # are all there: the routing a picker configured for vLLM does.
        config = epp_config(everything())
        types = {plugin.get("name", plugin["type"]): plugin["type"] for plugin in config["plugins"]}
        (profile,) = [p for p in config["schedulingProfiles"] if p["name"] == "default"]
        scorers = {types[ref["pluginRef"]]: ref.get("weight", 1) for ref in profile["plugins"]}
        assert {metric.scorer for metric in EPP_METRICS} | {"prefix-cache-scorer"} <= set(scorers)
        assert all(scorers[name] > 0 for name in scorers if name.endswith("-scorer")), scorers


def picker_metric_problems(args: list[str], families: Mapping[str, Metric]) -> list[str]:
    """What the EPP, run with these arguments, would fail to read from an engine exporting `families`: a metric
    switched off (its scorer would see every engine alike), a name that is not an exported gauge, or labels it parses
    that the series lack. A flag given twice counts as its last value, as Go's flag package reads it."""
    problems = []
    for metric in EPP_METRICS:
        given = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == metric.flag]
        name = given[-1] if given else metric.default
        family = families.get(name)
        if not name:
            problems.append(f"{metric.flag}: switched off, so {metric.scorer} has nothing to score by")
        elif family is None or family.type != "gauge":
            problems.append(f"{metric.flag}: the engines export no gauge {name}")
        else:
            missing = metric.labels - {label for sample in family.samples for label in sample.labels}
            if missing:
                problems.append(f"{metric.flag}: {name} has no label {', '.join(sorted(missing))}")
    return problems
