"""Podman for the image tests: installed from Debian's packages where missing, with the settings a
sandboxed host needs (runc, cgroupfs, no default ulimits), a Debian rootfs from mmdebstrap standing in
for the CUDA base, the image built from the repository's Dockerfile as it is, and containers run from
it on a host-only network (they reach nothing outside the machine)."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("podman", "buildah", "runc", "mmdebstrap")
# crun refuses to start containers in this kind of sandbox and systemd is absent: runc, cgroupfs,
# and no default ulimits (the host's hard limits are below podman's defaults)
CONTAINERS_CONF = '[containers]\ndefault_ulimits = []\n\n[engine]\ncgroup_manager = "cgroupfs"\n'
BASE_IMAGE = "localhost/vt-test-base:bookworm"
CONTAINER_PORT = 8000


class Unavailable(Exception):
    """This machine cannot build or run the image; the message says why."""


def ensure_tools() -> None:
    """podman, runc and mmdebstrap on PATH, installed with apt-get where they are missing."""
    missing = [p for p in PACKAGES if not (shutil.which(p) or shutil.which(p, path="/usr/sbin:/sbin"))]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise Unavailable(f"{', '.join(missing)} missing and not installable here (needs root and apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise Unavailable(f"`{' '.join(cmd)}` failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def host_ca_bundle() -> str | None:
    """The host's CA bundle, lent to the build so that pip trusts what the host trusts (a proxy's CA)."""
    for candidate in (os.environ.get("SSL_CERT_FILE"), ssl.get_default_verify_paths().cafile,
                      "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


class Podman:
    """`podman --runtime runc` with this module's containers.conf; one host-only network per session."""

    def __init__(self, workdir: Path) -> None:
        if os.geteuid() != 0:
            # rootless podman keeps container addresses in its own namespace, out of the host's reach
            raise Unavailable("the image tests run rootful podman (run them as root)")
        conf = workdir / "containers.conf"
        conf.write_text(CONTAINERS_CONF)
        self.env = dict(os.environ, CONTAINERS_CONF=str(conf))
        self.network = f"vt-test-{os.getpid()}"

    def __call__(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(["podman", "--runtime", "runc", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"podman {' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}"
                               f"{done.stderr[-3000:]}")
        return done

    def ensure_base(self, workdir: Path) -> str:
        """A minimal Debian bookworm image (made once per machine, then reused)."""
        if self("image", "exists", BASE_IMAGE, check=False).returncode == 0:
            return BASE_IMAGE
        tar = workdir / "base.tar"
        done = subprocess.run(["mmdebstrap", "--variant=minbase", "--include=ca-certificates", "bookworm",
                               str(tar)], capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise Unavailable(f"mmdebstrap failed:\n{done.stderr[-3000:]}")
        self("import", str(tar), BASE_IMAGE, timeout=300)
        tar.unlink()
        return BASE_IMAGE

    def check_runs(self, image: str) -> None:
        """Raise Unavailable where this host cannot start a container at all."""
        done = self("run", "--rm", "--network=none", image, "true", check=False, timeout=120)
        if done.returncode != 0:
            raise Unavailable(f"podman cannot run a container here:\n{done.stderr[-3000:]}")

    def build(self, context: Path, base: str, tag: str, log: Path) -> None:
        """The Dockerfile as it is, on `base`; docker format, which keeps HEALTHCHECK (OCI drops it)."""
        args = ["build", "--format", "docker", "--network=host", "--build-arg", f"BASE_IMAGE={base}",
                "-t", tag]
        ca = host_ca_bundle()
        if ca:
            args += ["-v", f"{ca}:/etc/ssl/certs/ca-certificates.crt:ro"]
        done = self(*args, str(context), timeout=1800, check=False)
        output = done.stdout + done.stderr
        log.write_text(output)
        if done.returncode != 0:
            raise RuntimeError(f"the image did not build (log: {log}):\n{output[-4000:]}")

    def create_network(self) -> None:
        # a session killed before its teardown leaves its network: remove those whose process is gone
        for name in self("network", "ls", "--format", "{{.Name}}").stdout.split():
            pid = name.removeprefix("vt-test-")
            if name.startswith("vt-test-") and pid.isdigit() and not Path(f"/proc/{pid}").exists():
                self("network", "rm", "-f", name, check=False)
        # --internal: no route out, so serving is shown to need no network; the host still reaches it
        self("network", "create", "--internal", self.network)

    def remove_network(self) -> None:
        self("network", "rm", "-f", self.network, check=False)

    def start(self, image: str, name: str, args: list[str],
              volumes: dict[Path, str] | None = None) -> Container:
        """Run the image detached, as `docker run [-v ...] IMAGE ARGS...` would."""
        mounts = [a for host, inside in (volumes or {}).items() for a in ("-v", f"{host}:{inside}:ro")]
        self("run", "-d", "--name", name, "--network", self.network, *mounts, image, *args)
        return Container(self, name)


@dataclass
class Container:
    podman: Podman
    name: str

    def inspect(self) -> dict:
        return json.loads(self.podman("inspect", self.name).stdout)[0]

    @property
    def url(self) -> str:
        [net] = self.inspect()["NetworkSettings"]["Networks"].values()
        return f"http://{net['IPAddress']}:{CONTAINER_PORT}"

    def logs(self) -> str:
        done = self.podman("logs", self.name, check=False)
        return done.stdout + done.stderr

    def running(self) -> bool:
        return self.inspect()["State"]["Running"]

    def wait_exit(self, timeout: float) -> int:
        return int(self.podman("wait", self.name, timeout=timeout).stdout.strip())

    def wait_healthy(self, timeout: float = 120) -> str:
        """The base URL once /health answers 200; RuntimeError with the logs if it never does."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running():
                raise RuntimeError(f"container {self.name} exited:\n{self.logs()}")
            url = self.url
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        return url
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"container {self.name} not healthy after {timeout:.0f} s:\n{self.logs()}")

    def remove(self) -> None:
        self.podman("rm", "-f", "-v", "-t", "0", self.name, check=False)  # -v: its anonymous /models too
