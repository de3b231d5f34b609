"""ASGI middleware around every route of the HTTP API: the body-size limit and read
timeout, the API keys (tenants and the admin key), request metrics and trace spans. A
refusal is OpenAI's error body (`errors.error_body`), like every other failure
(docs/api.md, "Authentication" and "Errors")."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from observability.metrics import TokenizerMetrics
from observability.tracing import Tracing
from services.settings import Settings
from services.tokenizer.errors import RequestError, error_body

OPEN_PATHS = ("/health", "/healthz", "/health_generate", "/metrics")
"""Probes and scrapers carry no API key."""


async def _reject(scope: Scope, receive: Receive, send: Send, err: RequestError) -> None:
    await JSONResponse(error_body(err), err.status)(scope, receive, send)


class BodySizeLimit:
    """413 for a body over `max_bytes`: at once when Content-Length says so, else as soon
    as the bytes read pass the limit (chunked uploads)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> RequestError:
        return RequestError(
            f"the request body exceeds {self.max_bytes} bytes", code="request_too_large", status=413
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await _reject(scope, receive, send, self._too_large())
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise self._too_large()
            return message

        await self.app(scope, limited_receive, send)


class BodyReadTimeout:
    """408 when the request body stalls for `timeout` seconds between two chunks, so that
    a client that sends headers and then nothing cannot hold a connection and a handler
    forever. Once the body is complete, `receive` is the server's own again (handlers wait
    on it for the client's disconnect, as long as a generation takes)."""

    def __init__(self, app: ASGIApp, timeout: float):
        self.app = app
        self.timeout = timeout

    def _stalled(self) -> RequestError:
        return RequestError(
            f"the request body stalled for {self.timeout:g} s (--http-body-timeout)",
            code="request_timeout",
            status=408,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body_complete = False

        async def timed_receive() -> Message:
            nonlocal body_complete
            if body_complete:
                return await receive()
            try:
                async with asyncio.timeout(self.timeout):
                    message = await receive()
            except TimeoutError:
                raise self._stalled() from None
            body_complete = not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)


class RequestMetrics:
    """Counts every answered request by route (not raw path: no unbounded label values)."""

    def __init__(self, app: ASGIApp, metrics: TokenizerMetrics, routes: frozenset[str]):
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in self.routes else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_request(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


class TraceRequests:
    """One server span per API request (not probes or scrapes): the root of the request's
    trace, or a child of the client's `traceparent`. Handlers run inside it, so what they
    send to the worker carries its context."""

    def __init__(self, app: ASGIApp, tracing: Tracing, routes: frozenset[str]):
        self.app = app
        self.tracing = tracing
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else "other"
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        with self.tracing.server_span(f"{scope['method']} {route}", headers) as span:
            span.set_attribute("http.route", route)

            async def traced_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                await send(message)

            await self.app(scope, receive, traced_send)


# ----- API keys, tenants and the admin key ------------------------------------------------


class ApiKeyFileError(ValueError):
    """A `--api-key-file` the server refuses to start with; the message names the line,
    never a key."""


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def parse_api_key_file(text: str, source: str) -> list[tuple[str, str | None]]:
    """(key, tenant or None) per line of `key [tenant]`; blank lines and `#` comments (a
    whole line, or after the fields) are skipped."""
    entries: list[tuple[str, str | None]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        comment = next((i for i, f in enumerate(fields) if f.startswith("#")), len(fields))
        fields = fields[:comment]
        if len(fields) > 2:
            raise ApiKeyFileError(
                f"{source}:{lineno}: expected 'key [tenant]', got {len(fields)} fields"
            )
        if fields:
            entries.append((fields[0], fields[1] if len(fields) == 2 else None))
    if not entries:
        raise ApiKeyFileError(f"{source}: no API keys in it")
    return entries


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as its bearer key says (set by `ApiKeyAuth` in the scope's
    state, read with `caller`)."""

    tenant: str | None
    """Opaque digest of the key's tenant (None: no API keys, or the admin key)."""
    operator: bool
    """May use the operator endpoints (`require_admin`)."""
    identified: bool
    """Presented a valid key."""


@dataclass(frozen=True)
class ApiKeys:
    """The bearer keys a server accepts, kept as SHA-256 digests only. A presented key is
    found by its digest: what a lookup's timing could leak is about a digest, and says
    nothing about any key (the constant-time property a byte-wise compare would give).

    A tenant's digest is an HMAC of its name keyed by all the keys, so it is the same on
    every replica given the same keys, and neither a tenant's name nor a key can be read
    back from the KV events that carry it (`PrefixNamespace.tenant`)."""

    tenants: dict[bytes, str]
    """Key digest → tenant digest. Empty: the API is open."""
    admin: bytes | None
    """The admin key's digest; None: the API keys guard the operator endpoints."""

    @classmethod
    def from_settings(cls, settings: Settings) -> ApiKeys:
        """The keys of `--api-key`, `--api-key-file` and `--admin-api-key`; raises
        `ApiKeyFileError` for a file that cannot be read or is malformed."""
        entries: list[tuple[str, str | None]] = []
        if settings.api_key:
            entries.append((settings.api_key, None))
        if settings.api_key_file:
            entries += parse_api_key_file(_read(settings.api_key_file), settings.api_key_file)
        admin = _digest(settings.admin_api_key) if settings.admin_api_key else None
        secret = _digest(b"".join(sorted(_digest(key) for key, _ in entries)))
        tenants: dict[bytes, str] = {}
        for key, tenant in entries:
            digest = _digest(key)
            if digest in tenants or digest == admin:
                raise ApiKeyFileError(
                    "an API key is given twice (--api-key, --api-key-file, --admin-api-key "
                    "must all differ)"
                )
            name = tenant.encode() if tenant is not None else b"key:" + digest
            tenants[digest] = hmac.new(secret, name, hashlib.sha256).hexdigest()[:32]
        return cls(tenants, admin)

    def identify(self, token: bytes) -> Caller | None:
        """The caller that `token` (the bearer key, b"" when none) makes; None: refused."""
        digest = _digest(token)
        if self.admin is not None and hmac.compare_digest(digest, self.admin):
            return Caller(tenant=None, operator=True, identified=True)
        tenant = self.tenants.get(digest)
        if tenant is not None:
            return Caller(tenant=tenant, operator=self.admin is None, identified=True)
        if self.tenants:
            return None
        return Caller(tenant=None, operator=self.admin is None, identified=False)


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ApiKeyFileError(f"cannot read --api-key-file {path}: {e}") from None


class ApiKeyAuth:
    """`Authorization: Bearer <key>` on every path but the probes': a key of `keys`, or a
    401. The request's `Caller` goes into the scope's state for the handlers."""

    def __init__(self, app: ASGIApp, keys: ApiKeys):
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            found = self.keys.identify(token.strip() if scheme.lower() == b"bearer" else b"")
            if found is None:
                err = RequestError("invalid or missing API key", code="invalid_api_key", status=401)
                return await _reject(scope, receive, send, err)
            scope.setdefault("state", {})[CALLER_STATE] = found
        await self.app(scope, receive, send)


CALLER_STATE = "radixserve_caller"
_UNKNOWN = Caller(tenant=None, operator=False, identified=False)
"""A request `ApiKeyAuth` did not see (a probe's path): it may operate nothing."""


def caller(request: Request) -> Caller:
    """The request's `Caller`, as `ApiKeyAuth` found it."""
    found: Caller = request.scope.get("state", {}).get(CALLER_STATE, _UNKNOWN)
    return found


def require_admin(request: Request, what: str) -> None:
    """Operator endpoints (`what` names the one refused): with `--admin-api-key` only its
    key opens them (401 without a valid key, 403 with an API key); without it, any
    key the API accepts."""
    found = caller(request)
    if found.operator:
        return
    if found.identified:
        raise RequestError(
            f"{what} needs the admin API key (--admin-api-key)",
            code="admin_key_required",
            status=403,
        )
    raise RequestError(
        f"{what} needs the admin API key (--admin-api-key)", code="invalid_api_key", status=401
    )


def cache_tenant(request: Request, settings: Settings) -> str | None:
    """The caller's tenant under `--cache-isolation tenant`, for its prefix namespace: then
    no prefix, `cache_salt`ed or not, is shared across tenants. None otherwise."""
    return caller(request).tenant if settings.cache_isolation == "tenant" else None
