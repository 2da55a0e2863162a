"""The ``prefixserve`` command: the configs it prints and serves, and its errors. No Serve here:
the config it would run is checked by Ray Serve's schema, AppArgs and KubeRay's CRD instead."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from deployments import cli
from deployments.config import AppArgs, EngineArgs
from deployments.ray_env import LAPTOP_RAY_ENV, SERVE_PROCESS_ENV
from tests.deploy.kube import YAML_LOADER, CustomResourceValidator
from tests.deploy.rayservice import (
    CRD_MISSING,
    ROOT,
    crd_available,
    load_crd_validator,
    load_manifest,
    rayservice_errors,
    serve_config,
)
from tests.deploy.serve_checks import differing_keys, serve_config_errors


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it (``python -m deployments.cli`` is what the script calls)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "deployments.cli", *argv],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip


def printed_config(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert cli.main(["config", *argv]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The error line of a command line that must be refused as a usage error (exit 2)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(list(argv))
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def laptop_config() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "serve_config.yaml").read_text())


def test_pyproject_declares_the_console_script() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target = pyproject["project"]["scripts"]["prefixserve"]
    module, _, attr = target.partition(":")
    assert (module, attr) == ("deployments.cli", "main")
    assert getattr(cli, attr) is cli.main


def test_config_without_flags_is_the_shipped_config() -> None:
    out = run_cli("config")
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert printed == laptop_config()
    assert serve_config_errors(printed) == []


def test_flags_change_only_their_keys(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    printed = printed_config(
        capsys,
        str(tmp_path),
        "--host", "0.0.0.0", "--port", "9000", "--replicas", "2", "--cpus-per-replica", "0.5",
        "--dtype", "float32", "--max-model-len", "1024", "--no-enable-prefix-caching",
        "--served-model-name", "tiny", "--api-key", "k", "--routing-policy", "prefix_aware",
    )  # fmt: skip
    assert serve_config_errors(printed) == []
    changed = {"http_options.host", "http_options.port", "applications"}
    assert differing_keys(printed, laptop_config()) == changed
    (app,), (laptop_app,) = printed["applications"], laptop_config()["applications"]
    assert differing_keys(app["args"], laptop_app["args"]) == {
        "model",
        "engine.dtype",
        "engine.max_model_len",
        "engine.enable_prefix_caching",
        "served_model_name",
        "api_key",
        "routing_policy",
    }
    args = AppArgs.model_validate(app["args"])
    # A local directory is written as an absolute path: replicas have other working directories.
    assert args.model == str(tmp_path.resolve())
    assert args.engine.dtype == "float32" and args.engine.max_model_len == 1024
    assert args.engine.enable_prefix_caching is False
    assert args.model_name == "tiny" and args.resolved_api_key() == "k"
    (engine,) = app["deployments"]
    assert engine == {"name": "Engine", "num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}}


def test_every_engine_option_has_a_vllm_style_flag() -> None:
    parser = cli.build_parser()
    serve = parser.parse_args(["serve"]).subparser
    flags = {opt for action in serve._actions for opt in action.option_strings}
    for name in EngineArgs.model_fields:
        assert "--" + name.replace("_", "-") in flags, name
    # The names `vllm serve` uses for the same settings.
    for flag in ("--host", "--port", "--dtype", "--api-key", "--served-model-name", "--seed",
                 "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                 "--enable-prefix-caching", "--no-enable-prefix-caching", "--block-size",
                 "--tokenizer", "--scheduling-policy"):  # fmt: skip
        assert flag in flags, flag
    help_text = serve.format_help()
    assert "--cpus-per-replica" in help_text and "--replicas" in help_text


def test_config_file_is_the_base(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    two = ROOT / "deploy" / "local" / "two_replicas.yaml"
    base = yaml.safe_load(two.read_text())
    printed = printed_config(capsys, "--config", str(two), "--max-num-seqs", "8")
    assert differing_keys(printed, base) == {"applications"}
    assert printed["applications"][0]["args"]["engine"]["max_num_seqs"] == 8
    assert differing_keys(printed["applications"][0], base["applications"][0]) == {
        "args.engine.max_num_seqs"
    }


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--max-num-seqs", "0"], "argument --max-num-seqs: Input should be greater than 0"),
        (["--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value: 'many'"),
        (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
        (["--port", "0"], "argument --port: must be a TCP port (1-65535), got 0"),
        (["--replicas", "0"], "argument --replicas: must be greater than 0, got 0"),
        (["--cpus-per-replica", "-1"], "argument --cpus-per-replica: must be greater than 0"),
        (["--layout", "routed", "--routing-policy", "least_connections"], "routing_policy: "),
        (["--block-size", "-16"], "argument --block-size: Input should be greater than 0"),
        (["--max-nums-seqs", "8"], "unrecognized arguments: --max-nums-seqs"),
        (["a", "--model", "b"], "MODEL 'a' and --model 'b' disagree"),
        (["--config", "/nonexistent/x.yaml"], "argument --config: cannot read /nonexistent/x.yaml"),
    ],
)
def test_bad_flags_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    for command in ("config", "serve"):
        assert expected in usage_error(capsys, command, *argv)


def test_config_file_typo_names_the_key(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = laptop_config()
    config["applications"][0]["args"]["engine"]["max_num_seq"] = 8
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    err = usage_error(capsys, "config", "--config", str(path))
    assert "argument --config: args.engine.max_num_seq: Extra inputs are not permitted" in err
    # A bad value in the file is the file's, not a flag's; the flag's when the flag set it.
    config["applications"][0]["args"]["engine"] = {"max_num_seqs": 0}
    path.write_text(yaml.safe_dump(config))
    err = usage_error(capsys, "config", "--config", str(path))
    assert "argument --config: args.engine.max_num_seqs: Input should be greater than 0" in err
    err = usage_error(capsys, "config", "--config", str(path), "--max-num-seqs", "-1")
    assert "argument --max-num-seqs: Input should be greater than 0" in err


@pytest.fixture(scope="module")
def crd() -> CustomResourceValidator:
    if not crd_available():
        pytest.skip(CRD_MISSING)
    return load_crd_validator()


def test_kuberay_manifest_is_valid(crd: CustomResourceValidator) -> None:
    out = run_cli("config", "--kuberay")
    assert out.returncode == 0, out.stderr
    manifest = yaml.load(out.stdout, Loader=YAML_LOADER)
    assert rayservice_errors(manifest, crd) == []
    # Without flags: the shipped manifest's application, unchanged.
    assert serve_config(manifest) == serve_config(load_manifest("cpu"))
    assert differing_keys(manifest, load_manifest("cpu")) == {"spec.serveConfigV2"}


def test_kuberay_manifest_with_flags(
    capsys: pytest.CaptureFixture[str], crd: CustomResourceValidator
) -> None:
    argv = ["config", "--kuberay", "--replicas", "3", "--max-model-len", "1024", "--port", "9000"]
    assert cli.main(argv) == 0
    manifest = yaml.load(capsys.readouterr().out, Loader=YAML_LOADER)
    assert rayservice_errors(manifest, crd) == []
    (app,) = serve_config(manifest)["applications"]
    engine = next(d for d in app["deployments"] if d["name"] == "Engine")
    # A fixed count replaces autoscaling; one engine replica per worker Pod.
    assert engine["num_replicas"] == 3 and "autoscaling_config" not in engine
    (group,) = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == 3 <= group["maxReplicas"]
    assert app["args"]["engine"]["max_model_len"] == 1024
    # The Pods' serve port follows the Serve port.
    assert serve_config(manifest)["http_options"] == {"host": "0.0.0.0", "port": 9000}
    for spec in [manifest["spec"]["rayClusterConfig"]["headGroupSpec"], group]:
        (container,) = spec["template"]["spec"]["containers"]
        assert {p["containerPort"] for p in container["ports"] if p["name"] == "serve"} == {9000}
    assert "must listen on all interfaces" in usage_error(
        capsys, "config", "--kuberay", "--host", "127.0.0.1"
    )


def test_serve_runs_the_printed_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for key in (*SERVE_PROCESS_ENV, *cli.LAUNCH_ENV):
        monkeypatch.delenv(key, raising=False)
    argv = [str(model), "--replicas", "1", "--port", "9000"]
    seen: dict[str, Any] = {}

    def runner(path: Path, address: str) -> int:
        seen["address"] = address
        seen["config"] = yaml.safe_load(path.read_text())
        seen["env"] = {k: os.environ.get(k) for k in SERVE_PROCESS_ENV}
        return 0

    parser = cli.build_parser()
    ns = parser.parse_args(["serve", *argv])
    assert cli.serve_command(ns, ns.subparser, runner=runner) == 0
    assert seen["config"] == printed_config(capsys, *argv)
    assert seen["config"]["applications"][0]["args"]["model"] == str(model)
    assert seen["env"] == SERVE_PROCESS_ENV
    # A cluster of its own unless told otherwise, never whichever one ran last on the machine.
    assert seen["address"] == "local"
    ns = parser.parse_args(["serve", *argv, "--address", "auto"])
    assert cli.serve_command(ns, ns.subparser, runner=runner) == 0
    assert seen["address"] == "auto"


def test_serve_applies_the_laptop_env_only_to_a_cluster_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The laptop settings reach the Ray cluster `prefixserve serve` starts (the environment of
    the process that calls ray.init); joining a running cluster leaves them unset, and a value
    the user exported wins."""
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text("{}")
    parser = cli.build_parser()
    seen: dict[str, Any] = {}

    def runner(path: Path, address: str) -> int:
        seen["env"] = {k: os.environ.get(k) for k in LAPTOP_RAY_ENV}
        return 0

    def serve(*extra: str) -> dict[str, str | None]:
        for key in (*SERVE_PROCESS_ENV, *cli.LAUNCH_ENV, *LAPTOP_RAY_ENV):
            monkeypatch.delenv(key, raising=False)
        ns = parser.parse_args(["serve", str(model), "--port", "9000", *extra])
        assert cli.serve_command(ns, ns.subparser, runner=runner) == 0
        return seen["env"]

    assert serve() == LAPTOP_RAY_ENV
    assert serve("--address", "auto") == dict.fromkeys(LAPTOP_RAY_ENV)
    for key in (*SERVE_PROCESS_ENV, *cli.LAUNCH_ENV, *LAPTOP_RAY_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("REPORTER_UPDATE_INTERVAL_MS", "5000")
    ns = parser.parse_args(["serve", str(model), "--port", "9000"])
    assert cli.serve_command(ns, ns.subparser, runner=runner) == 0
    assert seen["env"] == {**LAPTOP_RAY_ENV, "REPORTER_UPDATE_INTERVAL_MS": "5000"}


def test_serve_refuses_a_missing_model_before_starting_ray() -> None:
    out = run_cli("serve", "/nonexistent/model", "--port", "9000")
    assert out.returncode == 2
    assert "argument MODEL: model: '/nonexistent/model' is neither" in out.stderr


def test_bench_fronts_the_benchmark_clients(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "serve", "--help"])
    assert exc.value.code == 0
    assert "--concurrency" in capsys.readouterr().out
    assert "invalid choice: 'nope'" in usage_error(capsys, "bench", "nope")


def test_log_flags(capsys: pytest.CaptureFixture[str]) -> None:
    printed = printed_config(
        capsys, "--log-format", "json", "--enable-log-requests", "--log-stats-interval-s", "5"
    )
    assert serve_config_errors(printed) == []
    (app,) = printed["applications"]
    # Serve's own logging_config carries the encoding; the rest are application args.
    assert app["logging_config"] == {"encoding": "JSON"}
    args = AppArgs.model_validate(app["args"])
    assert args.enable_log_requests is True and args.log_stats_interval_s == 5.0
    assert "--log-format: invalid choice: 'xml'" in usage_error(
        capsys, "config", "--log-format", "xml"
    )
    assert "argument --log-stats-interval-s: Input should be greater than 0" in usage_error(
        capsys, "config", "--log-stats-interval-s", "0"
    )
