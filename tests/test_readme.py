"""README.md and docs/*.md run: every fenced block is executed, found generically, so a page or section added later
is covered.

    ```python     run as one script
    ```bash       each command line in turn (a line ending in `\\` continues), in one scratch folder per block
    ```text       output: with `<!-- readme: output of COMMAND -->` on the line above, each number it writes with
                  thousands separators must be in COMMAND's output (the block may abridge the table around
                  them); a block without such numbers must appear line by line (whitespace collapsed)
    ```toml       a run-file fragment: valid TOML whose every table and key is one the trainer's run file knows
    any block     opts out only with `<!-- readme: skip, REASON -->` on the line above; the reason is required;
                  `<!-- readme: slow, REASON -->` runs it under `-m slow` only (the default run's time budget)

The README's placeholders are the bundled demo model: `path/to/Kimi-K3`, `path/to/ckpt` -> its folder,
`path/to/tiktoken.model` -> its tokenizer. Blocks run in a scratch folder that links the repository's `configs/`,
`src/` and `tests/` (the README's relative paths) and holds the user files it names (`docs/*.txt`, `more.jsonl`),
so what they write (`out/`, `data/`) stays there. A server line (`--serve`, `kimik3 serve`) runs until it
prints its http:// address, which must answer, and is then stopped with Ctrl-C. Three rewrites keep CI short:
`make X` runs as `make -n X` (a dry run: `make test` is this suite, `make demo`'s command is in the README as its
own block), `kimik3 train` runs stop after 2 steps per run folder (`--stop-at`, the README's own flag: same
schedule, same resume path), and commands see OMP_NUM_THREADS=1.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from kimik3.presets import DEMO_MODEL
from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
PLACEHOLDERS = {"path/to/Kimi-K3": str(DEMO_MODEL), "path/to/ckpt": str(DEMO_MODEL),
                "path/to/tiktoken.model": str(DEMO_MODEL / "tiktoken.model")}
MARKER = re.compile(r"^<!--\s*readme:\s*(skip|output of|slow)\b[,:]?\s*(.*?)\s*-->$")
COMMENT = re.compile(r"\s{2,}#\s.*$")  # a trailing comment: two spaces, then `# `
TRAIN_STEPS = 2
SERVER = re.compile(r"--serve\b|\bkimik3 serve\b")  # lines that run until stopped
BIG_NUMBER = re.compile(r"\b\d{1,3}(?:,\d{3})+\b")  # 2,779,931,837,184: the figures an output block quotes


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: tuple[str, str] | None  # ("skip", reason), ("slow", reason) or ("output of", command)
    page: str = "README.md"  # the file, relative to the repository

    @property
    def id(self) -> str:
        return f"{Path(self.page).stem}-{self.lang or 'plain'}-L{self.line}"

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(text: str, page: str = "README.md") -> list[Block]:
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(`{3,})(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, fence = i, m.group(1)
        i += 1
        while i < len(lines) and lines[i].strip() != fence:
            i += 1
        if i == len(lines):
            raise ValueError(f"{page}:{start + 1}: unclosed code fence")
        prev = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mm = MARKER.match(prev)
        out.append(Block(start + 1, m.group(2), "\n".join(lines[start + 1:i]) + "\n",
                         (mm.group(1), mm.group(2)) if mm else None, page))
        i += 1
    return out


BLOCKS = [b for page in PAGES for b in blocks(page.read_text(encoding="utf-8"), str(page.relative_to(REPO)))]


def page_blocks(name: str) -> list[Block]:
    """The blocks of one page (`README.md`, `docs/model.md`)."""
    return [b for b in BLOCKS if b.page == name]


def of(kind: str) -> list:
    """The blocks of a kind that run (a `slow` one as a param marked slow)."""
    if kind == "text":
        return [b for b in BLOCKS if b.marker and b.marker[0] == "output of"]
    return [pytest.param(b, marks=pytest.mark.slow, id=b.id) if b.marker else b for b in BLOCKS
            if b.lang == kind and (b.marker is None or b.marker[0] == "slow")]


def substitute(code: str, where: str) -> str:
    for k, v in PLACEHOLDERS.items():
        code = code.replace(k, v)
    assert "path/to/" not in code, f"{where}: a placeholder this test does not know: {code}"
    return code


def env() -> dict:
    bin_dir = str(Path(sys.executable).parent)  # kimik3, torchrun: the interpreter's own scripts
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}


def scratch(tmp_path: Path) -> Path:
    for name in ("configs", "src", "tests"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / "docs").mkdir()
    for i, text in enumerate(("ROMEO:\nBut soft, what light through yonder window breaks?\n",
                              "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo?\n")):
        (tmp_path / "docs" / f"scene{i}.txt").write_text(text)
    (tmp_path / "more.jsonl").write_text('{"text": "NURSE:\\nAnon, anon!"}\n{"text": "FRIAR:\\nThese violent '
                                         'delights have violent ends."}\n')
    return tmp_path


def run(cmd: str, cwd: Path, where: str, **kw) -> str:
    r = subprocess.run(cmd, shell=True, executable="/bin/bash", cwd=cwd, env=env(), stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=300, **kw)
    assert r.returncode == 0, f"{where}: `{cmd}` exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def serve(cmd: str, cwd: Path, where: str) -> None:
    """A server line (`--serve`, `kimik3 serve`): run it until it prints its http:// address, fetch that address
    (any HTTP answer counts: it serves), then stop it with Ctrl-C as a person would. The README's port is swapped
    for a free one, so a busy port on the machine cannot fail the test."""
    port = str(free_port())
    cmd = re.sub(r"--port[ =]\d+", f"--port {port}", cmd) if "--port" in cmd else f"{cmd} --port {port}"
    proc = subprocess.Popen(cmd, shell=True, executable="/bin/bash", cwd=cwd, env=env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any("http://" in line for line in lines):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        url = next((re.search(r"http://\S+", line).group(0) for line in lines if "http://" in line), None)
        assert url, f"{where}: `{cmd}` printed no http:// address (exit {proc.poll()}):\n{''.join(lines)[-3000:]}"
        try:
            urllib.request.urlopen(url, timeout=30).close()
        except urllib.error.HTTPError:
            pass
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def commands(code: str) -> list[str]:
    """The block's command lines: comments dropped, `\\` continuations joined."""
    out, pending = [], ""
    for raw in code.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = COMMENT.sub("", line)
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    return out


