"""The K3 configuration: the frozen tree (`tree`, its parts in `sections`) and its translation from the released
config.json (`hf`)."""

from kimik3.config.hf import HF_COMMON_KEYS, KDA_KEYS, TEXT_KEYS, TOP_KEYS, VISION_KEYS
from kimik3.config.sections import (
    A_LOG_PAD,
    EXPERT_FORMATS,
    STORED_DTYPES,
    ExpertFormat,
    KDAConfig,
    LayerType,
    MLAConfig,
    MoEConfig,
    Storage,
    TextConfig,
    VisionConfig,
)
from kimik3.config.tree import K3Config

__all__ = [
    "A_LOG_PAD", "EXPERT_FORMATS", "HF_COMMON_KEYS", "KDA_KEYS", "STORED_DTYPES", "TEXT_KEYS", "TOP_KEYS",
    "VISION_KEYS", "ExpertFormat", "K3Config", "KDAConfig", "LayerType", "MLAConfig", "MoEConfig", "Storage",
    "TextConfig", "VisionConfig",
]
