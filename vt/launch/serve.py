"""`vt serve`: the engine, the OpenAI routes and the HTTP server on one uvloop event loop."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence

from vt.config import EngineConfig
from vt.engine.engine import AsyncEngine
from vt.http.api_options import ApiOptions
from vt.http.openai_api import OpenAIApp
from vt.http.server import HttpLimits, HttpServer
from vt.launch.startup_log import seconds_since_process_start, startup_lines
from vt.launch.stats_log import STATS_INTERVAL_S, log_stats

log = logging.getLogger("vt.serve")


async def serve(cfg: EngineConfig, host: str, port: int, served_model_name: str,
                api_key: str | Sequence[str] | None, shutdown_timeout: float,
                limits: HttpLimits | None = None, options: ApiOptions | None = None,
                log_stats_every: float | None = None, access_log: bool = True,
                key_source: str | None = None) -> int:
    # Counted from the process's own start: imports and the interpreter take a good share of it.
    started = time.monotonic() - (seconds_since_process_start() or 0.0)
    engine = AsyncEngine(cfg)
    engine.runner.check_serves_full_context()
    if cfg.tokenizer is not None and engine.tokenizer.vocab_size > engine.model_config.vocab_size:
        raise ValueError(f"--tokenizer {cfg.tokenizer}: its {engine.tokenizer.vocab_size} tokens do not fit "
                         f"the model's vocabulary of {engine.model_config.vocab_size}")
    await engine.start()
    if options is not None and options.chat_template is not None:
        # --chat-template renders in this process, as the model's own does, once it renders a plain
        # conversation within its bound; otherwise in the bounded child, as a request's template
        problem = engine.tokenizer.trust_chat_template(options.chat_template)
        if problem is not None:
            log.warning("--chat-template: %s; requests render it in a bounded child process", problem)
    app = OpenAIApp(engine, served_model_name, api_key=api_key, options=options)
    server = HttpServer(app.handle, limits or HttpLimits(), precheck=app.precheck, access_log=access_log)
    app.server = server
    await server.start(host, port)
    # What start-up built lives as long as the server: out of the collector's sight, full
    # collections while serving walk only what requests allocate.
    gc.collect()
    gc.freeze()
    # Handlers first: a SIGTERM sent as soon as the banner appears must still shut down cleanly.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if key_source is not None:  # that a key guards the API, never the key itself
        log.info("API key required on /v1/*, /tokenize and /detokenize (from %s)", key_source)
    for line in startup_lines(engine, time.monotonic() - started, app.options.sampling_defaults):
        log.info("%s", line)
    stats = asyncio.create_task(log_stats(engine, log_stats_every)) if log_stats_every else None
    shown = f"[{host}]" if ":" in host else host
    print(f"vt: serving on http://{shown}:{server.port} (model {served_model_name})", flush=True)
    await stop.wait()
    print("vt: shutting down", flush=True)
    if stats is not None:
        stats.cancel()
    await shut_down(app, engine, server, shutdown_timeout)
    return 0


async def shut_down(app: OpenAIApp, engine: AsyncEngine, server: HttpServer, timeout: float) -> None:
    """Every request accepted before the signal ends with an answer its client can read.

    Drain: /health turns 503 and new generation requests get 503 at once while the listener
    stays open, so balancers and routers move traffic elsewhere. The requests already accepted
    (still arriving, or being rendered, tokenized, compiled, generated or written) have `timeout`
    seconds to finish. Past it, each one not yet answered gets a 503 (its handler is stopped:
    a grammar compile it waited for is cancelled, its child killed) and each stream still under
    way ends with an error event and [DONE]. Then the server closes, with a second for those last
    writes."""
    app.begin_drain()
    if not await server.wait_idle(timeout):
        log.warning("shutdown timeout (%g s) reached: answering the requests still open with an error",
                    timeout)
    server.stop_requests()
    await engine.stop(0.0)
    await server.close(1.0)


# environment variable -> (HttpLimits field, type); read until the CLI grows the matching flags
_LIMIT_ENV = {
    "VT_HTTP_HEADER_TIMEOUT": ("header_timeout_s", float),
    "VT_HTTP_KEEPALIVE_TIMEOUT": ("keepalive_timeout_s", float),
    "VT_HTTP_WRITE_TIMEOUT": ("write_timeout_s", float),
    "VT_MAX_CONNECTIONS": ("max_connections", int),
    "VT_MAX_BODY_BYTES": ("max_body_bytes", int),
}


def limits_from_env(env: Mapping[str, str] | None = None, **overrides: float | int | None) -> HttpLimits:
    """HttpLimits from VT_* environment variables; keyword overrides (CLI flags) win when not None."""
    env = os.environ if env is None else env
    values: dict[str, float | int] = {}
    for var, (name, kind) in _LIMIT_ENV.items():
        raw = env.get(var)
        if raw:
            try:
                values[name] = kind(raw)
            except ValueError:
                raise ValueError(f"{var} must be a {kind.__name__}, got {raw!r}") from None
    values.update({k: v for k, v in overrides.items() if v is not None})
    return HttpLimits(**values)  # validates: every value must be positive


def api_keys(flag: Sequence[str] | None,
             env: Mapping[str, str] | None = None) -> tuple[tuple[str, ...], str | None]:
    """The keys the API requires and where they came from: --api-key's, else VT_API_KEY, else
    VLLM_API_KEY (vLLM's variable); none, and no source, when none is set."""
    env = os.environ if env is None else env
    keys = tuple(k for k in flag or () if k)
    if keys:
        return keys, "--api-key"
    for var in ("VT_API_KEY", "VLLM_API_KEY"):
        if env.get(var):
            return (env[var],), var
    return (), None


def run_server(cfg: EngineConfig, host: str, port: int, served_model_name: str,
               api_key: str | Sequence[str] | None, shutdown_timeout: float, limits: HttpLimits | None = None,
               options: ApiOptions | None = None, log_stats: bool = True, access_log: bool = True) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        uvloop = None
    keys, source = api_keys([api_key] if isinstance(api_key, str) else api_key)
    coro = serve(cfg, host, port, served_model_name, keys, shutdown_timeout,
                 limits if limits is not None else limits_from_env(), options,
                 STATS_INTERVAL_S if log_stats else None, access_log, source)
    if uvloop is not None:
        return uvloop.run(coro)
    return asyncio.run(coro)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `vt serve`")
