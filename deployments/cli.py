"""``prefixserve``: serve a model, print the equivalent config, or run a benchmark client.

    prefixserve serve [MODEL] [--host H] [--port P] [--replicas N] [--dtype D] ...
    prefixserve config [flags] [--kuberay]
    prefixserve bench serve --base-url http://127.0.0.1:8000 ...

A thin layer: the flags that set application args are derived from ``AppArgs``'s fields (one
flag per engine option and per top-level scalar), named as ``vllm serve`` names the same thing
(``--max-model-len``, ``--enable-prefix-caching``, ``--served-model-name``); building and
validating the config is ``deployments.launch_config``'s, starting Serve is ``serve run``'s.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from deployments.config import AppArgs, EngineArgs
from deployments.launch_config import (
    LaunchConfigError,
    Overrides,
    build_serve_config,
    dump,
    embedded_serve_config,
    kuberay_manifest,
    load_kuberay_template,
    load_serve_config,
)

# Top-level AppArgs fields with a flag of their own (nested sections other than the engine's are
# set through --config).
APP_FLAGS = (
    "served_model_name",
    "tokenizer",
    "layout",
    "routing_policy",
    "api_key",
    "report_cache_hits",
    "stream_interval_ms",
    "stream_items_per_s",
    "batch_wait_ms",
    "batch_wait_max_ms",
    "handle_transport",
    "pin_engine_cpus",
    "engine_stall_timeout_s",
    "enable_log_requests",
    "log_stats_interval_s",
    "otlp_traces_endpoint",
)
HELP = {
    "model": "model name (built-in), Hugging Face directory or .gguf file",
    "dtype": "weights and KV cache dtype; auto: bfloat16 where the CPU has native bf16",
    "device": "where the engine runs",
    "block_size": "tokens per KV cache block",
    "num_kv_blocks": "KV cache blocks per replica (overrides --kv-cache-memory-gb)",
    "kv_cache_memory_gb": "KV cache size per replica in GB",
    "max_num_seqs": "most sequences in one engine step",
    "max_num_batched_tokens": "most tokens in one engine step",
    "max_model_len": "longest prompt plus output (default: the model's)",
    "enable_prefix_caching": "reuse the KV of shared prompt prefixes",
    "scheduling_policy": "order of waiting requests",
    "watermark": "fraction of KV blocks kept free when admitting requests",
    "attention_backend": "attention implementation",
    "num_threads": "torch threads per replica (default: the replica's CPUs)",
    "seed": "seed of sampling without a per-request seed",
    "served_model_name": "the name clients send as `model` (default: MODEL)",
    "tokenizer": "tokenizer directory (default: the model's)",
    "layout": "direct: replicas serve HTTP; routed: an ingress routes prompts by prefix",
    "routing_policy": "how requests are spread over engine replicas",
    "api_key": "bearer token required on every route but /ping (also $PREFIXSERVE_API_KEY)",
    "report_cache_hits": "report cached_tokens and x-engine-replica to clients",
    "stream_interval_ms": "tokens made within this window go out as one stream item",
    "stream_items_per_s": "cap on stream items per second per replica",
    "batch_wait_ms": "an idle replica waits this long after each request for more of a burst",
    "batch_wait_max_ms": "the longest such wait in total",
    "handle_transport": "how the ingress reaches engine replicas",
    "pin_engine_cpus": "pin each replica's compute thread to CPUs of its own",
    "engine_stall_timeout_s": "seconds one engine step may take before the replica is replaced",
    "enable_log_requests": "log each request (with its response id and x-request-id)",
    "log_stats_interval_s": "seconds between an engine replica's stats lines",
    "otlp_traces_endpoint": "OTLP endpoint for OpenTelemetry traces of requests, e.g. "
    "http://127.0.0.1:4318/v1/traces (needs the tracing extra; default: off)",
}
# `prefixserve bench NAME ...` runs benchmarks.<module>.main(argv).
BENCHMARKS = {
    "serve": ("serve", "streaming load against a running OpenAI-compatible server"),
    "throughput": ("offline", "offline engine throughput vs transformers"),
    "compare-serving": ("compare_serving", "ours vs `vllm serve`, vLLM's serving client"),
    "compare-vllm": ("compare_vllm", "offline engine vs vLLM CPU"),
    "compare-routing": ("compare_routing", "routing policies on a live 2-replica service"),
    "simulate": ("simulate", "replay a trace against simulated replicas"),
    "kv-import": ("kv_import", "TTFT with imported vs recomputed prefix KV"),
    "overload": ("overload", "one stream beside the widest admissible request"),
}
# What `make serve` exports besides deployments.ray_env.SERVE_PROCESS_ENV (see the Makefile).
LAUNCH_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(annotation: Any) -> Any:
    """``T`` of ``T | None`` (bounds dropped: ``Annotated[T, ...]`` -> ``T``), else
    ``annotation``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            annotation = args[0]
    if typing.get_origin(annotation) is typing.Annotated:
        return typing.get_args(annotation)[0]
    return annotation


