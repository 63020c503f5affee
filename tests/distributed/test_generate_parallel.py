"""`torchrun ... kimik3 generate --parallel tp|ep` on the bundled demo model: 2 gloo ranks print exactly what one
process prints (greedy, and sampled with a seed), and only once.

EP keeps every sum of one process (logits bit-identical in bf16). TP adds row-parallel partial sums: in bf16 the
demo's logits move by 2.3e-3 relative (measured), enough to change a sampled token, so TP is compared in fp32."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kimik3.cli import main
from tests.helpers import REPO, free_port

ARGS = ["--prompt", "ROMEO:", "--max-new-tokens", "16", "--device", "cpu"]



@pytest.mark.parametrize("parallel, dtype", [("tp", "float32"), ("ep", "bfloat16")])
@pytest.mark.parametrize("sampling", [["--temperature", "0"], ["--seed", "3"]], ids=["greedy", "seeded"])
def test_two_ranks_print_what_one_process_prints(parallel, dtype, sampling, capsys):
    args = [*ARGS, "--dtype", dtype, *sampling]
    assert main(["generate", *args]) == 0
    want = capsys.readouterr().out
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "kimik3", "generate", *args, "--parallel", parallel]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == want


def test_parallel_without_torchrun_is_refused(capsys):
    assert main(["generate", *ARGS, "--parallel", "tp"]) == 2
    assert "torchrun" in capsys.readouterr().err


def test_expert_parallel_ranks_with_tiered_experts_print_what_one_process_prints(capsys):
    """Each rank keeps its 8 of 16 experts a layer in two tiers (one slot, misses copied): the text of one process
    with every expert resident."""
    args = [*ARGS, "--dtype", "bfloat16", "--temperature", "0"]
    assert main(["generate", *args]) == 0
    want = capsys.readouterr().out
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "kimik3", "generate", *args, "--parallel", "ep", "--cpu-offload-gb", "0.0015",
           "--expert-misses", "copy"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == want
