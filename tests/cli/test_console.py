"""The installed `kimik3` script (`kimik3.cli.console`): a Ctrl-C at any moment of the process exits 130, also
after the command has returned (the interpreter's teardown), never by the signal itself."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import REPO

LATE = textwrap.dedent("""
    import os, signal, sys, time
    import kimik3.cli as cli
    cli.main = lambda argv=None: {code}     # the command has run and returned
    code = cli.console()
    os.kill(os.getpid(), signal.SIGINT)     # Ctrl-C during what follows (teardown)
    time.sleep(30)
    sys.exit(code)
""")
EARLY = textwrap.dedent("""
    import kimik3.cli as cli
    def main(argv=None):
        raise KeyboardInterrupt             # before main's own handler is in place (parsing, imports)
    cli.main = main
    raise SystemExit(cli.console())
""")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env={"PYTHONPATH": str(REPO / "src")},
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("code", [0, 2])
def test_ctrl_c_after_the_command_exits_130(code):
    r = _python(LATE.format(code=code))
    assert r.returncode == 130 and r.returncode != -signal.SIGINT, r.stderr
    assert "Traceback" not in r.stderr


def test_ctrl_c_before_the_command_exits_130():
    r = _python(EARLY)
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr


def test_the_script_and_python_m_run_console():
    import tomllib

    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["kimik3"] == "kimik3.cli:console"
    assert "console()" in (REPO / "src/kimik3/__main__.py").read_text()
