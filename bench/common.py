"""What every benchmark does with its figures (print the JSON, and write it where asked), and the local
stack the live benchmarks run (``dls up`` until it serves, then stopped with Ctrl-C)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path


def emit_json(result: dict, path: str | Path | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")


def launch_stack(argv: list[str], env: dict[str, str], log_path: Path, url: str,
                 timeout_s: float = 240.0) -> subprocess.Popen:
    """``dls up`` (``argv``), its output in ``log_path``, once the gateway at ``url`` serves (a worker is up);
    ``RuntimeError`` when it exits or is not ready in ``timeout_s``."""
    log = open(log_path, "wb")  # noqa: SIM115 (the child keeps it)
    process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"dls up exited ({process.returncode}); see {log_path}")
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as reply:
                if reply.status == 200 and json.loads(reply.read())["serving"]:
                    return process
        except OSError:
            pass
        time.sleep(1.0)
    process.send_signal(signal.SIGINT)
    raise RuntimeError(f"the stack was not ready in {timeout_s:.0f} s; see {log_path}")


def stop_stack(process: subprocess.Popen) -> None:
    """Ctrl-C, as a person stops ``dls up``: it stops each service in turn (workers drain first)."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(300)
    except subprocess.TimeoutExpired:
        process.kill()
