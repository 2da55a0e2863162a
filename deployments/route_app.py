"""The direct layout's replica chooser: HAProxy asks it where each request goes.

With several engine replicas serving HTTP themselves, HAProxy's Lua action posts each request's
body to this deployment's ``POST /internal/route`` (Serve's ingress request router contract, the
one Ray Serve LLM's ``LLMRouter`` answers) and forwards the request to the replica it names. The
choice is the Engine deployment's own request router (router/'s prefix-aware policy) over the
prompt's chained block hashes, computed here exactly as the replicas compute them (same
tokenizer, chat template, block size and hash key, under the namespace the replicas report). The
stream then flows replica -> HAProxy -> client, never through this process.

A body this side cannot read (not JSON, truncated, invalid) is still routed, by load alone: the
replica it lands on answers the client's error properly. HAProxy needs
``RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1`` to send the body (deployments/ray_env.py).
"""

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.config import AppArgs
from deployments.http_errors import HTTPError
from deployments.kv_namespace import NamespaceSource, prompt_block_hashes
from deployments.validation import RequestValidator, session_header, session_key
from engine.block_hash import hash_key

logger = logging.getLogger("ray.serve")


@dataclass
class RoutingKey:
    """What the request router reads of a request (by attribute): the prompt's block hashes and
    the conversation it belongs to."""

    block_hashes: list[int] = field(default_factory=list)
    session_id: str | None = None


route_app = FastAPI(docs_url=None, redoc_url=None)


@serve.deployment(name="Router", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(route_app)
class ReplicaChooser:
    def __init__(self, engine: DeploymentHandle, args: dict[str, Any]) -> None:
        self.args = AppArgs.model_validate(args)
        self.validator = RequestValidator(self.args)
        self.engine = engine
        self.engine._init()
        self.hash_key = hash_key(self.args.kv_hash_key)
        self.namespace = NamespaceSource(lambda: engine.kv_namespace.remote())

    def routing_key(
        self, body: bytes, namespace: str | None, session_header: str | None = None
    ) -> RoutingKey:
        """The prompt's block hashes (the first prompt's, for several; none when the body cannot
        be read) and its session: the session header HAProxy forwards, else the body's
        ``user``."""
        session = session_key(session_header, None)
        try:
            data = json.loads(body) if body else None
            if not isinstance(data, dict):
                return RoutingKey(session_id=session)
            job = (
                self.validator.chat(data) if "messages" in data else self.validator.completion(data)
            )
        except (HTTPError, ValueError, RecursionError):
            return RoutingKey(session_id=session)
        hashes = prompt_block_hashes(
            job.prompts[0], self.args.engine.block_size, namespace, self.hash_key, job.cache_salt
        )
        return RoutingKey(hashes, session or job.session_id)

    @route_app.post("/internal/route")
    async def route(self, request: Request) -> dict[str, Any]:
        key = self.routing_key(
            await request.body(), await self.namespace.get(), session_header(request.headers)
        )
        try:
            async with self.engine.choose_replica(key, _reserve=False) as selection:
                replica = selection._replica
                endpoint = replica.backend_http_endpoint
                if endpoint is None:
                    raise RuntimeError(f"replica {selection.replica_id} has no HTTP endpoint")
                host, port = endpoint
                return {
                    "host": host,
                    "port": port,
                    "replica_id": replica.replica_id.to_full_id_str(),
                }
        except Exception as e:  # noqa: BLE001 - HAProxy turns any non-200 into a 503
            logger.warning("no replica chosen: %r", e)
            raise HTTPException(status_code=503, detail=type(e).__name__) from e
