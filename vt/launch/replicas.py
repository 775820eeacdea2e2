"""`vt replicas`: N `vt serve` replicas on one machine behind the vLLM router (pip's vllm-router).

vt writes no router of its own. This module starts the replicas (CPU, or one GPU each through
CUDA_VISIBLE_DEVICES), waits until each serves, then starts the router on them with health
checks and the chosen policy (cache_aware by default: prefix-aware, so requests that share a
prompt prefix meet that prefix's KV cache), and stops everything on SIGINT or SIGTERM. The same
classes serve the multi-replica tests, which kill and restart replicas under load.

    vt replicas --model /models/Qwen3-8B --num-replicas 4 --device cuda --port 8000 -- --max-num-seqs 128
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

from vt.launch.subprocesses import terminate

READY = re.compile(r"vt: serving on (http://\S+)")
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "consistent_hash")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The status of GET url, None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return None


@dataclass
class Process:
    """A child process whose output is collected by a thread (a silent child cannot stall us)."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    echo: bool = False
    proc: subprocess.Popen | None = None
    lines: list[str] = field(default_factory=list)
    _lines_q: queue.Queue = field(default_factory=queue.Queue)

    def start(self) -> None:
        self.lines = []
        self._lines_q = queue.Queue()
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env, start_new_session=True)
        threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines_q), daemon=True).start()

    def _pump(self, stream, q: queue.Queue) -> None:
        for line in stream:
            self.lines.append(line)
            q.put(line)
            if self.echo:
                sys.stdout.write(f"[{self.name}] {line}")
                sys.stdout.flush()
        q.put(None)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_line(self, pattern: re.Pattern, timeout: float) -> re.Match:
        """The first output line matching pattern; RuntimeError if the child exits or times out."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._lines_q.get(timeout=max(0.01, left))
            except queue.Empty:
                line = ""
            if line is None or left <= 0:
                what = "exited" if line is None else f"printed no {pattern.pattern!r} within {timeout:.0f} s"
                raise RuntimeError(f"{self.name} {what}; output:\n{self.output()}")
            m = pattern.search(line)
            if m:
                return m

    def signal(self, sig: int) -> None:
        if self.running:
            self.proc.send_signal(sig)

    def stop(self, timeout: float) -> int | None:
        """SIGTERM, wait up to timeout, then SIGKILL; the exit code."""
        return None if self.proc is None else terminate(self.proc, timeout)

    def output(self) -> str:
        return "".join(self.lines[-200:])


HEALTH_CHECK_TIMEOUT_S = 2
RETRY_FIRST_BACKOFF_MS, RETRY_BACKOFF_FACTOR, RETRY_MAX_BACKOFF_MS, RETRY_JITTER = 100, 1.5, 1000, 0.2


def retry_args(health_check_interval_s: int) -> tuple[str, ...]:
    """vllm-router retry flags whose backoffs add up to more than one failed health check (the
    interval, its timeout and a second more). A replica that drains answers 503 at once, but the
    router keeps routing to it until a health check fails; cache-aware routing may pick it again
    on every retry, so a shorter budget (the router's default is about 0.7 s) can fail a request
    in that window."""
    budget_ms = (health_check_interval_s + HEALTH_CHECK_TIMEOUT_S + 1) * 1000
    retries, total, backoff = 0, 0.0, float(RETRY_FIRST_BACKOFF_MS)
    while total * (1 - RETRY_JITTER) < budget_ms:  # the router's jitter may shorten each wait
        total += backoff
        backoff = min(backoff * RETRY_BACKOFF_FACTOR, RETRY_MAX_BACKOFF_MS)
        retries += 1
    return ("--retry-max-retries", str(retries + 1),  # the router counts the first attempt
            "--retry-initial-backoff-ms", str(RETRY_FIRST_BACKOFF_MS),
            "--retry-backoff-multiplier", str(RETRY_BACKOFF_FACTOR),
            "--retry-max-backoff-ms", str(RETRY_MAX_BACKOFF_MS), "--retry-jitter-factor", str(RETRY_JITTER))


@dataclass(frozen=True)
class ReplicaSetConfig:
    model: str
    num_replicas: int = 2
    host: str = "127.0.0.1"
    port: int = 8000                    # the router's
    replica_ports: tuple[int, ...] = ()  # default: free ports
    device: str = "cpu"                 # cpu | cuda (replica i sees GPU i only)
    policy: str = "cache_aware"
    serve_args: tuple[str, ...] = ()    # more `vt serve` flags, the same for every replica
    router_args: tuple[str, ...] = ()   # more vllm-router flags
    health_check_interval_s: int = 1
    start_timeout_s: float = 300.0
    echo: bool = False

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"--num-replicas must be at least 1, got {self.num_replicas}")
        if self.replica_ports and len(self.replica_ports) != self.num_replicas:
            raise ValueError(f"{len(self.replica_ports)} replica ports for {self.num_replicas} replicas")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.health_check_interval_s < 1:
            raise ValueError("--health-check-interval must be at least 1 second")


class ReplicaSet:
    """The replicas and the router in front of them; a context manager that stops them all."""

    def __init__(self, cfg: ReplicaSetConfig) -> None:
        self.cfg = cfg
        ports = cfg.replica_ports or tuple(free_port(cfg.host) for _ in range(cfg.num_replicas))
        self.replicas = [self._replica(i, port) for i, port in enumerate(ports)]
        self.routers: list[Process] = []
        self.router_urls: list[str] = []

    @property
    def replica_urls(self) -> list[str]:
        return [self._url(p) for p in self._ports]

    @property
    def _ports(self) -> list[int]:
        return [int(r.cmd[r.cmd.index("--port") + 1]) for r in self.replicas]

    def _url(self, port: int) -> str:
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        return f"http://{host}:{port}"

    def _replica(self, i: int, port: int) -> Process:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.cfg.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        cmd = [sys.executable, "-m", "vt", "serve", "--model", self.cfg.model, "--host", self.cfg.host,
               "--port", str(port), "--device", self.cfg.device, *self.cfg.serve_args]
        return Process(f"replica-{i}", cmd, env, self.cfg.echo)

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every replica, wait until all serve, then start the router and wait for it."""
        for r in self.replicas:
            r.start()
        for r in self.replicas:
            r.wait_line(READY, self.cfg.start_timeout_s)
        self.start_router(self.cfg.port, self.cfg.policy)

    def start_router(self, port: int, policy: str) -> str:
        """Start one more router (on `port`, 0 for a free one) over all replicas; its URL."""
        port = port or free_port(self.cfg.host)
        cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", self.cfg.host,
               "--port", str(port), "--worker-urls", *self.replica_urls, "--policy", policy,
               # health checks every second: a dead or draining replica leaves the rotation fast
               "--health-check-interval-secs", str(self.cfg.health_check_interval_s),
               "--health-failure-threshold", "1", "--health-success-threshold", "1",
               "--health-check-timeout-secs", str(HEALTH_CHECK_TIMEOUT_S),
               *retry_args(self.cfg.health_check_interval_s),
               "--prometheus-host", self.cfg.host, "--prometheus-port", str(free_port(self.cfg.host)),
               "--log-level", "warning", *self.cfg.router_args]
        router = Process(f"router-{policy}", cmd, dict(os.environ), self.cfg.echo)
        router.start()
        self.routers.append(router)
        url = self._url(port)
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while http_status(f"{url}/health") != 200:
            if not router.running:
                raise RuntimeError(f"the router exited; output:\n{router.output()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router was not healthy within {self.cfg.start_timeout_s:.0f} s; "
                                   f"output:\n{router.output()}")
            time.sleep(0.2)
        self.router_urls.append(url)
        return url

    def restart(self, i: int, timeout: float = 60.0) -> None:
        """Rolling restart of replica i: SIGTERM (it drains), wait for its exit, start it again on
        the same port and wait until it serves."""
        r = self.replicas[i]
        r.stop(timeout)
        r.start()
        r.wait_line(READY, self.cfg.start_timeout_s)

    def stop(self, timeout: float = 30.0) -> None:
        for p in self.routers:
            p.stop(10.0)
        for r in self.replicas:
            r.signal(signal.SIGTERM)
        for r in self.replicas:
            r.stop(timeout)

    def __enter__(self) -> ReplicaSet:
        try:
            self.start()
        except BaseException:
            self.stop(5.0)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- `vt replicas` ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vt replicas", description=__doc__.split("\n\n")[0],
                                epilog="Flags after `--` go to every `vt serve`.")
    p.add_argument("--model", default=None, help="checkpoint folder (default: the built-in tiny demo model)")
    p.add_argument("--num-replicas", type=int, default=2)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the router's port")
    p.add_argument("--replica-ports", type=int, nargs="+", default=None,
                   help="one port per replica (default: free ports)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: replica i runs on GPU i")
    p.add_argument("--policy", default="cache_aware", choices=POLICIES)
    p.add_argument("--health-check-interval", type=int, default=1,
                   help="seconds between router health checks")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="one more vllm-router argument (repeat)")
    return p


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    serve_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_args = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    try:
        import vllm_router  # noqa: F401
    except ImportError:
        print("vt: error: the router is not installed: pip install 'vt[router]'", file=sys.stderr)
        return 1
    model = args.model
    if model is None:
        from vt.model.make_model import default_model_dir

        model = str(default_model_dir())
    try:
        cfg = ReplicaSetConfig(model=model, num_replicas=args.num_replicas, host=args.host, port=args.port,
                               replica_ports=tuple(args.replica_ports or ()), device=args.device,
                               policy=args.policy, serve_args=tuple(serve_args),
                               router_args=tuple(args.router_arg),
                               health_check_interval_s=args.health_check_interval, echo=True)
    except ValueError as e:
        print(f"vt: error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    replicas = ReplicaSet(cfg)
    try:
        replicas.start()
    except (RuntimeError, OSError) as e:
        replicas.stop(5.0)
        print(f"vt: error: {e}", file=sys.stderr)
        return 1
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    print(f"vt: router ({cfg.policy}) on http://{host}:{cfg.port} over {', '.join(replicas.replica_urls)}",
          flush=True)
    exited: set[str] = set()
    try:
        while not stop.wait(1.0):
            for r in replicas.replicas:
                if not r.running and r.name not in exited:
                    # the router takes it out of the rotation; a supervisor (Kubernetes) would restart it
                    exited.add(r.name)
                    print(f"vt: {r.name} exited with code {r.proc.returncode}", flush=True)
    finally:
        print("vt: stopping the router and the replicas", flush=True)
        replicas.stop()
    return 0
