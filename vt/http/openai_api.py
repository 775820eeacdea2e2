"""OpenAI-compatible routes over the async engine: completions, chat, embeddings, models, tokenize,
metrics.

The app is a single `handle(HttpRequest)` coroutine the HTTP server calls. This module holds the
routes table, what a request's head decides (route, method, API key, content type) and the small
status routes; the generation routes validate their body (vt.http.protocol), fan a request out
into n engine requests (vt.http.generation) and shape results and SSE chunks the way OpenAI
clients (and vLLM's extras) expect (vt.http.completions, vt.http.chat, vt.http.sse).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Sequence
from typing import Protocol, TypeVar

from vt.http import metrics
from vt.http.api_options import ApiOptions
from vt.http.chat import ChatRoute
from vt.http.completions import CompletionRoute
from vt.http.embeddings import EmbeddingsRoute, unserved_routes
from vt.http.engine_client import EngineClient
from vt.http.errors import HttpError, error_body
from vt.http.generation import Generation
from vt.http.json_response import json_response
from vt.http.logprobs import Logprobs
from vt.http.messages import Handler, HttpRequest, Response, StreamResponse
from vt.http.prompt_prep import PromptPreparer
from vt.http.protocol import ProtocolError
from vt.http.reasoning import ReasoningParser
from vt.http.route_context import RouteContext
from vt.http.tokenize_routes import TokenizeRoutes
from vt.sampling_params import SamplingParamsError
from vt.structured.spec import GrammarUnavailableError
from vt.text.preview import preview

log = logging.getLogger("vt.http")
AnyResponse = TypeVar("AnyResponse", Response, StreamResponse)
# Refused at once while draining; a request whose handler started before goes on to finish.
_GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings"})


class ResponseCounts(Protocol):
    """The HTTP server as /metrics reads it."""

    responses_total: dict[int, int]


def _version() -> str:
    from vt import __version__

    return __version__


class OpenAIApp:
    """Routes requests to handlers; `server` (settable) supplies HTTP counters for /metrics."""

    def __init__(self, engine: EngineClient, served_model_name: str,
                 api_key: str | Sequence[str] | None = None, options: ApiOptions | None = None) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.options = options or ApiOptions()
        self.server: ResponseCounts | None = None
        # Any of the keys opens the API (vLLM takes several). Header values arrive as latin-1
        # text of the raw bytes: compare bytes with bytes.
        keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
        self._api_keys = tuple(k.encode("utf-8") for k in keys if k)
        prompts = PromptPreparer(engine.tokenizer, engine.max_model_len)
        self._context = RouteContext(engine, served_model_name, self.options, prompts)
        generation = Generation(self._context)
        logprobs = Logprobs(engine.tokenizer)
        reasoning = ReasoningParser(engine.tokenizer) if self.options.reasoning_parser else None
        completions = CompletionRoute(self._context, generation, logprobs)
        chat = ChatRoute(self._context, generation, logprobs, reasoning)
        tokenize = TokenizeRoutes(self._context)
        embeddings = EmbeddingsRoute(self._context)
        # path -> (needs auth, {method: handler})
        self._routes: dict[str, tuple[bool, dict[str, Handler]]] = {
            "/v1/completions": (True, {"POST": completions.handle}),
            "/v1/chat/completions": (True, {"POST": chat.handle}),
            "/v1/embeddings": (True, {"POST": embeddings.handle}),
            "/v1/models": (True, {"GET": self._models}),
            "/tokenize": (True, {"POST": tokenize.tokenize}),
            "/detokenize": (True, {"POST": tokenize.detokenize}),
            "/health": (False, {"GET": self._health}),
            "/load": (False, {"GET": self._load}),
            "/metrics": (False, {"GET": self._metrics}),
            "/version": (False, {"GET": self._version}),
        }
        # A server runs one runner: the routes it does not serve answer so (vt.http.embeddings).
        for path, refuse in unserved_routes(engine, list(self._routes)).items():
            self._routes[path] = (True, {"POST": refuse})

    @property
    def draining(self) -> bool:
        return self._context.draining

    def begin_drain(self) -> None:
        """Shutting down: /health answers 503 at once, so balancers stop sending here, and new
        generation requests get a 503 a router retries elsewhere, while in-flight ones finish
        (those whose handler started before the drain go on to the engine)."""
        self._context.draining = True

    async def handle(self, request: HttpRequest) -> Response | StreamResponse:
        cors = self.options.cors
        if cors is not None and cors.is_preflight(request.method, request.headers):
            return cors.preflight(request.headers)  # before routing and the API key, as vLLM's middleware
        try:
            handler = self._route(request)
            if self._context.draining and request.path in _GENERATION_PATHS:
                raise HttpError(503, "the server is shutting down; retry on another replica",
                                type="service_unavailable", headers=[("retry-after", "1")])
            response = await handler(request)
        except HttpError as e:
            response = Response(e.status, e.body(), headers=e.headers)
        except (ProtocolError, SamplingParamsError) as e:
            response = Response(400, error_body(str(e), param=e.param))
        except GrammarUnavailableError as e:  # the compiler stopped: the server is stopping
            response = Response(503, error_body(str(e), type="service_unavailable"),
                                headers=[("retry-after", "1")])
        except Exception:
            log.exception("unhandled error for %s %s", request.method, request.path)
            response = Response(500, error_body("internal server error", type="internal_server_error"))
        return self._with_cors(request, response)

    def precheck(self, request: HttpRequest) -> Response | None:
        """What a request's head alone decides (route, method, API key, content type): an error
        Response, or None when the body is worth receiving (before `100 Continue`)."""
        cors = self.options.cors
        if cors is not None and cors.is_preflight(request.method, request.headers):
            return None  # handle() answers it, on a connection that stays open
        try:
            self._route(request)
        except HttpError as e:
            return self._with_cors(request, Response(e.status, e.body(), headers=e.headers))
        return None

    def _with_cors(self, request: HttpRequest, response: AnyResponse) -> AnyResponse:
        # errors carry the headers too, so a browser page can read why it was refused
        if self.options.cors is not None:
            response.headers = [*response.headers, *self.options.cors.response_headers(request.headers)]
        return response

    def _route(self, request: HttpRequest) -> Handler:
        route = self._routes.get(request.path)
        if route is None:
            raise HttpError(404, f"no route for {preview(request.path)}", type="not_found_error",
                            code="not_found")
        needs_auth, methods = route
        if needs_auth:
            self._check_auth(request)
        # HEAD runs the GET handler: the server writes its head (Content-Length included), no body
        handler = methods.get("GET" if request.method == "HEAD" else request.method)
        if handler is None:
            allow = ", ".join([*methods, "HEAD"] if "GET" in methods else methods)
            raise HttpError(405, f"method {preview(request.method)} not allowed on {request.path}; "
                                 f"use {allow}", code="method_not_allowed", headers=[("allow", allow)])
        if request.method == "POST":
            self._check_content_type(request)
        return handler

    # --- request checks ---

    def _check_auth(self, request: HttpRequest) -> None:
        if not self._api_keys:
            return
        authorization = request.headers.get("authorization", "")
        scheme, _, token = authorization.partition(" ")
        token_bytes = token.strip(" \t").encode("latin-1", "replace")
        # every key compared, so the time taken tells nothing of which one came close
        matches = [hmac.compare_digest(token_bytes, key) for key in self._api_keys]
        if scheme.lower() != "bearer" or not any(matches):
            raise HttpError(401, "invalid or missing API key", type="authentication_error",
                            code="invalid_api_key", headers=[("www-authenticate", "Bearer")])

    @staticmethod
    def _check_content_type(request: HttpRequest) -> None:
        content_type = request.headers.get("content-type")
        if content_type is None:
            return
        media = content_type.split(";", 1)[0].strip().lower()
        if media != "application/json":
            raise HttpError(415, f"content-type must be application/json, got {preview(content_type)}",
                            code="unsupported_media_type")

    # --- status routes ---

    async def _models(self, request: HttpRequest) -> Response:
        name = self.served_model_name
        return json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "vt",
            "root": name, "parent": None, "max_model_len": self.engine.max_model_len,
        }]})

    async def _health(self, request: HttpRequest) -> Response:
        if self._context.draining:
            return Response(503, error_body("the server is shutting down", type="service_unavailable"))
        problem = self.engine.health_problem
        if problem is None:
            return Response(200, b"")
        return Response(503, error_body(problem, type="service_unavailable"))

    async def _load(self, request: HttpRequest) -> Response:
        # vLLM's /load (--enable-server-load-tracking): requests the engine holds, waiting or running
        stats = self.engine.stats()
        return json_response({"server_load": stats.num_requests_running + stats.num_requests_waiting})

    async def _metrics(self, request: HttpRequest) -> Response:
        http = self.server.responses_total if self.server is not None else None
        text = metrics.render_metrics(self.engine.stats(), self.served_model_name, http)
        return Response(200, text.encode(), content_type=metrics.CONTENT_TYPE)

    async def _version(self, request: HttpRequest) -> Response:
        return json_response({"version": _version()})
