"""LoRA modules that replace their targets in place, keeping the base's state-dict keys.

Legend: I in features, O out features, R rank, E experts, E' = E or 1 (see `kimik3.lora.config`), L latent width,
F expert width.

`LoraLinear` is an `nn.Linear` (same `weight`, so `q_proj.weight` stays `q_proj.weight`) with `lora_A` [R, I] and
`lora_B` [O, R]: y = x W^T + scale * dropout(x) A^T B^T. `LoraExperts` holds the layer's MXFP4-packed experts (the
same `w{1,3,2}_packed` / `_scale` buffers as `MXFP4Experts`, shared, not copied) and `w{1,3,2}_lora_A` [E', R, in],
`w{1,3,2}_lora_B` [E', out, R]. B starts at zero, so a fresh adapter computes the base model exactly.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from kimik3.model.moe import MXFP4Experts, RoutedExperts, packed_weights
from kimik3.ops.lora import LoraWeights
from kimik3.ops.mxfp4 import decode

PROJECTIONS = ("w1", "w3", "w2")


def _init_a(a: Tensor) -> None:
    # PEFT's default: A as nn.Linear's kaiming-uniform init, B zero (the product starts at zero)
    bound = 1 / math.sqrt(a.shape[-1])
    with torch.no_grad():
        a.uniform_(-bound, bound)


class LoraLinear(nn.Linear):
    """A frozen `nn.Linear` plus a trainable rank-R update (see the module docstring)."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, dropout: float):
        if base.bias is not None:
            raise ValueError("lora: Linear targets with a bias are not supported (K3 has none)")
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the same Parameter: no copy, the same key
        self.register_parameter("bias", None)
        self.weight.requires_grad_(False)
        self.scale, self.dropout = scale, nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        kw = {"device": base.weight.device, "dtype": torch.float32}
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **kw))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **kw))
        _init_a(self.lora_A)

    def forward(self, x: Tensor) -> Tensor:
        # the scale on the [.., R] intermediate and the update added by the GEMM into the base output in place
        # (addmm_, beta 1): no pass of its own over the [.., O] output, forward or backward
        y = super().forward(x.reshape(-1, self.in_features))
        t = (self.dropout(x).reshape(-1, self.in_features) @ self.lora_A.to(x.dtype).T) * self.scale
        y.addmm_(t.to(y.dtype), self.lora_B.to(y.dtype).T)
        return y.view(*x.shape[:-1], self.out_features)

    def delta(self) -> Tensor:
        """scale * B A: [O, I] fp32, what merging adds to the weight."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scale={self.scale:g}"


class LoraExperts(RoutedExperts):
    """The routed experts of one layer, MXFP4-packed and frozen, with LoRA factors (see the module docstring)."""

    def __init__(self, base: MXFP4Experts, rank: int, scale: float, sharing: dict[str, tuple[bool, bool]]):
        super().__init__()
        E, F, L = base.w1_packed.shape[0], base.w1_packed.shape[1], base.w1_packed.shape[2] * 2
        self.scale = scale
        dev = base.w1_packed.device
        for name in PROJECTIONS:
            self.register_buffer(f"{name}_packed", getattr(base, f"{name}_packed"))
            self.register_buffer(f"{name}_scale", getattr(base, f"{name}_scale"))
            out, inp = (F, L) if name != "w2" else (L, F)
            share_a, share_b = sharing[name]
            a = nn.Parameter(torch.empty(1 if share_a else E, rank, inp, device=dev))
            _init_a(a)
            setattr(self, f"{name}_lora_A", a)
            setattr(self, f"{name}_lora_B", nn.Parameter(torch.zeros(1 if share_b else E, out, rank, device=dev)))

    @property
    def num_experts(self) -> int:
        return self.w1_packed.shape[0]

    def factors(self) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        return (tuple(getattr(self, f"{n}_lora_A") for n in PROJECTIONS),
                tuple(getattr(self, f"{n}_lora_B") for n in PROJECTIONS))

    def weights(self) -> LoraWeights:
        return LoraWeights(packed_weights(self), *self.factors(), self.scale)

    def delta(self, name: str) -> Tensor:
        """scale * B_e A_e for every expert: [E, out, in] fp32 (shared factors broadcast)."""
        a, b = getattr(self, f"{name}_lora_A").float(), getattr(self, f"{name}_lora_B").float()
        return torch.matmul(b, a).expand(self.num_experts, -1, -1) * self.scale

    def merged(self, name: str) -> Tensor:
        """decode(w) + delta: the merged dense weight [E, out, in], fp32."""
        base = decode(getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale"), torch.float32)
        return base + self.delta(name)

    def extra_repr(self) -> str:
        a = self.w1_lora_A
        return f"experts={self.num_experts}, rank={a.shape[1]}, scale={self.scale:g}, layout=mxfp4"
