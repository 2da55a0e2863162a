"""Loading and validating the RayService manifests in ``deploy/kuberay/``.

``rayservice_errors`` is everything that would stop the manifest on a real cluster before our
code runs: the CRD schema (API server), the checks KubeRay's operator makes on a RayService, and
the embedded Serve config (Ray Serve's schema, strictly, and the application's ``AppArgs``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from packaging.version import Version

from tests.deploy.kube import YAML_LOADER, CustomResourceValidator, is_dns1035_label
from tests.deploy.serve_checks import serve_config_errors

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = {
    "cpu": ROOT / "deploy" / "kuberay" / "rayservice.yaml",
    "gpu": ROOT / "deploy" / "kuberay" / "rayservice-gpu.yaml",
}
# KubeRay derives Service names from the RayService name ("<name>-serve-svc", 63 characters at
# most) and the RayCluster's from it plus a 5-character suffix.
MAX_RAYSERVICE_NAME = 47
# KubeRay refuses authOptions.mode=token for older Ray.
MIN_RAY_FOR_TOKEN_AUTH = Version("2.52.0")
# rayStartParams that size a node; KubeRay refuses them together with a group's `resources`.
_RESOURCE_START_PARAMS = ("num-cpus", "num-gpus", "memory", "resources")


CRD_ENV = "KUBERAY_CRD_PATH"
CRD_URL = (
    "https://raw.githubusercontent.com/ray-project/kuberay/v1.7.0/"
    "ray-operator/config/crd/bases/ray.io_rayservices.yaml"
)
# Why the CRD tests skip on a clone with nothing beside it, and how to run them.
CRD_MISSING = (
    f"KubeRay's RayService CRD is not here (${CRD_ENV} unset, no "
    "../shared/kuberay/ray.io_rayservices.yaml beside the checkout); to run these checks: "
    f"curl -fLo /tmp/ray.io_rayservices.yaml {CRD_URL} && "
    f"{CRD_ENV}=/tmp/ray.io_rayservices.yaml make test"
)


def crd_path() -> Path:
    """The RayService CRD: $KUBERAY_CRD_PATH, else ../shared/kuberay/ beside the checkout."""
    env = os.environ.get(CRD_ENV)
    return Path(env) if env else ROOT.parent / "shared" / "kuberay" / "ray.io_rayservices.yaml"


def crd_available() -> bool:
    """Whether the CRD tests can run. A $KUBERAY_CRD_PATH that names no file counts as
    available: :func:`load_crd_validator` then fails, since whoever set it (CI) means to run
    them."""
    return CRD_ENV in os.environ or crd_path().is_file()


def load_crd_validator() -> CustomResourceValidator:
    path = crd_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"RayService CRD not found at {path}: set {CRD_ENV} to a copy of "
            f"ray-operator/config/crd/bases/ray.io_rayservices.yaml from ray-project/kuberay "
            f"({CRD_URL})"
        )
    return CustomResourceValidator.from_file(path)


def load_manifest(variant: str) -> dict[str, Any]:
    return yaml.load(MANIFESTS[variant].read_text(), Loader=YAML_LOADER)


def serve_config(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The embedded serveConfigV2, parsed (KubeRay takes it as a YAML string)."""
    text = manifest["spec"]["serveConfigV2"]
    if not isinstance(text, str):
        raise TypeError("spec.serveConfigV2 must be a YAML string, as KubeRay expects")
    return yaml.load(text, Loader=YAML_LOADER)


