"""`kimik3 --version`, and every subcommand's --help names its defaults."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

import kimik3
from kimik3.cli import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"kimik3 {kimik3.__version__}"


@pytest.mark.parametrize("command", [m.__name__.rsplit(".", 1)[1] for m in COMMANDS])
def test_help_shows_defaults(command):
    """Each option with a default worth naming (not None, not an off switch) says it in --help."""
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    fmt = sub._get_formatter()
    missing = [a.option_strings[0] for a in sub._actions if a.help and a.option_strings
               and a.default not in (None, False, argparse.SUPPRESS)
               and "default" not in fmt._expand_help(a).lower()]
    assert not missing, (command, missing)


def test_serve_help_names_engine_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert "(default: 64)" in out and "(default: 2048)" in out


def test_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