def _add_field_flag(group: argparse._ArgumentGroup, name: str, info: FieldInfo) -> None:
    """One flag for an AppArgs/EngineArgs field; its default is None ("not given"), so that only
    what the command line sets overrides the config file."""
    annotation = _unwrap_optional(info.annotation)
    default = info.default
    help_text = HELP.get(name, name.replace("_", " "))
    if default is not None and "default" not in help_text:
        help_text += f" (default: {default})"
    kwargs: dict[str, Any] = {"default": None, "dest": name, "help": help_text}
    if annotation is bool:
        group.add_argument(_flag(name), action=argparse.BooleanOptionalAction, **kwargs)
        return
    if typing.get_origin(annotation) is Literal:
        kwargs["choices"] = list(typing.get_args(annotation))
    elif annotation in (int, float, str):
        kwargs["type"] = annotation
        kwargs["metavar"] = annotation.__name__.upper()
    else:
        raise TypeError(f"no flag type for {name}: {info.annotation}")
    group.add_argument(_flag(name), **kwargs)


def _fields(model: type[BaseModel], names: Sequence[str] | None = None) -> dict[str, FieldInfo]:
    fields = model.model_fields
    return {n: fields[n] for n in (names if names is not None else fields)}


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a TCP port (1-65535), got {text}")
    return value


def _add_launch_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", help=HELP["model"])
    parser.add_argument("--model", help=f"{HELP['model']} (same as MODEL)")
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="Serve config to start from (default: serve_config.yaml; with --kuberay the "
        "manifest's own); the flags below override it",
    )
    serve = parser.add_argument_group("Serve")
    serve.add_argument("--host", help="address the HTTP server listens on")
    serve.add_argument("--port", type=_port, help="port the HTTP server listens on")
    serve.add_argument(
        "--replicas",
        type=_positive(int),
        metavar="N",
        help="engine replicas (a fixed count: replaces the config's autoscaling)",
    )
    serve.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="Serve's log encoding for the application's replicas (logging_config.encoding)",
    )
    serve.add_argument(
        "--cpus-per-replica",
        type=_positive(float),
        metavar="CPUS",
        help="Ray CPUs reserved by each engine replica",
    )
    app = parser.add_argument_group(
        "application (args in the Serve config)",
        "A flag left out keeps the config file's value; the defaults shown apply where the file "
        "has none.",
    )
    for name, info in _fields(AppArgs, APP_FLAGS).items():
        _add_field_flag(app, name, info)
    engine = parser.add_argument_group("engine (args.engine in the Serve config)")
    for name, info in _fields(EngineArgs).items():
        _add_field_flag(engine, name, info)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixserve",
        description="Prefix-cache-aware LLM serving on Ray Serve.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        allow_abbrev=False,
        help="serve a model over an OpenAI-compatible HTTP API (until Ctrl-C)",
        description="Serve a model as `serve run` would serve the equivalent config "
        "(see `prefixserve config`), blocking until Ctrl-C.",
    )
    _add_launch_flags(serve)
    serve.add_argument(
        "--address",
        default="local",
        help="Ray cluster to run on: `local` (default) starts one of its own, as `vllm serve` "
        "would; `auto` or an address joins a running cluster (`serve run` without --address "
        "would join whichever cluster was last started on this machine)",
    )
    serve.set_defaults(subparser=serve)
    config = commands.add_parser(
        "config",
        allow_abbrev=False,
        help="print the Serve config (or RayService manifest) the same flags would serve",
        description="Print the Serve config that `prefixserve serve` with the same flags runs.",
    )
    _add_launch_flags(config)
    config.set_defaults(subparser=config)
    config.add_argument(
        "--kuberay",
        action="store_true",
        help="print a KubeRay RayService manifest (deploy/kuberay/rayservice.yaml's) instead",
    )
    bench = commands.add_parser(
        "bench",
        allow_abbrev=False,
        help="run a benchmark client",
        description="Run one of the benchmarks; arguments after NAME go to it "
        "(`prefixserve bench NAME --help`).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="benchmarks:\n"
        + "\n".join(f"  {name:<16} {text}" for name, (_, text) in BENCHMARKS.items()),
    )
    bench.add_argument("benchmark", choices=list(BENCHMARKS), metavar="NAME")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="...")
    return parser


