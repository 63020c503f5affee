"""Many adapters on one base for serving: each token of a batch through its own adapter (or none).

Legend: T tokens of a forward, K adapters, R their largest rank, I/O in/out features, E experts, L latent width,
F expert width.

    adapters = lora.attach_adapters(model, {"poet": "runs/poet/adapter", "sql": "runs/sql/adapter"})
    with adapters.rows(index_T):          # [T] int64: 0..K-1 an adapter (in the dict's order), -1 the base
        logits, _ = model.run_step(ids_1T, pool, step)

Every module some adapter targets is replaced by its served version: `ServedLinear` (the base `nn.Linear`, its
weight shared, plus the K adapters' factors stacked [K, R, I] / [K, O, R]) or `ServedExperts` (the packed experts,
shared, plus factors [K, E, R, in] / [K, E, out, R]). An adapter that does not target a module has zero factors
there (its update is exactly 0). The base GEMM runs once over all T rows; the updates go through
`kimik3.ops.lora.lora_delta`, grouped per adapter. Outside `rows(...)` (or with no adapter in the batch) the
modules compute the base alone, bit for bit.

MLA's kv_b_proj is not applied to the step's token rows: the cached attention reads it as a weight (absorbed into
the queries and the output) or over cached keys. Its adapters' factors go to the layer's `kv_b_updates`
(`kimik3.model.mla.LatentUpdates`), which that attention applies per sequence on both of its paths. What serving
cannot run (a weight read past any module: the AttnRes projections, lm_head; no adapter `kimik3 lora` trains targets
them) is refused by `check_servable` from the adapter's header alone, before the model loads.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import Tensor, nn

from kimik3.checkpoint.safetensors_header import read_tensors
from kimik3.lora.apply import UNSUPPORTED, released_prefix
from kimik3.lora.layers import PROJECTIONS
from kimik3.lora.peft import NESTING, PREFIX, WEIGHTS, _from_peft, read_config
from kimik3.model.mla import LatentUpdates, MultiHeadLatentAttention
from kimik3.model.moe import MXFP4Experts, RoutedExperts, packed_weights
from kimik3.ops.lora import AdapterWeights, lora_delta


class AdapterRows:
    """The adapter of each token row of the forward now running ([T] int64, -1 = base), or None (the base for
    all): shared by every served module of one model, set only through `ServedAdapters.rows`."""

    def __init__(self):
        self.index: Tensor | None = None
        self.any: bool = False  # some row has an adapter (host-side, so a base-only batch skips the updates)

    def take(self, rows: int, module: str) -> Tensor | None:
        if self.index is None or not self.any:
            return None
        if self.index.shape[0] != rows:
            raise RuntimeError(f"{module}: a served adapter met {rows} rows, the forward has {self.index.shape[0]} "
                               "tokens (the module is applied to rows other than the step's tokens)")
        return self.index


def _stack(factors: list[Tensor | None], shape: tuple[int, ...], dtype: torch.dtype, device) -> Tensor:
    """[K, *shape]: each adapter's factor zero-padded to the largest rank (None: zeros)."""
    out = torch.zeros(len(factors), *shape, dtype=dtype, device=device)
    for k, f in enumerate(factors):
        if f is not None:
            out[k][tuple(slice(0, n) for n in f.shape)] = f.to(device, dtype)
    return out


