"""What the server checks before a handler runs: API keys (OpenAI's `Authorization: Bearer`),
the request body's size, and that a body is JSON sent as JSON (a `text/plain` POST, which any web
page can make without the browser asking, must not make the server generate).

Errors answer in the path's own shape: OpenAI's `{"error": {...}}` under `/v1` (and the
un-prefixed OpenAI paths), Megatron's `{"message": ...}` elsewhere. `/health` needs no key.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import Any

from gigatron.inference.api_megatron import RequestError

OPEN_PATHS = ("/health", "/v1/health")
OPENAI_PATHS = ("/v1/", "/completions", "/chat/completions")
DEFAULT_MAX_BODY_BYTES = 1 << 20


def error_body(path: str, message: str, param: str | None, code: str | None = None) -> dict:
    """The JSON of an error answer in the shape the path's clients read."""
    if path.startswith(OPENAI_PATHS):
        kind = "invalid_request_error"
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return {"message": message}


def authorised(header: str | None, api_keys: Sequence[str]) -> bool:
    """Whether an `Authorization` header carries one of the keys (compared in constant time)."""
    if not api_keys:
        return True
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    return any(hmac.compare_digest(token.strip().encode(), key.encode()) for key in api_keys)


def check_json_request(headers: Any, body: bytes, max_body_bytes: int) -> None:
    """RequestError (413, 415) for a body too large or not declared as JSON."""
    if len(body) > max_body_bytes:
        raise RequestError(
            f"the request body ({len(body)} bytes) is larger than this server's limit of "
            f"{max_body_bytes} bytes",
            None,
            status=413,
        )
    media_type = headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise RequestError(
            f"Content-Type {media_type or '(none)'}: send the body as application/json",
            None,
            status=415,
        )


def add_guards(app: Any, api_keys: Sequence[str], max_body_bytes: int) -> None:
    """The key and body-size checks as middleware of the FastAPI `app` (the body's size from
    Content-Length here; `check_json_request` measures what was read)."""
    # why: fastapi is the optional `serve` extra
    from fastapi.responses import JSONResponse

    @app.middleware("http")
    async def guard(request, call_next):
        path = request.url.path
        if path not in OPEN_PATHS and not authorised(
            request.headers.get("authorization"), api_keys
        ):
            body = error_body(path, "Incorrect API key provided", None, "invalid_api_key")
            return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_body_bytes:
            message = (
                f"the request body ({length} bytes) is larger than this server's limit of "
                f"{max_body_bytes} bytes"
            )
            return JSONResponse(error_body(path, message, None), status_code=413)
        return await call_next(request)


class EncodingGuard:
    """A tokenizer whose `tokenize` raises RequestError naming `field` (HTTP 400) when the text
    cannot be encoded, instead of an unexpected error; everything else is the tokenizer's."""

    def __init__(self, tokenizer: Any, field: str) -> None:
        self._tokenizer = tokenizer
        self._field = field

    def tokenize(self, text: str) -> list[int]:
        try:
            return self._tokenizer.tokenize(text)
        except Exception as error:  # noqa: BLE001 - any tokenizer failure is the input's
            raise RequestError(
                f"{self._field}: the tokenizer cannot encode this text ({error})", self._field
            ) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)
