"""The part of kustomize that deploy/k8s uses, for tests on a machine without the kustomize binary.

`build(folder)` is what `kubectl kustomize folder` prints for a kustomization that uses only `resources` (YAML
files, and folders holding another kustomization), `components` (folders whose kustomization.yaml is a
`kind: Component` listing resources) and `namespace`. Any other field raises `KustomizeError`, so a manifest can
never lean on a feature this helper would skip, and its rules are kustomize's: resources load in the order listed,
then components; a file must lie inside the folder of the kustomization naming it; a folder may not contain the
kustomization that names it (kustomize's "cycle detected"); two objects with one kind, namespace and name are an
error; `namespace` sets every namespaced object's namespace, including what components add.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION = "kustomization.yaml"
_KINDS = {
    "Kustomization": "kustomize.config.k8s.io/v1beta1",
    "Component": "kustomize.config.k8s.io/v1alpha1",
}
_FIELDS = {
    "Kustomization": {"apiVersion", "kind", "resources", "components", "namespace"},
    "Component": {"apiVersion", "kind", "resources"},
}
# Kinds without a namespace among those a deployment may hold; every other kind (custom ones too) gets one.
CLUSTER_SCOPED = frozenset(
    {
        "Namespace",
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "PersistentVolume",
        "StorageClass",
        "PriorityClass",
        "IngressClass",
        "GatewayClass",
    }
)

Manifest = dict[str, Any]


class KustomizeError(ValueError):
    """The kustomization uses something this helper does not do, or something kustomize itself refuses."""


def build(folder: Path, *, extra_components: Sequence[str] = ()) -> list[Manifest]:
    """The objects the kustomization in `folder` yields, as kustomize would print them. `extra_components` (paths
    relative to `folder`) are added after the kustomization's own, as an overlay listing them would add them."""
    return _build(folder.resolve(), "Kustomization", tuple(extra_components), visited=())


def object_id(manifest: Manifest) -> tuple[str, str, str, str]:
    """(API group, kind, namespace, name): what kustomize keys objects by."""
    group = manifest["apiVersion"].rpartition("/")[0]
    metadata = manifest.get("metadata") or {}
    return group, manifest["kind"], metadata.get("namespace", ""), metadata["name"]


def _build(folder: Path, kind: str, extra_components: tuple[str, ...], visited: tuple[Path, ...]) -> list[Manifest]:
    for root in visited:
        if root.is_relative_to(folder):
            raise KustomizeError(f"cycle detected: {folder} contains {root}, which refers to it")
    spec = _load_kustomization(folder, kind)
    visited = (*visited, folder)
    objects: list[Manifest] = []
    for entry in spec.get("resources") or []:
        path = (folder / entry).resolve()
        if path.is_dir():
            objects += _build(path, "Kustomization", (), visited)
        elif path.is_file():
            if not path.is_relative_to(folder):
                raise KustomizeError(f"{entry}: a file outside {folder} (kustomize loads files only from below it)")
            objects += _load_manifests(path)
        else:
            raise KustomizeError(f"{folder / KUSTOMIZATION}: resource {entry} does not exist")
    for entry in [*(spec.get("components") or []), *extra_components]:
        path = (folder / entry).resolve()
        if not path.is_dir():
            raise KustomizeError(f"{folder / KUSTOMIZATION}: component {entry} is not a folder")
        objects += _build(path, "Component", (), visited)
    if "namespace" in spec:
        for manifest in objects:
            if manifest["kind"] not in CLUSTER_SCOPED:
                manifest.setdefault("metadata", {})["namespace"] = spec["namespace"]
    seen: set[tuple[str, str, str, str]] = set()
    for manifest in objects:
        key = object_id(manifest)
        if key in seen:
            raise KustomizeError(f"{folder}: two objects are {key}")
        seen.add(key)
    return objects


def _load_kustomization(folder: Path, kind: str) -> dict[str, Any]:
    path = folder / KUSTOMIZATION
    if not path.is_file():
        raise KustomizeError(f"{folder} has no {KUSTOMIZATION}")
    spec = yaml.safe_load(path.read_text()) or {}
    if spec.get("kind", "Kustomization") != kind or spec.get("apiVersion", _KINDS[kind]) != _KINDS[kind]:
        raise KustomizeError(f"{path}: expected kind {kind} ({_KINDS[kind]})")
    if unknown := set(spec) - _FIELDS[kind]:
        raise KustomizeError(f"{path}: {', '.join(sorted(unknown))} not supported by tests/_support/kustomize.py")
    return spec


def _load_manifests(path: Path) -> list[Manifest]:
    manifests = [document for document in yaml.safe_load_all(path.read_text()) if document is not None]
    for manifest in manifests:
        if not isinstance(manifest, dict) or not {"apiVersion", "kind", "metadata"} <= set(manifest):
            raise KustomizeError(f"{path}: every document needs apiVersion, kind and metadata")
    return manifests
