"""fla-core's modules as K3's ops load them: only those K3 runs, with this GPU's shipped autotuning choices.

`import fla.ops.kda` first runs `fla/ops/__init__.py`, which imports every op fla ships (~40 of them), and
`fla.modules.norm` runs `fla/modules/__init__.py`, every layer, among them one that imports torch's inductor:
274 modules in 3.2 s on this repository's CPU, against 67 in 1.3 s for what KDA and its gated norm use (1.1 s of
which is torch._dynamo, which fla's dispatch decorator imports). That is start-up every `kimik3 generate` pays
before its first token on a GPU. So `fla_module` registers those two packages without running their `__init__`
(`_Deferred`): a submodule imports as usual, and the first name a package does not hold yet runs its real
`__init__`, so `from fla.ops import chunk_gla` elsewhere in the process still works. When fla was imported before
(by the user), nothing is deferred.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

from kimik3.ops.tuned import seed_fla

DEFERRED = ("fla.ops", "fla.modules")  # packages whose __init__ imports everything under them


class _Deferred(types.ModuleType):
    """A package registered without running its `__init__`: a missing name that is a submodule imports that
    submodule; any other runs the real `__init__` once (the package is then as fla ships it)."""

    def __getattr__(self, name: str):
        if not name.startswith("__") and importlib.util.find_spec(f"{self.__name__}.{name}") is not None:
            return importlib.import_module(f"{self.__name__}.{name}")
        if self.__dict__.get("_init_ran"):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        self.__dict__["_init_ran"] = True
        self.__spec__.loader.exec_module(self)
        return getattr(self, name)


def _defer_packages() -> None:
    if any(name in sys.modules for name in DEFERRED):
        return  # fla is already imported its own way
    import fla

    for name in DEFERRED:
        module = importlib.util.module_from_spec(importlib.util.find_spec(name))
        module.__class__ = _Deferred
        sys.modules[name] = module
        setattr(fla, name.rsplit(".", 1)[1], module)


def fla_module(name: str) -> types.ModuleType:
    """fla's module `name` (e.g. "fla.ops.kda"), imported without the packages' full `__init__`, with the shipped
    autotuning choices put in its kernels' autotuners before their first call (`kimik3.ops.tuned.seed_fla`)."""
    module = sys.modules.get(name)
    if module is None:
        _defer_packages()
        module = importlib.import_module(name)
    seed_fla()
    return module