class ServedLinear(nn.Linear):
    """A frozen `nn.Linear` (the same weight) plus K adapters' rank-R updates, one per token row."""

    def __init__(self, base: nn.Linear, name: str, rows: AdapterRows, a: list[Tensor | None],
                 b: list[Tensor | None], scale: list[float]):
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.name, self.adapter_rows = (base.in_features, base.out_features,
                                                                             name, rows)
        self.weight = base.weight
        self.register_parameter("bias", None)
        R = max(f.shape[0] for f in a if f is not None)
        kw = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.register_buffer("lora_A", _stack(a, (R, self.in_features), **kw), persistent=False)
        self.register_buffer("lora_B", _stack(b, (self.out_features, R), **kw), persistent=False)
        self.register_buffer("lora_scale", torch.tensor(scale, dtype=torch.float32, device=kw["device"]),
                             persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        x_NI = x.reshape(-1, self.in_features)
        index = self.adapter_rows.take(x_NI.shape[0], self.name)
        if index is None:
            return y
        return y + lora_delta(x_NI, index, self.lora_A, self.lora_B, self.lora_scale).view(y.shape)


def _latent_updates(base: nn.Linear, rows: AdapterRows, a: list[Tensor | None], b: list[Tensor | None],
                    scale: list[float]) -> LatentUpdates:
    """kv_b_proj's K adapters as `LatentUpdates` (A [K, R, C], scale * B [K, O, R]; zeros for an adapter without
    one), applied per the step's adapter rows."""
    R = max(f.shape[0] for f in a if f is not None)
    kw = dict(dtype=base.weight.dtype, device=base.weight.device)
    B = _stack(b, (base.out_features, R), **kw) * torch.tensor(scale, **kw)[:, None, None]
    return LatentUpdates(_stack(a, (R, base.in_features), **kw), B,
                         lambda: rows.index if rows.index is not None and rows.any else None)


class ServedExperts(RoutedExperts):
    """A layer's MXFP4-packed routed experts (the same buffers) plus K adapters' factors, one adapter per token."""

    def __init__(self, base: MXFP4Experts, name: str, rows: AdapterRows, factors: list[dict | None],
                 scale: list[float], dtype: torch.dtype):
        super().__init__()
        self.name, self.adapter_rows = name, rows
        E, F, L = base.w1_packed.shape[0], base.w1_packed.shape[1], base.w1_packed.shape[2] * 2
        dev = base.w1_packed.device
        R = max(f["w1"][0].shape[1] for f in factors if f is not None)
        for p in PROJECTIONS:
            self.register_buffer(f"{p}_packed", getattr(base, f"{p}_packed"))
            self.register_buffer(f"{p}_scale", getattr(base, f"{p}_scale"))
            out, inp = (F, L) if p != "w2" else (L, F)
            a = [f[p][0] if f is not None else None for f in factors]
            b = [f[p][1] if f is not None else None for f in factors]
            self.register_buffer(f"{p}_lora_A", _stack(a, (E, R, inp), dtype, dev), persistent=False)
            self.register_buffer(f"{p}_lora_B", _stack(b, (E, out, R), dtype, dev), persistent=False)
        self.register_buffer("lora_scale", torch.tensor(scale, dtype=torch.float32, device=dev), persistent=False)

    def weights(self) -> AdapterWeights:
        a = tuple(getattr(self, f"{p}_lora_A") for p in PROJECTIONS)
        b = tuple(getattr(self, f"{p}_lora_B") for p in PROJECTIONS)
        return AdapterWeights(packed_weights(self), lambda rows: self.adapter_rows.take(rows, self.name), a, b,
                              self.lora_scale)


class ServedAdapters:
    """The adapters `attach_adapters` put on a model: their names (index k = position), paths and the row index."""

    def __init__(self, names: list[str], paths: list[Path], rows: AdapterRows, modules: list[str]):
        self.names, self.paths, self.adapter_rows, self.modules = names, paths, rows, modules
        self._index = {n: k for k, n in enumerate(names)}

    def index(self, name: str | None) -> int:
        """k of adapter `name` (-1 for None, the base). Raises ValueError for a name not loaded."""
        if name is None:
            return -1
        if name not in self._index:
            known = ", ".join(map(repr, self.names)) or "none"
            raise ValueError(f"adapter {name!r} is not loaded (loaded: {known})")
        return self._index[name]

    @contextlib.contextmanager
    def rows(self, index: list[int], device: torch.device | str | None = None):
        """Within the block, token row t of a forward runs adapter index[t] (-1: none)."""
        r = self.adapter_rows
        r.index, r.any = torch.tensor(index, dtype=torch.long, device=device), any(k >= 0 for k in index)
        try:
            yield
        finally:
            r.index, r.any = None, False


def check_servable(path: str | Path) -> None:
    """Refuse, from the adapter folder's config and tensor names alone (nothing is loaded), an adapter that serving
    cannot run: one on a module whose weight is read past any module forward (`UNSUPPORTED`). A ValueError names
    the folder and the module."""
    from safetensors import safe_open

    path = Path(path)
    read_config(path)
    file = path / WEIGHTS
    if not file.is_file():
        raise FileNotFoundError(f"{path}: not an adapter folder (no {WEIGHTS})")
    try:
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
    except Exception as e:  # noqa: BLE001 (safetensors raises its own error types for a truncated or foreign file)
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
    for key in keys:
        module = key.removeprefix(PREFIX).split(".lora_")[0]
        leaf = module.split(".")[-1]
        if leaf in UNSUPPORTED:
            raise ValueError(f"{path}: adapter on {module}, which serving cannot run ({UNSUPPORTED[leaf]}); "
                             "merge it instead (kimik3 lora merge)")


def _read(path: Path) -> tuple[dict[str, Tensor], float, float]:
    """(the adapter's tensors, its Linear scale alpha / rank, its experts' alpha)."""
    cfg = read_config(path)
    if not (path / WEIGHTS).is_file():
        raise FileNotFoundError(f"{path}: not an adapter folder (no {WEIGHTS})")
    return read_tensors(path / WEIGHTS), cfg.alpha / cfg.rank, cfg.alpha


@torch.no_grad()
def attach_adapters(model: nn.Module, adapters: dict[str, str | Path]) -> ServedAdapters:
    """Put the adapters (name -> PEFT-format folder, as `kimik3.lora.save` writes) on `model` for serving, in place.

    Routed experts an adapter targets must be MXFP4-packed (`keep_experts_packed=True`). The factors are kept in
    the model's compute dtype.

    Raises:
        FileNotFoundError: a path that is no adapter folder. ValueError: tensors that name no module of the model
            (or a module whose use the served path cannot follow, see the module docstring), wrong shapes, dense
            experts, a model that already has adapters.
    """
    if any(isinstance(m, (ServedLinear, ServedExperts)) or getattr(m, "kv_b_updates", None) is not None
           for m in model.modules()):
        raise ValueError("attach_adapters: the model already has served adapters")
    names, paths = list(adapters), [Path(p) for p in adapters.values()]
    read = [_read(p) for p in paths]
    used = [set() for _ in read]
    rows = AdapterRows()
    prefix = released_prefix(model)
    done = []
    for name, module in list(model.named_modules()):
        released = prefix + name
        if isinstance(module, nn.Linear):
            keys = [f"{PREFIX}{released}.lora_{f}.weight" for f in ("A", "B")]
            hits = [k for k, (t, _, _) in enumerate(read) if keys[0] in t]
            if not hits:
                continue
            leaf = name.split(".")[-1]
            if leaf in UNSUPPORTED:
                raise ValueError(f"{paths[hits[0]]}: adapter on {released}, which serving cannot run "
                                 f"({UNSUPPORTED[leaf]}); merge it instead (kimik3 lora merge)")
            a, b = [], []
            for k, (t, _, _) in enumerate(read):
                if k not in hits:
                    a.append(None), b.append(None)
                    continue
                ta, tb = t[keys[0]], t.get(keys[1])
                if tb is None or ta.shape[1] != module.in_features or tb.shape != (module.out_features, ta.shape[0]):
                    raise ValueError(f"{paths[k] / WEIGHTS}: {keys[0]} / lora_B do not fit {released} "
                                     f"[{module.out_features}, {module.in_features}]")
                used[k].update(keys)
                a.append(ta), b.append(tb)
            parent = model.get_submodule(name.rpartition(".")[0])
            if isinstance(parent, MultiHeadLatentAttention) and leaf == "kv_b_proj":  # read as a weight: see above
                parent.kv_b_updates = _latent_updates(module, rows, a, b, [r[1] for r in read])
                done.append(released)
                continue
            new = ServedLinear(module, released, rows, a, b, [r[1] for r in read])
        elif isinstance(module, nn.Module) and any(f"{PREFIX}{released}.lora_A.weight" in t for t, _, _ in read):
            if not isinstance(module, MXFP4Experts):
                raise ValueError(f"adapter on the routed experts {released}, which are not MXFP4-packed: load the "
                                 "base with keep_experts_packed=True")
            E = module.w1_packed.shape[0]
            factors, scale = [], []
            for k, (t, _, alpha) in enumerate(read):
                got = {}
                for p in PROJECTIONS:
                    key = f"{PREFIX}{released}.{NESTING[p]}"
                    if key + "lora_A.weight" in t:
                        used[k].update({key + "lora_A.weight", key + "lora_B.weight"})
                        got[p] = _from_peft(t[key + "lora_A.weight"], t[key + "lora_B.weight"], E, False, False, key)
                factors.append(got if got else None)
                if got and set(got) != set(PROJECTIONS):
                    raise ValueError(f"{paths[k] / WEIGHTS}: {released} has factors for {sorted(got)}, "
                                     "expected w1, w3 and w2")
                scale.append(alpha / got["w1"][0].shape[1] if got else 0.0)
            moe = model.get_submodule(name.rpartition(".")[0])  # the LatentMoE: its compute dtype
            new = ServedExperts(module, released, rows, factors, scale, moe.routed_expert_down_proj.weight.dtype)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        done.append(released)
    for k, (t, _, _) in enumerate(read):
        extra = sorted(set(t) - used[k])
        if extra:
            raise ValueError(f"{paths[k] / WEIGHTS}: {len(extra)} tensors name no module of this model, "
                             f"e.g. {extra[0]}")
    return ServedAdapters(names, paths, rows, done)
