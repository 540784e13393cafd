import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.operator.emulator import Emulator


def eventually(check, timeout: float = 30.0, interval: float = 0.1):
    """Poll `check` until it returns a truthy value (the value is returned) or time runs out."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (KeyError, TypeError, IndexError) as e:  # the object is not there yet
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s; last: {last!r}")


@pytest.fixture(scope="module")
def namespace():
    return "default"


@pytest.fixture(scope="module")
def controllers_are_emulated():
    """kmock runs no controllers: the tests write what they would (e.g. Deployment status)."""
    return True


@pytest.fixture(scope="module")
def emulator():
    with Emulator() as e:
        yield e


class OperatorProcess:
    """`python -m embedop`, the real entry point, pointed at the emulator by a kubeconfig."""

    def __init__(self, kubeconfig: Path, log: Path, env: dict | None = None, namespace: str | None = None,
                 python: str = sys.executable):
        self.log_path = log
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            [python, "-m", "embedop", "--verbose", *(["--namespace", namespace] if namespace else [])],
            # A short lease: an operator killed without a goodbye is followed within 3 s, not 15.
            env={**os.environ, "KUBECONFIG": str(kubeconfig), "EMBEDOP_RESYNC_SECONDS": "2",
                 "EMBEDOP_API_TIMEOUT_S": "1", "EMBEDOP_LEASE_SECONDS": "3", **(env or {})},
            stdout=self._log, stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @contextlib.contextmanager
    def running(self, *servers):
        """The operator's last log lines shown when an assertion fails inside; then it is stopped,
        and `servers` (the tests' stand-in pods) shut down."""
        try:
            yield self
        except AssertionError:
            print(self.log()[-3000:])
            raise
        finally:
            self.stop()
            for server in servers:
                server.shutdown()

    def stop(self) -> int:
        self.proc.terminate()
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._log.close()
        return code


@pytest.fixture(scope="module")
def operator(emulator, tmp_path_factory):
    d = tmp_path_factory.mktemp("operator")
    op = OperatorProcess(emulator.kubeconfig(d / "kubeconfig"), d / "operator.log")
    yield op
    op.stop()
