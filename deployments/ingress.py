"""The routed layout's HTTP deployment: OpenAI routes in front of the Engine deployment's handle.

Used where engine replicas are many and spread over nodes (KubeRay): each prompt is routed on
its own by the handle's request router (router/'s policy reads ``EngineRequest.block_hashes``)
and its items relayed from the chosen replica. A prompt whose replica fails before anything
reached the client is retried on another replica, up to ``MAX_ATTEMPTS`` in all
(``deployments.generation``); one whose replica fails mid-stream is resumed on another replica
from the tokens already sent (``deployments.failover``). The laptop layout serves HTTP from the engine replica itself
(``deployments.engine_server``).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from ray import serve
from ray.serve import context as serve_context
from ray.serve.handle import DeploymentHandle

from deployments import request_logging
from deployments.config import AppArgs
from deployments.cpu_affinity import restore_priority
from deployments.engine_request import EngineRequest
from deployments.frontend import OpenAIFrontend, openai_routes
from deployments.kv_namespace import NamespaceSource

# Attempts per prompt when its engine replica fails before anything reached the client.
MAX_ATTEMPTS = 3


def _own_serve_request_id(suffix: str) -> None:
    """Give the current task's handle calls an internal request id of their own.

    Every handle call made while serving one HTTP request inherits that request's internal id,
    and Serve's request router matches routing results to pending calls by it: calls in flight
    together under one id get mixed up, and all but one are never routed. Each prompt of a
    several-prompt request runs in a task of its own, whose copy of the context this changes."""
    current = serve_context._get_serve_request_context()
    serve_context._serve_request_context.set(
        dataclasses.replace(
            current,
            _internal_request_id=f"{current._internal_request_id or uuid.uuid4().hex}-{suffix}",
        )
    )


class HandleBackend:
    """Engine requests through the Engine deployment's handle: the request router picks the
    replica; Serve streams the items back."""

    max_attempts = MAX_ATTEMPTS

    def __init__(self, handle: DeploymentHandle, by_reference: bool) -> None:
        self.generate_handle = handle.options(
            method_name="generate", stream=True, _by_reference=by_reference
        )
        self.namespace = NamespaceSource(lambda: handle.kv_namespace.remote())

    async def kv_namespace(self) -> str | None:
        return await self.namespace.get()

    def open(self, req: EngineRequest, index: int, num_prompts: int, key: str | None = None) -> Any:
        if key is not None or num_prompts > 1:
            _own_serve_request_id(key or str(index))
        return self.generate_handle.remote(req)


app, OpenAIRoutes = openai_routes()


# Everything the class below uses must be defined above it: ``serve.ingress`` copies the class
# when it is decorated, with the module's globals as they are at that point.
@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress(OpenAIRoutes):  # type: ignore[misc, valid-type]
    def __init__(
        self,
        engine: DeploymentHandle,
        args: dict[str, Any],
        prefill: DeploymentHandle | None = None,
    ) -> None:
        """``prefill``: the Prefill deployment's handle, under prefill/decode disaggregation
        (``deployments.disaggregation``); the Engine deployment is then the decode side."""
        self.args = AppArgs.model_validate(args)
        request_logging.install()
        # The ingress relays every stream item: at Ray's nice 15 it waits behind any busy engine
        # thread on its core, and with every core busy (a prefill beside decoding) all streams
        # stall together. Same reason as the engine replicas (deployments.cpu_affinity).
        restore_priority()
        self.engine = engine
        by_reference = self.args.handle_transport == "actor"
        backend = HandleBackend(engine, by_reference=by_reference)
        self.frontend = OpenAIFrontend(
            self.args,
            backend,
            serve.get_replica_context().replica_id.unique_id,
            reports=lambda: engine.cluster_report.remote(),
            prefill=None if prefill is None else HandleBackend(prefill, by_reference),
        )
