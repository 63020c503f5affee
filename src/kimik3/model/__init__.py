"""Single-device K3 math: modules named exactly as the released checkpoint's tensors."""

from kimik3.model.model import K3ForCausalLM, K3ForConditionalGeneration, K3TextModel

__all__ = ["K3ForCausalLM", "K3ForConditionalGeneration", "K3TextModel"]
