"""Kimi K3 in the Hugging Face ecosystem, without remote code (needs the `hf` extra: transformers, peft).

    import kimik3.hf                                   # registers `kimi_k3` with transformers' auto classes
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    tok = AutoTokenizer.from_pretrained(path)

Importing this module registers the config, the model (AutoModel, AutoModelForCausalLM, and
AutoModelForImageTextToText: the released auto_map maps every one to the same class) and the tokenizer. A
registered `kimi_k3` is local code to transformers, so the released config.json's `auto_map` is never followed
and `trust_remote_code` is not needed. Nothing in kimik3's core imports this package.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
)
from transformers.models.auto import tokenization_auto

from kimik3.hf.cache import KimiK3Cache
from kimik3.hf.config import KimiK3Config, KimiK3TextConfig
from kimik3.hf.modeling import KimiK3ForConditionalGeneration, KimiK3PreTrainedModel
from kimik3.hf.tokenizer import RELEASED_TOKENIZER_CLASS, KimiK3Tokenizer

__all__ = ["KimiK3Cache", "KimiK3Config", "KimiK3ForConditionalGeneration", "KimiK3PreTrainedModel",
           "KimiK3TextConfig", "KimiK3Tokenizer"]

AutoConfig.register(KimiK3Config.model_type, KimiK3Config, exist_ok=True)
for _auto in (AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText):
    _auto.register(KimiK3Config, KimiK3ForConditionalGeneration, exist_ok=True)
AutoTokenizer.register(KimiK3Config, slow_tokenizer_class=KimiK3Tokenizer, exist_ok=True)
# The released tokenizer_config.json names its remote class, TikTokenTokenizer; without trust_remote_code
# AutoTokenizer looks that name up among known classes before the config's registered tokenizer, and falls back to
# a generic TokenizersBackend that is not K3's tokenizer. Known under that name too, the released folder loads ours.
_registered = tokenization_auto.REGISTERED_TOKENIZER_CLASSES
_registered.setdefault(RELEASED_TOKENIZER_CLASS, KimiK3Tokenizer)
