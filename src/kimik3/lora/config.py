"""What an adapter is: rank, scale, targets and how routed experts share their factors (frozen, validated once).

    targets   released module names with `*` (fnmatch over the dotted path): "*.self_attn.q_proj" (a Linear),
              "*.block_sparse_moe.experts" (the routed experts: w1, w3 and w2), "*.shared_experts.*" ...
    experts   how the E routed experts of one layer share A and B (R = the experts' rank):
                per_expert    A [E, R, in], B [E, out, R]: independent (PEFT's `target_parameters` layout)
                shared_a      A [1, R, in], B [E, out, R]: one A per layer, a B per expert (miles)
                shared_outer  w1/w3: A shared, B per expert; w2: A per expert, B shared -- the factor on the
                              latent side is shared (SGLang's shared-outer layout)
                shared        A [1, R, in], B [1, out, R]: one pair per layer and projection
    rank_scaling  the experts' rank is max(1, rank // top_k) (NeMo's moe_rank_scaling): a token meets top_k experts
    scale     alpha / R of each module (PEFT's convention, R the rank that module uses)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

EXPERT_LAYOUTS = ("per_expert", "shared_a", "shared_outer", "shared")
# per projection: (A shared, B shared) for each layout
SHARING = {"per_expert": {"w1": (False, False), "w3": (False, False), "w2": (False, False)},
           "shared_a": {"w1": (True, False), "w3": (True, False), "w2": (True, False)},
           "shared_outer": {"w1": (True, False), "w3": (True, False), "w2": (False, True)},
           "shared": {"w1": (True, True), "w3": (True, True), "w2": (True, True)}}


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0  # on the input of Linear targets while training (PEFT has none for expert parameters)
    targets: list[str] = field(default_factory=lambda: ["*.self_attn.*_proj", "*.block_sparse_moe.experts"])
    experts: str = "per_expert"
    rank_scaling: bool = False

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"lora.rank must be an integer >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha must be > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if self.experts not in EXPERT_LAYOUTS:
            raise ValueError(f"lora.experts must be one of {', '.join(map(repr, EXPERT_LAYOUTS))}, "
                             f"got {self.experts!r}")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(f"lora.targets must be a non-empty list of module names (with *), got {self.targets!r}")

    def expert_rank(self, top_k: int) -> int:
        """The rank of the routed experts' factors: `rank`, or rank // top_k with rank_scaling (at least 1)."""
        return max(1, self.rank // top_k) if self.rank_scaling else self.rank

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "lora") -> LoraConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key 'lora.{unknown[0]}' (known: {', '.join(sorted(known))})")
        return cls(**d)
