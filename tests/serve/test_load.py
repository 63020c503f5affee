"""An independent load generator (bench/bench_serve.py's aiohttp closed loop, its own process) against the real
`kimik3 serve` CLI on the demo model, at concurrency 1, 2, 4 and 8 for a fixed time each: no request fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.slow  # a server process and a load generator, ~15 s on a CPU
def test_load_at_concurrency_1_2_4_8_has_no_failures(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(tmp_path),
           "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"}
    proc = subprocess.run([sys.executable, "bench/bench_serve.py", "--smoke"], cwd=REPO, env=env, check=False,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "bench_serve_smoke.json").read_text())["results"]
    assert sorted(results) == [f"http c={c}" for c in (1, 2, 4, 8)]
    for r in results.values():
        assert r["failed"] == 0 and r["requests"] >= 1 and r["output_tokens"] == 6 * r["requests"]