def overrides_from(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> Overrides:
    """The command line's settings; MODEL and --model are one setting (both: an error)."""
    if ns.model_tag and ns.model and ns.model_tag != ns.model:
        parser.error(f"MODEL {ns.model_tag!r} and --model {ns.model!r} disagree; give one")
    args: dict[str, Any] = {}
    model = ns.model_tag or ns.model
    if model is not None:
        # A local path is made absolute: replicas do not share the command's working directory.
        path = Path(model).expanduser()
        args["model"] = str(path.resolve()) if path.exists() else model
    for name in APP_FLAGS:
        if getattr(ns, name) is not None:
            args[name] = getattr(ns, name)
    engine = {n: getattr(ns, n) for n in EngineArgs.model_fields if getattr(ns, n) is not None}
    if engine:
        args["engine"] = engine
    return Overrides(
        args=args,
        host=ns.host,
        port=ns.port,
        replicas=ns.replicas,
        cpus_per_replica=ns.cpus_per_replica,
        log_encoding=None if ns.log_format is None else ns.log_format.upper(),
    )


def _where(key: str, ns: argparse.Namespace) -> str:
    """What set a bad config key, for error messages: its flag when the command line set it,
    else the key (in the --config file, or the file the command starts from)."""
    parts = key.split(".")
    name = parts[-1]
    if key == "args.model" and (ns.model_tag or ns.model):
        return "MODEL"
    flagged = name in (*APP_FLAGS, *EngineArgs.model_fields)
    if parts[:1] == ["args"] and flagged and getattr(ns, name, None) is not None:
        return _flag(name)
    return key if key.startswith("--") else f"--config: {key}"


def _serve_config(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    overrides = overrides_from(ns, parser)
    try:
        if getattr(ns, "kuberay", False) and ns.config is None:
            base = embedded_serve_config(load_kuberay_template())
        else:
            base = load_serve_config(ns.config)
        return build_serve_config(base, overrides)
    except LaunchConfigError as e:
        parser.error(f"argument {_where(e.field, ns)}: {e.message}")


def config_command(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The text `prefixserve config` prints."""
    if ns.kuberay and ns.host not in (None, "0.0.0.0"):
        parser.error(
            "argument --host: in a Pod Serve must listen on all interfaces (0.0.0.0): the "
            "Service and KubeRay's probes reach it through the Pod's IP"
        )
    config = _serve_config(ns, parser)
    if ns.kuberay:
        return dump(kuberay_manifest(load_kuberay_template(), config, ns.replicas))
    return dump(config)


def run_serve(config_path: Path, address: str) -> int:
    """Start Serve on ``config_path`` as `serve run --address ADDRESS` does, blocking until
    Ctrl-C."""
    from ray.serve.scripts import cli

    argv = ["run", "--address", address, str(config_path)]
    return cli.main(args=argv, prog_name="serve", standalone_mode=False) or 0


def serve_command(
    ns: argparse.Namespace,
    parser: argparse.ArgumentParser,
    runner: Callable[[Path, str], int] = run_serve,
) -> int:
    """Validate, convert a built-in model once up front (as `make serve` does), write the config
    and hand it to ``runner``."""
    from deployments.ray_env import LAPTOP_RAY_ENV, SERVE_PROCESS_ENV
    from engine.model.loader import resolve_model

    config = _serve_config(ns, parser)
    (app,) = config["applications"]
    model = app["args"].get("model") or AppArgs().model
    try:
        print(f"model: {resolve_model(model)}", file=sys.stderr)
    except ValueError as e:
        parser.error(f"argument MODEL: {e}")
    # Serve's controller and proxy read these where Ray starts (deployments/ray_env.py); the
    # laptop settings only when this command starts the cluster (a running one keeps its own).
    env = {**LAUNCH_ENV, **SERVE_PROCESS_ENV}
    if ns.address == "local":
        env.update(LAPTOP_RAY_ENV)
    for key, value in env.items():
        os.environ.setdefault(key, value)
    with tempfile.TemporaryDirectory(prefix="prefixserve-") as tmp:
        path = Path(tmp) / "serve_config.yaml"
        path.write_text(dump(config))
        return runner(path, ns.address)


def bench_command(ns: argparse.Namespace) -> int:
    module_name, _ = BENCHMARKS[ns.benchmark]
    module = importlib.import_module(f"benchmarks.{module_name}")
    sys.argv = [f"prefixserve bench {ns.benchmark}", *ns.bench_args]
    module.main(ns.bench_args)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "config":
        sys.stdout.write(config_command(ns, ns.subparser))
        return 0
    if ns.command == "serve":
        return serve_command(ns, ns.subparser)
    return bench_command(ns)


if __name__ == "__main__":
    sys.exit(main())
