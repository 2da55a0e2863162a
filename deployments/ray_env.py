"""Ray Serve settings that live in the environment of the processes Ray starts.

Serve reads these once, when its controller and proxy start, from the environment of the
process that started Ray (``serve run`` on a laptop, the container on Kubernetes); the
application's config cannot set them. ``make serve`` and ``make test`` export them, the
Dockerfile bakes them into the image, and the integration tests start their cluster with them,
so every way of running the app uses the same values. What each saves was measured with W1 over
HTTP on a 2-vCPU machine (docs/benchmarks.md):

* ``RAY_SERVE_CONTROL_LOOP_INTERVAL_S``: the controller reconciles every 0.1 s by default and
  took 1.6 CPU-s per 30 s idle and ~5% of a core under load; at 0.5 s it takes 0.9 idle and
  under half that under load. Deploys, health verdicts and replica restarts react within 0.5 s
  instead.
* ``RAY_SERVE_PROXY_USE_GRPC``: the HTTP proxy hands requests and streamed chunks to the ingress
  over Serve's gRPC channel instead of actor calls (proxy 2.5 -> 1.8 CPU-s per run).
* ``RAY_SERVE_ENABLE_HA_PROXY``: Serve's direct ingress. HAProxy listens on the app's port and
  forwards each request to an HTTP server inside a replica of the ingress deployment, so a
  streamed chunk costs a socket write (~10 us) instead of a trip through Serve's Python proxy
  (1-2 ms of CPU each). Replica ports come from 30000-31000 on the node.
* ``RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY``: HAProxy sends the request body to the
  direct layout's replica chooser (``deployments.route_app``), which routes by the prompt.
* ``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0``: a replica runs the app's handlers on the
  event loop that serves its HTTP, as a plain uvicorn app would, instead of handing every request
  and every streamed chunk to a second loop on another thread. A ``/health`` burst costs about a
  third as much; the handlers must never block that loop, which is why bodies above a few KiB
  are validated in a worker pool (``deployments.frontend``) and the engine runs on its own thread.

``LAPTOP_RAY_ENV`` is for a Ray cluster that the launch starts on the machine it serves from
(``make serve``, ``prefixserve serve`` with its default ``--address local``), where the engine
keeps every core busy and whatever Ray's own processes spend is taken from it. It lengthens
polling periods that only cost latency of observability, never of requests; it is not baked into
the image, so KubeRay's clusters keep Ray's defaults. Each setting's saving is measured per
process in docs/benchmarks.md ("Where an idle laptop stack's CPU goes"):

* ``RAY_LOG_MONITOR_MANY_FILES_THRESHOLD=0`` and ``LOG_NAME_UPDATE_INTERVAL_S=5``: Ray's log
  monitor (which forwards the workers' output to ``serve run``'s console) lists the log
  directory on every 0.1 s pass while the node has fewer than 1,000 log files; with these it lists
  it every 5 s. A new worker's lines reach the console up to 5 s later, none is lost (a newly
  found file is read from its start); lines of known files still go out within 0.1 s.
* ``REPORTER_UPDATE_INTERVAL_MS=30000``: the dashboard agent samples every worker's CPU and
  memory with psutil every 5 s by default, for the dashboard's node view and Ray's node metrics;
  these then move every 30 s.
* ``RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=1000``: Serve's replicas, proxy and handles hand their
  cached metrics to Ray's metrics pipeline every 0.1 s by default; once a second is still finer
  than any Prometheus scrape. ``/metrics`` is the app's own and is not affected.
* ``RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=2``: with direct ingress a stopping replica
  stays reachable this long (30 s by default) so that every node's HAProxy stops sending to it
  before its listener closes; only then do its requests drain. A laptop has one HAProxy, on the
  same machine, which reloads its backends within a second of the controller's update (its log
  says so), so Ctrl-C on ``make serve``, a redeploy or a scale-down waited ~30 s for nothing.
  Requests that still arrive after the listener closes are retried by HAProxy on another replica.
"""

from __future__ import annotations

SERVE_PROCESS_ENV: dict[str, str] = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
}

# Only where the launch starts the Ray cluster itself on a laptop (see the module docstring).
LAPTOP_RAY_ENV: dict[str, str] = {
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "5",
    "REPORTER_UPDATE_INTERVAL_MS": "30000",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}
