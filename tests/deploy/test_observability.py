"""The metric names the docs, the Grafana dashboard, the PodMonitor and the code agree on.
(That they exist on a live server: tests/deployments/test_serving.py.)"""

from __future__ import annotations

import yaml
from prometheus_client import CollectorRegistry

from deployments.metrics import ReplicaMetrics
from tests.deploy.observability import (
    PODMONITOR,
    dashboard_queries,
    documented_metrics,
    documented_types,
    family_of,
    load_dashboard,
    queried_samples,
)
from tests.deploy.rayservice import load_manifest, serve_config

# The vLLM families an operator's existing dashboards and alerts rely on (vLLM's names).
REQUIRED_VLLM = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_success_total",
}


def exported_families() -> dict[str, str]:
    """A replica registry's vLLM families as exposition names (counters with ``_total``)."""
    metrics = ReplicaMetrics("r1", "m")
    out = {}
    for fam in metrics.registry.collect():
        if fam.name.startswith("vllm:"):
            name = f"{fam.name}_total" if fam.type == "counter" else fam.name
            out[name] = fam.type
    return out


def test_docs_list_exactly_the_exported_vllm_families() -> None:
    documented = documented_types()
    assert set(documented) >= REQUIRED_VLLM
    assert documented == exported_families()


def test_every_vllm_family_carries_model_name() -> None:
    metrics = ReplicaMetrics("r1", "served-name")
    for fam in metrics.registry.collect():
        if fam.name.startswith("vllm:"):
            assert fam.samples, fam.name
            for sample in fam.samples:
                assert sample.labels["model_name"] == "served-name", sample
                assert sample.labels["replica"] == "r1", sample


def test_dashboard_queries_only_documented_metrics() -> None:
    dashboard = load_dashboard()
    documented = documented_metrics()
    queries = dashboard_queries(dashboard)
    assert queries and all(p.get("targets") for p in dashboard["panels"])
    queried = set().union(*(queried_samples(q) for q in queries))
    assert {family_of(s, documented) for s in queried} <= documented
    # Every required vLLM family is on the dashboard.
    assert {family_of(s, documented) for s in queried} >= REQUIRED_VLLM
    # Panels do not overlap and the datasource is a variable, not a fixed uid.
    cells = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in dashboard["panels"]]
    assert len(set(cells)) == len(cells)
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])


def test_queried_samples_reads_promql() -> None:
    expr = (
        "histogram_quantile(0.9, sum by (le) (rate(vllm:e2e_request_latency_seconds_bucket"
        '{model_name=~"$model_name"}[5m]))) / prefixserve_kv_cache_blocks'
    )
    assert queried_samples(expr) == {
        "vllm:e2e_request_latency_seconds_bucket",
        "prefixserve_kv_cache_blocks",
    }
    assert family_of("vllm:e2e_request_latency_seconds_bucket", documented_metrics()) == (
        "vllm:e2e_request_latency_seconds"
    )


def test_podmonitor_scrapes_the_head_serve_port() -> None:
    monitor = yaml.safe_load(PODMONITOR.read_text())
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    # Only the head: every Pod's proxy answers the same whole-application exposition.
    assert monitor["spec"]["selector"]["matchLabels"] == {"ray.io/node-type": "head"}
    manifest = load_manifest("cpu")
    head = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    ports = {p["name"]: p["containerPort"] for p in head["containers"][0]["ports"]}
    assert ports[endpoint["port"]] == serve_config(manifest)["http_options"]["port"]


def test_registry_is_per_replica() -> None:
    # Two replicas in one process (tests) keep separate registries: no duplicate-name clash.
    a, b = ReplicaMetrics("a", "m"), ReplicaMetrics("b", "m")
    assert isinstance(a.registry, CollectorRegistry) and a.registry is not b.registry
