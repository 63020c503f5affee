"""The streaming load's peak memory is the model plus about one tensor, measured in a fresh process."""

import json
import subprocess
import sys

import pytest
import torch

from kimik3.checkpoint import save
from kimik3.config import K3Config
from kimik3.model import K3ForConditionalGeneration
from tests.helpers import CONFIGS

# torch's own: ~40 MB of modules (sympy among them) imported lazily by the first meta -> real allocation, and
# the few temporaries of a cast or decode. Measured: 59 MB over the model, one largest tensor (17 MB) included.
# A loader that held a second copy of the weights (+120 MB), or a shard's mapped pages while reading it (+120 MB
# for the one-shard checkpoint: what safe_open's default mmap backend does), fails.
ALLOWANCE = 80 * 2**20

# Runs in the child: reset the peak-RSS mark after the imports, load, report the peak growth.
CHILD = """
import json, sys, time
from kimik3.checkpoint import load

def status(key):
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ':'))

try:
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')  # resets VmHWM to the current RSS
    before = status('VmRSS')
except OSError:  # not allowed here: growth of the peak past the imports' own peak
    before = status('VmHWM')
t0 = time.perf_counter()
model = load(sys.argv[1])
seconds = time.perf_counter() - t0
state = model.state_dict().values()
print(json.dumps({"peak_growth": status('VmHWM') - before, "seconds": seconds,
                  "model_bytes": sum(t.numel() * t.element_size() for t in state),
                  "largest": max(t.numel() * t.element_size() for t in state)}))
"""


def _big_config() -> K3Config:
    """The tiny config widened so the weights are ~130 MB (bf16) in many medium tensors."""
    hf = json.loads((CONFIGS / "tiny.json").read_text())
    del hf["vision_config"]
    hf["text_config"].update(hidden_size=512, vocab_size=16384, intermediate_size=8192, num_shared_experts=32)
    return K3Config.from_hf(hf)


def _load_in_child(path) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_memory_is_model_plus_one_tensor(tmp_path):
    with torch.device("meta"):  # skips the slow random init of 60M parameters: the values do not matter here
        model = K3ForConditionalGeneration(_big_config())
    model.to_empty(device="cpu")
    for t in model.state_dict().values():
        t.zero_()
    sharded = save(model, tmp_path / "sharded", max_shard_size="24MB")
    # one big shard too: a reader that kept a shard's pages mapped while reading it would show here
    single = save(model, tmp_path / "single", max_shard_size="1GB")
    del model
    for path in (sharded, single):
        shards = list(path.glob("*.safetensors"))
        file_bytes = sum(p.stat().st_size for p in shards)
        r = _load_in_child(path)
        overhead = r["peak_growth"] - r["model_bytes"]
        print(f"\n  load: {r['model_bytes'] / 1e6:.0f} MB model from {len(shards)} shard(s) "
              f"({file_bytes / 1e6:.0f} MB): "
              f"peak +{overhead / 1e6:.0f} MB over the model (largest tensor {r['largest'] / 1e6:.0f} MB), "
              f"{file_bytes / 1e6 / r['seconds']:.0f} MB/s of checkpoint ({r['seconds']:.2f} s)")
        assert r["model_bytes"] > 100e6 and len(shards) >= (4 if path is sharded else 1)
        assert r["peak_growth"] <= r["model_bytes"] + r["largest"] + ALLOWANCE, r
