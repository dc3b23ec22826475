"""TensorBoard itself, started on a logdir for a script or a test, and its HTTP routes
read as its web page reads them (gzip-encoded JSON, POSTs with TensorBoard's
XSRF header)."""

from __future__ import annotations

import gzip
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetch(url: str, body: dict | None = None, timeout: float = 60) -> bytes:
    """The body of a GET (or a JSON POST where `body` is given), decompressed."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data)
    if body is not None:
        request.add_header("Content-Type", "application/json")
    request.add_header("X-XSRF-Protected", "1")  # TensorBoard refuses a POST without it
    with urllib.request.urlopen(request, timeout=timeout) as response:
        payload = response.read()
        gzipped = response.headers.get("Content-Encoding") == "gzip"
    return gzip.decompress(payload) if gzipped else payload


def get_json(url: str, body: dict | None = None, timeout: float = 60):
    return json.loads(fetch(url, body, timeout))


def wait_for(url: str, seconds: float = 90) -> bytes:
    """`fetch(url)` once it answers (a server still starting refuses the connection)."""
    deadline = time.time() + seconds
    while True:
        try:
            return fetch(url, timeout=5)
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


def start(logdir: str | Path, seconds: float = 90) -> tuple[subprocess.Popen, str]:
    """`tensorboard --logdir` on a free local port, and its base URL once it answers
    (RuntimeError with its output if it exits or stays silent)."""
    port = free_port()
    server = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "tensorboard"),
            f"--logdir={logdir}",
            f"--port={port}",
            "--host=127.0.0.1",
            "--load_fast=false",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(f"{base}/data/plugins_listing", seconds)
    except OSError:
        server.kill()
        output = server.communicate()[0][-2000:]
        raise RuntimeError(f"tensorboard did not start: {output}") from None
    return server, base
