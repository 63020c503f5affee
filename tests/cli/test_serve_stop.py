"""Stopping `kimik3 serve` with a stream in flight (Ctrl-C): the first SIGINT ends the requests in flight (a stream
gets an error event, then [DONE]) and the process exits 0 after a bounded drain, without a traceback or an abort
("terminate called without an active exception"); a second SIGINT during the drain changes none of that."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.helpers import REPO, free_port


def test_ctrl_c_ends_the_stream_in_flight_and_exits_0():
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"}
    proc = subprocess.Popen([sys.executable, "-m", "kimik3", "serve", "--port", str(port), "--device", "cpu",
                             "--no-warmup", "--shutdown-timeout", "5"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        body = {"prompt": "ROMEO:", "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 5:  # tokens are flowing: stop the server
                    proc.send_signal(signal.SIGINT)
                if '"error"' in line:  # the stream was ended: a second Ctrl-C, impatient, during the drain
                    proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    events = [x for x in lines if x.startswith("data: ")]
    assert any('"error"' in x and "shutting down" in x for x in events), events[-3:]
    assert events[-1] == "data: [DONE]" and len(events) < 100
    assert rc == 0, err[-2000:]
    assert "Traceback" not in err and "terminate called" not in err, err[-2000:]
