"""`kimik3 serve` refuses an address it cannot listen on before loading anything (one line, status 2), and
leaves quietly on Ctrl-C at any moment."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from kimik3.cli import main
from tests.helpers import free_port

pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")


def test_a_port_in_use_is_one_line(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"kimik3 serve: error: cannot listen on 127.0.0.1:{port}" in err and "in use" in err, err


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_a_port_out_of_range_is_one_line(port, capsys):
    assert main(["serve", "--port", port]) == 2
    assert f"--port {port}: must be in 0..65535" in capsys.readouterr().err


def test_ctrl_c_while_the_model_loads_exits_0_quietly():
    """Ctrl-C as soon as the socket is up (the model still loading in its thread, or just loaded): uvicorn shuts
    down; the process leaves with 0 (a stop asked for), no traceback, no C++ abort from a loader thread caught
    inside torch by interpreter finalization."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # SIGINT as in a terminal: a shell that runs the suite in the background starts it ignored, and an ignored
    # SIGINT is inherited across exec (Python then installs no KeyboardInterrupt handler, as test_signals says)
    proc = subprocess.Popen([sys.executable, "-m", "kimik3", "serve", "--port", str(free_port())], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "Uvicorn running" in line:
            proc.send_signal(signal.SIGINT)
            break
    out = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "terminate called" not in out, out


@pytest.mark.parametrize("flags, says", [
    (["--max-num-seqs", "0"], "--max-num-seqs must be an integer >= 1, got 0"),
    (["--max-model-len", "-5"], "--max-model-len must be an integer >= 2"),
    (["--max-num-batched-tokens", "8"], "--max-num-batched-tokens must be an integer >= 64"),
    (["--max-model-len", "100000"], "--max-model-len 100000 exceeds the model's 4096 positions"),
    (["--threads", "0"], "--threads must be from 1 to"),
])
def test_every_engine_flag_is_checked_before_anything_starts(flags, says, capsys):
    """One error line naming the flag, status 2, before uvicorn starts or the model loads (a bad value used to
    start the server and log a traceback, or was accepted: --max-model-len 100000 on the 4,096-position demo)."""
    assert main(["serve", "--port", str(free_port()), *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
