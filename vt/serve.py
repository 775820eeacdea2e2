"""`vt serve`: the engine, the OpenAI routes and the HTTP server on one uvloop event loop."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from vt.config import EngineConfig
from vt.engine import AsyncEngine
from vt.http.openai_api import OpenAIApp
from vt.http.server import HttpLimits, HttpServer

log = logging.getLogger("vt.serve")


async def serve(cfg: EngineConfig, host: str, port: int, served_model_name: str,
                api_key: str | None, shutdown_timeout: float, limits: HttpLimits | None = None) -> int:
    engine = AsyncEngine(cfg)
    await engine.start()
    app = OpenAIApp(engine, served_model_name, api_key=api_key)
    server = HttpServer(app.handle, limits or HttpLimits())
    app.server = server
    await server.start(host, port)
    shown = f"[{host}]" if ":" in host else host
    print(f"vt: serving {served_model_name} on http://{shown}:{server.port}", flush=True)
    print(f"vt: serving on http://{shown}:{server.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("vt: shutting down", flush=True)
    # Stop accepting, let in-flight requests finish within the timeout, then abort the rest.
    closing = asyncio.create_task(server.close(shutdown_timeout))
    await engine.stop(shutdown_timeout)
    await closing
    return 0


def run_server(cfg: EngineConfig, host: str, port: int, served_model_name: str, api_key: str | None,
               shutdown_timeout: float) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        uvloop = None
    api_key = api_key or os.environ.get("VT_API_KEY") or None
    coro = serve(cfg, host, port, served_model_name, api_key, shutdown_timeout)
    if uvloop is not None:
        return uvloop.run(coro)
    return asyncio.run(coro)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `vt serve`")
