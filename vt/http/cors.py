"""CORS as vLLM's server answers it: Starlette's CORSMiddleware with `--allowed-origins`,
`--allowed-methods`, `--allowed-headers` and `--allow-credentials` (vLLM's defaults allow every
origin, method and header, without credentials).

A preflight (OPTIONS with Origin and Access-Control-Request-Method) is answered here, on any path
and before the API key is checked, as the middleware answers it before the app sees it: 200 "OK",
or 400 "Disallowed CORS origin, method, ..." naming what the policy refuses. Every other response
to a request that sends an Origin gets the policy's headers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from vt.http.messages import Response

# Starlette's lists: "*" in --allowed-methods means these; the safelisted headers are always allowed.
ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "QUERY")
SAFELISTED_HEADERS = ("Accept", "Accept-Language", "Content-Language", "Content-Type")
_PREFLIGHT_VARY = ("Origin, Access-Control-Request-Method, Access-Control-Request-Headers, "
                   "Access-Control-Request-Private-Network")
TEXT = "text/plain; charset=utf-8"


@dataclass(frozen=True)
class CorsPolicy:
    allow_origins: tuple[str, ...] = ("*",)
    allow_methods: tuple[str, ...] = ("*",)
    allow_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    max_age: int = 600

    @property
    def _all_origins(self) -> bool:
        return "*" in self.allow_origins

    @property
    def _methods(self) -> tuple[str, ...]:
        return ALL_METHODS if "*" in self.allow_methods else self.allow_methods

    def _origin_allowed(self, origin: str) -> bool:
        return self._all_origins or origin in self.allow_origins

    @staticmethod
    def is_preflight(method: str, headers: Mapping[str, str]) -> bool:
        return method == "OPTIONS" and "origin" in headers and "access-control-request-method" in headers

    def preflight(self, headers: Mapping[str, str]) -> Response:
        """The answer to a preflight request (`headers`: the request's, lower-case names)."""
        origin = headers["origin"]
        explicit_origin = not self._all_origins or self.allow_credentials
        out = {"Vary": _PREFLIGHT_VARY}
        if not explicit_origin:
            out["Access-Control-Allow-Origin"] = "*"
        out["Access-Control-Allow-Methods"] = ", ".join(self._methods)
        out["Access-Control-Max-Age"] = str(self.max_age)
        allowed_headers = sorted({*SAFELISTED_HEADERS, *self.allow_headers})
        all_headers = "*" in self.allow_headers
        if not all_headers:
            out["Access-Control-Allow-Headers"] = ", ".join(allowed_headers)
        if self.allow_credentials:
            out["Access-Control-Allow-Credentials"] = "true"
        failures = []
        if self._origin_allowed(origin):
            if explicit_origin:
                out["Access-Control-Allow-Origin"] = origin
        else:
            failures.append("origin")
        if headers["access-control-request-method"] not in self._methods:
            failures.append("method")
        requested = headers.get("access-control-request-headers")
        if all_headers and requested is not None:
            out["Access-Control-Allow-Headers"] = requested  # every header is allowed: mirror them
        elif requested is not None:
            lowered = {h.lower() for h in allowed_headers}
            if any(h.strip().lower() not in lowered for h in requested.split(",")):
                failures.append("headers")
        if "access-control-request-private-network" in headers:
            failures.append("private-network")  # vLLM does not allow private network access
        if failures:
            return Response(400, ("Disallowed CORS " + ", ".join(failures)).encode(), TEXT, list(out.items()))
        return Response(200, b"OK", TEXT, list(out.items()))

    def response_headers(self, headers: Mapping[str, str]) -> list[tuple[str, str]]:
        """Headers to add to the response of a request that is not a preflight."""
        origin = headers.get("origin")
        if origin is None:
            return [("Vary", "Origin")]
        out = []
        if self._all_origins:
            out.append(("Access-Control-Allow-Origin", "*"))
        if self.allow_credentials:
            out.append(("Access-Control-Allow-Credentials", "true"))
        # Named origins are mirrored back; so is any origin with credentials, where browsers refuse "*".
        if self.allow_credentials if self._all_origins else self._origin_allowed(origin):
            out = [(k, v) for k, v in out if k != "Access-Control-Allow-Origin"]
            out.append(("Access-Control-Allow-Origin", origin))
        out.append(("Vary", "Origin"))
        return out
