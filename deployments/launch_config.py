"""The Serve config (and RayService manifest) that the ``prefixserve`` command runs or prints.

One source of truth: the command starts from a config file (``serve_config.yaml`` by default, or
the RayService template's embedded ``serveConfigV2``), overlays what its flags set, and validates
the result with Ray Serve's ``ServeDeploySchema`` and the application's ``AppArgs``; the flags
that set application args are derived from ``AppArgs``'s own fields (see ``deployments.cli``).

Invariant: whatever :func:`build_serve_config` returns passes both validations, so
``prefixserve config`` never prints a file that ``serve run`` or KubeRay would refuse for a
reason these schemas know.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.config import AppArgs

ROOT = Path(__file__).resolve().parents[1]
# The files the command starts from; shipped in the repository (not in the wheel).
DEFAULT_SERVE_CONFIG = ROOT / "serve_config.yaml"
KUBERAY_TEMPLATE = ROOT / "deploy" / "kuberay" / "rayservice.yaml"
APP_NAME = "prefixserve"
ENGINE_DEPLOYMENT = "Engine"


class LaunchConfigError(ValueError):
    """A config the command cannot produce; ``field`` names the flag or key at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Overrides:
    """What the command line sets on top of the base config; None (or empty): left as is.

    ``args`` holds application args as nested mappings in ``AppArgs``'s shape, e.g.
    ``{"model": "/m", "engine": {"dtype": "bfloat16"}}``.
    """

    args: Mapping[str, Any] = field(default_factory=dict)
    host: str | None = None
    port: int | None = None
    replicas: int | None = None
    cpus_per_replica: float | None = None
    # Serve's logging_config.encoding for the application: "TEXT" or "JSON".
    log_encoding: str | None = None


def _read_yaml(path: Path, what: str) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except OSError as e:
        raise LaunchConfigError(what, f"cannot read {path}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise LaunchConfigError(what, f"{path} is not valid YAML: {e}") from e


def load_serve_config(path: Path | None = None) -> dict[str, Any]:
    """A Serve config file as a mapping (default: the shipped ``serve_config.yaml``)."""
    config = _read_yaml(path or DEFAULT_SERVE_CONFIG, "--config")
    if not isinstance(config, dict):
        raise LaunchConfigError("--config", f"{path} does not hold a Serve config mapping")
    return config


def load_kuberay_template() -> dict[str, Any]:
    """The shipped RayService manifest, its ``serveConfigV2`` left as the YAML string it is."""
    manifest = _read_yaml(KUBERAY_TEMPLATE, "--kuberay")
    if not isinstance(manifest, dict) or not isinstance(
        manifest.get("spec", {}).get("serveConfigV2"), str
    ):
        raise LaunchConfigError("--kuberay", f"{KUBERAY_TEMPLATE} is not a RayService manifest")
    return manifest


def embedded_serve_config(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A RayService's ``serveConfigV2`` (a YAML string) as a mapping."""
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over``'s leaves written into it (nested mappings merged, not replaced)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _application(config: dict[str, Any]) -> dict[str, Any]:
    apps = config.get("applications") or []
    if len(apps) != 1:
        raise LaunchConfigError("--config", f"expected exactly one application, found {len(apps)}")
    return apps[0]


def _engine_deployment(app: dict[str, Any]) -> dict[str, Any]:
    deployments = app.setdefault("deployments", [])
    for deployment in deployments:
        if deployment.get("name") == ENGINE_DEPLOYMENT:
            return deployment
    deployment = {"name": ENGINE_DEPLOYMENT}
    deployments.append(deployment)
    return deployment


def build_serve_config(base: Mapping[str, Any], overrides: Overrides) -> dict[str, Any]:
    """``base`` with ``overrides`` applied, validated by Ray Serve's schema and ``AppArgs``.

    ``--replicas`` fixes the Engine deployment's replica count and so drops its
    ``autoscaling_config`` (Serve refuses both together).
    """
    config = copy.deepcopy(dict(base))
    app = _application(config)
    app["args"] = _merge(app.get("args") or {}, overrides.args)
    if overrides.log_encoding is not None:
        app["logging_config"] = {
            **(app.get("logging_config") or {}),
            "encoding": overrides.log_encoding,
        }
    if overrides.host is not None or overrides.port is not None:
        http = dict(config.get("http_options") or {})
        if overrides.host is not None:
            http["host"] = overrides.host
        if overrides.port is not None:
            http["port"] = overrides.port
        config["http_options"] = http
    if overrides.replicas is not None or overrides.cpus_per_replica is not None:
        engine = _engine_deployment(app)
        if overrides.replicas is not None:
            engine.pop("autoscaling_config", None)
            engine["num_replicas"] = overrides.replicas
        if overrides.cpus_per_replica is not None:
            actor_options = dict(engine.get("ray_actor_options") or {})
            actor_options["num_cpus"] = overrides.cpus_per_replica
            engine["ray_actor_options"] = actor_options
    validate(config)
    return config


def validate(config: Mapping[str, Any]) -> AppArgs:
    """Raise ``LaunchConfigError`` naming the first bad field; return the application's args."""
    try:
        ServeDeploySchema.model_validate(config)
    except pydantic.ValidationError as e:
        raise LaunchConfigError(_where(e, prefix=""), _message(e)) from e
    app = _application(dict(config))
    try:
        return AppArgs.model_validate(app.get("args") or {})
    except pydantic.ValidationError as e:
        raise LaunchConfigError(_where(e, prefix="args."), _message(e)) from e


def _where(error: pydantic.ValidationError, prefix: str) -> str:
    loc = error.errors()[0]["loc"]
    return prefix + ".".join(str(part) for part in loc) if loc else prefix.rstrip(".") or "config"


def _message(error: pydantic.ValidationError) -> str:
    first = error.errors()[0]
    return str(first["msg"]).removeprefix("Value error, ")


class _LiteralDumper(yaml.SafeDumper):
    """Writes multi-line strings as ``|`` blocks (the embedded serveConfigV2 stays readable)."""


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_LiteralDumper.add_representer(str, _str_representer)


def dump(document: Mapping[str, Any]) -> str:
    return yaml.dump(dict(document), Dumper=_LiteralDumper, sort_keys=False)


def kuberay_manifest(
    template: Mapping[str, Any], serve_config: Mapping[str, Any], replicas: int | None
) -> dict[str, Any]:
    """``template`` (a RayService) embedding ``serve_config`` as its ``serveConfigV2``.

    The shipped manifest places one engine replica per worker Pod, so a fixed ``replicas``
    also fixes the worker group's Pod count (and the autoscaler's bounds around it). Every Ray
    container's port named ``serve`` follows the config's HTTP port (KubeRay's Service and
    probes use that port).
    """
    manifest = copy.deepcopy(dict(template))
    manifest["spec"]["serveConfigV2"] = dump(serve_config)
    port = (serve_config.get("http_options") or {}).get("port")
    cluster = manifest["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            for container_port in container.get("ports", []):
                if container_port.get("name") == "serve" and port is not None:
                    container_port["containerPort"] = port
    if replicas is not None:
        for group in manifest["spec"]["rayClusterConfig"].get("workerGroupSpecs", []):
            group["replicas"] = replicas
            group["minReplicas"] = replicas
            group["maxReplicas"] = max(replicas, group.get("maxReplicas", replicas))
    return manifest
