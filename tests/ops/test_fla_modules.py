"""`fla_module`: fla-core's modules K3 runs, imported without fla.ops' and fla.modules' package __init__ (every op and
layer fla ships); the rest of fla still imports in the same process. Each case runs in a new interpreter."""

import subprocess
import sys

import pytest

pytest.importorskip("fla")

LOAD = """
import sys, time
t0 = time.perf_counter()
from kimik3.ops.fla_modules import fla_module
kda = fla_module("fla.ops.kda")
norm = fla_module("fla.modules.norm.fused_norm_gate")
seconds = time.perf_counter() - t0
assert callable(kda.chunk_kda) and callable(kda.fused_recurrent_kda) and callable(norm.rms_norm_gated)
assert callable(fla_module("fla.ops.kda.fused_recurrent").fused_recurrent_kda_fwd)
"""


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_only_what_k3_runs_is_imported():
    out = run(LOAD + """
fla = sorted(m for m in sys.modules if m.startswith("fla."))
assert "fla.ops.abc" not in fla and "fla.ops.comba" not in fla and "fla.modules.mlp" not in fla, fla
assert "torch._inductor.compile_fx" not in sys.modules
print(len(fla))
""")
    assert int(out) < 100  # of the ~270 modules `import fla.ops.kda` brings on its own


def test_the_rest_of_fla_still_imports_in_the_same_process():
    run(LOAD + """
from fla.ops import chunk_gla                     # a name fla.ops' own __init__ binds: it runs now
from fla.ops.kda import chunk_kda
from fla.modules import FusedRMSNormGated
import fla.ops, fla.modules
assert callable(chunk_gla) and chunk_kda is kda.chunk_kda and "fla.ops.abc" in sys.modules
assert fla.ops.kda is kda and callable(fla.ops.chunk_gla) and fla.modules.FusedRMSNormGated is FusedRMSNormGated
from fla.ops import *                             # noqa
assert callable(chunk_gla)
try:
    fla.ops.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e)
else:
    raise AssertionError("a missing name must raise AttributeError")
""")


def test_fla_imported_first_is_left_as_it_is():
    run("""
import sys, types
import fla.ops
from kimik3.ops.fla_modules import _Deferred, fla_module
kda = fla_module("fla.ops.kda")
assert type(sys.modules["fla.ops"]) is types.ModuleType and kda is fla.ops.kda
""")