def with_serve_config(manifest: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``manifest`` embedding ``config`` as its serveConfigV2."""
    out = copy.deepcopy(dict(manifest))
    out["spec"]["serveConfigV2"] = yaml.safe_dump(dict(config), sort_keys=False)
    return out


def ray_containers(manifest: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(group name, Ray container) for the head ("head") and each worker group. KubeRay treats
    the first container of a group's Pod template as the Ray container."""
    cluster = manifest["spec"]["rayClusterConfig"]
    yield "head", cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    for group in cluster.get("workerGroupSpecs", []):
        yield group["groupName"], group["template"]["spec"]["containers"][0]


def rayservice_errors(manifest: Mapping[str, Any], crd: CustomResourceValidator) -> list[str]:
    """Everything wrong with ``manifest``, one line each; empty when it would be accepted."""
    errors = crd.errors(manifest)
    if errors:
        # The remaining checks assume the schema's shape.
        return errors
    errors += kuberay_errors(manifest)
    try:
        config = serve_config(manifest)
    except (TypeError, yaml.YAMLError) as e:
        return [*errors, f"spec.serveConfigV2: {e}"]
    errors += [f"spec.serveConfigV2: {e}" for e in serve_config_errors(config)]
    return errors


def kuberay_errors(manifest: Mapping[str, Any]) -> list[str]:
    """The checks KubeRay's operator makes on a RayService beyond the CRD schema (the subset that
    applies to these manifests: see ray-operator/controllers/ray/utils/validation.go)."""
    errors: list[str] = []
    name = manifest["metadata"].get("name", "")
    if not is_dns1035_label(name) or len(name) > MAX_RAYSERVICE_NAME:
        errors.append(
            f"metadata.name: {name!r} must be a DNS-1035 label of at most "
            f"{MAX_RAYSERVICE_NAME} characters"
        )
    cluster = manifest["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    if not head["template"]["spec"].get("containers"):
        errors.append("headGroupSpec: the Pod template has no container")
        return errors
    autoscaling = cluster.get("enableInTreeAutoscaling", False)
    groups = [("head", head), *((g["groupName"], g) for g in cluster.get("workerGroupSpecs", []))]
    for group_name, group in groups:
        params = group.get("rayStartParams", {})
        if group.get("resources") and any(params.get(p) for p in _RESOURCE_START_PARAMS):
            errors.append(f"{group_name}: resources set both in rayStartParams and `resources`")
        if "labels" in params:
            errors.append(f"{group_name}: rayStartParams['labels'] is not supported")
        if group_name == "head":
            continue
        if not group["template"]["spec"].get("containers"):
            errors.append(f"worker group {group_name}: the Pod template has no container")
            continue
        low, high = group.get("minReplicas"), group.get("maxReplicas")
        if not autoscaling and (low is None or high is None):
            errors.append(f"worker group {group_name}: minReplicas and maxReplicas are required")
        if low is not None and high is not None and low > high:
            errors.append(f"worker group {group_name}: minReplicas {low} > maxReplicas {high}")
        replicas = group.get("replicas")
        if replicas is not None and not (low or 0) <= replicas <= (high or replicas):
            errors.append(f"worker group {group_name}: replicas {replicas} outside [{low}, {high}]")
    auth = cluster.get("authOptions") or {}
    if auth.get("mode") == "token":
        version = cluster.get("rayVersion")
        if not version or Version(version) < MIN_RAY_FOR_TOKEN_AUTH:
            errors.append(
                f"rayClusterConfig.rayVersion: token auth needs Ray >= {MIN_RAY_FOR_TOKEN_AUTH}"
            )
        if auth.get("enableK8sTokenAuth"):
            errors.append("authOptions.enableK8sTokenAuth is not supported for a RayService")
        for group_name, container in ray_containers(manifest):
            # KubeRay only adds RAY_AUTH_MODE/RAY_AUTH_TOKEN where absent: a value set here would
            # win over the generated token and split the cluster.
            for env in container.get("env", []):
                if env["name"] in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
                    errors.append(f"{group_name}: {env['name']} is set by KubeRay (authOptions)")
    head_ports = {p.get("name") for p in head["template"]["spec"]["containers"][0].get("ports", [])}
    if "serve" not in head_ports and not manifest["spec"].get("serveService"):
        errors.append("head container: no port named 'serve', so KubeRay makes no serve Service")
    return errors
