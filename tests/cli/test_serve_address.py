"""`kimik3 serve` refuses an address it cannot listen on before loading anything: one line, status 2."""

import socket

import pytest

from kimik3.cli import main

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