def shortened(cmd: str, steps: dict[str, int]) -> str:
    """`kimik3 train` (not --prepare) stops TRAIN_STEPS later than this run folder's last stop."""
    if not re.search(r"\bkimik3 train\b", cmd) or "--prepare" in cmd:
        return cmd
    folder = re.search(r"out_dir=\S+", cmd)
    key = folder.group(0) if folder else ""
    steps[key] = steps.get(key, 0) + TRAIN_STEPS
    return re.sub(r"\s--stop-at \d+", "", cmd) + f" --stop-at {steps[key]}"


def test_every_block_runs_or_says_why_not():
    assert {b.page for b in BLOCKS} >= {"README.md", "docs/model.md", "docs/training.md"}, "pages without blocks"
    for b in BLOCKS:
        where = b.where
        if b.marker and b.marker[0] in ("skip", "slow"):
            assert len(b.marker[1].split()) >= 3, f"{where}: a {b.marker[0]} block needs its reason ({b.marker[0]}, "\
                "REASON)"
            assert b.marker[0] == "skip" or b.lang in ("python", "bash"), f"{where}: only python and bash run slow"
        elif b.marker:
            assert b.lang == "text" and b.marker[1], f"{where}: an output block is ```text with its command"
        else:
            assert b.lang in ("python", "bash", "toml"), (
                f"{where}: ```{b.lang} is neither run nor marked: use python, bash, toml, ```text with an output "
                "marker, or a skip with a reason")


@pytest.mark.parametrize("block", of("python"), ids=lambda b: b.id)
def test_python_block(block, tmp_path):
    where = block.where
    cwd = scratch(tmp_path)
    (cwd / "block.py").write_text(substitute(block.code, where))
    run(f"{sys.executable} block.py", cwd, where)


@pytest.mark.parametrize("block", of("bash"), ids=lambda b: b.id)
def test_bash_block(block, tmp_path):
    where = block.where
    cwd, steps = scratch(tmp_path), {}
    cmds = commands(substitute(block.code, where))
    assert cmds, f"{where}: a bash block without commands"
    for cmd in cmds:
        if cmd.startswith("make "):
            run(f"make -n {cmd.removeprefix('make ')}", REPO, where)
        elif SERVER.search(cmd):
            serve(cmd, cwd, where)
        else:
            run(shortened(cmd, steps), cwd, where)


@pytest.mark.parametrize("block", of("text"), ids=lambda b: b.id)
def test_output_block(block, tmp_path):
    where = block.where
    out = run(substitute(block.marker[1].strip("`"), where), scratch(tmp_path), where)
    numbers = BIG_NUMBER.findall(block.code)
    wanted = numbers or [" ".join(line.split()) for line in block.code.splitlines() if line.strip()]
    found = set(BIG_NUMBER.findall(out)) if numbers else " ".join(out.split())
    missing = [w for w in wanted if w not in found]
    assert not missing, f"{where}: not in the output of {block.marker[1]}: {missing}\n{out[-3000:]}"


@pytest.mark.parametrize("block", of("toml"), ids=lambda b: b.id)
def test_toml_block(block):
    """A run-file fragment parses, and names only tables and keys the run file has (a renamed key fails here)."""
    import dataclasses
    import typing

    import tomllib

    from kimik3.train.config import TrainConfig

    doc = tomllib.loads(block.code)
    hints = typing.get_type_hints(TrainConfig)
    for name, value in doc.items():
        assert name in hints and name != "source", f"{block.where}: no [{name}] in a run file"
        if not isinstance(value, dict):
            continue
        section = next(a for a in (*typing.get_args(hints[name]), hints[name]) if dataclasses.is_dataclass(a))
        known = {f.name for f in dataclasses.fields(section)}
        assert set(value) <= known, f"{block.where}: [{name}] has no key {sorted(set(value) - known)}"
