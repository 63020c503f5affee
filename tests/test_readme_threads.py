"""docs/inference.md's Python inference snippet applies the CPU thread policy: on a busy 2-core machine torch's default
two threads decode the demo model 10-30x slower than one (kimik3.inference.threads)."""

from __future__ import annotations

import torch

from tests.test_readme import PLACEHOLDERS, page_blocks


def test_inference_snippet_runs_a_small_model_on_one_thread(monkeypatch):
    block = next(b for b in page_blocks("docs/inference.md") if b.lang == "python" and "kimik3.load(\"path/to/ckpt\")"
                 in b.code and "generate(" in b.code)
    lines = block.code.splitlines()
    head = "\n".join(lines[:next(i for i, line in enumerate(lines) if line.startswith("tok = ")) + 1])
    for k, v in PLACEHOLDERS.items():
        head = head.replace(k, v)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        exec(compile(head, "docs/inference.md", "exec"), {})
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
