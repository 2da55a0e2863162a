"""Errors as an OpenAI client expects them: one exception type, one JSON body, one place that
installs the handlers on an app.

Every error leaves as ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status;
nothing a client sends reaches the client as a stack trace or a bare 500.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.openai_format import error_body

logger = logging.getLogger("ray.serve")


class HTTPError(Exception):
    """An answer other than 200: its status, OpenAI error type, the request field at fault
    (``param``) and a machine-readable ``code``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code
        self.headers = headers


def error_response(e: HTTPError) -> JSONResponse:
    return JSONResponse(
        error_body(str(e), e.type, e.param, e.code), status_code=e.status, headers=e.headers
    )


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """The first validation error as a message and the top-level field it names."""
    err = e.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if not isinstance(x, int)]
    param = loc[0] if loc else None
    where = ".".join(str(x) for x in err.get("loc", ()))
    # Our own validators' messages are already sentences; pydantic prefixes "Value error, ".
    error = (err.get("ctx") or {}).get("error")
    msg = str(error) if err.get("type") == "value_error" and error is not None else err.get("msg")
    return (f"{where}: {msg}" if where else str(msg)), param


async def _http_error(_: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, HTTPError)
    return error_response(e)


async def _starlette_error(_: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, StarletteHTTPException)
    type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(e.detail), type_, code=str(e.status_code)), e.status_code)


async def _validation_error(_: Request, e: Exception) -> JSONResponse:
    return JSONResponse(error_body(str(e)), status_code=400)


async def _unexpected_error(_: Request, e: Exception) -> JSONResponse:
    logger.exception("unhandled error while serving a request", exc_info=e)
    return JSONResponse(
        error_body(f"internal error: {type(e).__name__}", "internal_error"), status_code=500
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(HTTPError, _http_error)
    app.add_exception_handler(StarletteHTTPException, _starlette_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected_error)
