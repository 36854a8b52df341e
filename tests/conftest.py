"""Test-suite settings.

Hypothesis profiles: ``ci`` (default) keeps the property tests to a bounded sample;
``HYPOTHESIS_PROFILE=thorough python -m pytest tests/test_config_properties.py`` runs
ten thousand examples per property.  Long fault-injection loops are marked ``slow`` and
left out by default: ``python -m pytest -m slow`` runs them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

S3_BUCKET = "fsdp-bridge-test"
"""The bucket the ``s3_env`` fixture creates on its server."""

settings.register_profile("ci", max_examples=800)
settings.register_profile("thorough", max_examples=10_000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    """moto's S3 server on 127.0.0.1 (a free port) with the bucket ``S3_BUCKET``, and the environment
    that points s3fs (any S3 client) at it: set for the module's tests, restored after; the server
    is stopped at the end.  moto[server] and s3fs are in the test extra: missing, this fails."""
    import s3fs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        os.environ.update(env)
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir(S3_BUCKET)
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        s3fs.S3FileSystem.clear_instance_cache()
        server.terminate()
        server.wait(timeout=30)
