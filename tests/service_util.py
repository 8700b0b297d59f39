"""What the fixtures that start real servers on 127.0.0.1 share: waiting for one to come up."""

from __future__ import annotations

import subprocess
import time
from typing import Callable


def wait_until_ready(proc: subprocess.Popen, ready: Callable[[], bool], timeout: float, poll_s: float) -> bool:
    """True once ``ready()`` holds; False if ``proc`` exited first or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if ready():
            return True
        time.sleep(poll_s)
    return False
