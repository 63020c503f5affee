"""`KimiK3Tokenizer`: a transformers `PreTrainedTokenizer` over kimik3's tokenizer and XTML chat encoder.

Ids, special tokens and decoding are `kimik3.tokenizer.Tokenizer`'s (one BPE, over the folder's `tiktoken.model`);
`apply_chat_template` is `encode_chat` / `encode_chat_with_mask` with their keywords (tools, thinking,
thinking_effort, tool_choice, response_format). `chat_template` is kimik3's Jinja template of the same format
(`kimik3.tokenizer.CHAT_TEMPLATE`, for what renders templates itself); its `{% generation %}` markers tell trainers
(TRL) that assistant masks come back from `return_assistant_tokens_mask=True`.

Token strings (`convert_ids_to_tokens`, `get_vocab`) are those of the class every checkpoint folder carries for
`trust_remote_code` (`kimik3.tokenizer.tokenization_kimi.TikTokenTokenizer`), which this one extends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kimik3.tokenizer import CHAT_TEMPLATE, PATTERN, Tokenizer, encode_chat_with_mask
from kimik3.tokenizer.tokenization_kimi import TikTokenTokenizer

RELEASED_TOKENIZER_CLASS = "TikTokenTokenizer"  # tokenizer_config.json's tokenizer_class in the release
_CHAT_KEYS = ("tools", "thinking", "thinking_effort", "tool_choice", "response_format", "image_prompts")


class KimiK3Tokenizer(TikTokenTokenizer):
    """K3's tokenizer for transformers. `vocab_file`: the folder's tiktoken.model.

    The class kimik3 ships into checkpoint folders for `trust_remote_code` (`kimik3.tokenizer.tokenization_kimi`),
    with kimik3's own pre-tokenizer pattern and special ids (whatever tokenizer_config.json says), its encoder
    (the released tokenizer's cuts of very long inputs) and its XTML chat encoder.
    """

    def __init__(self, vocab_file: str, **kwargs: Any):
        if not Path(vocab_file).is_file():
            raise FileNotFoundError(f"{vocab_file}: no tiktoken.model (K3's tokenizer file) to load")
        self.k3 = Tokenizer.from_file(vocab_file)
        for key in ("pat_str", "special_tokens"):  # kimik3's own, never a folder's copy of them
            kwargs.pop(key, None)
        kwargs.setdefault("bos_token", "[BOS]")
        kwargs.setdefault("eos_token", "<|end_of_msg|>")  # the generation EOS (config.eos_token_id)
        kwargs.setdefault("pad_token", "[PAD]")
        kwargs.setdefault("unk_token", "[UNK]")
        kwargs.setdefault("chat_template", CHAT_TEMPLATE)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(str(vocab_file), PATTERN, dict(self.k3.special_ids), **kwargs)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        # text between special names (transformers splits those off first): ordinary BPE, as kimik3's encode
        return [self._id_to_token[i] for i in self.k3.encode(text)]

    def _decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None,
                **kwargs: Any) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if skip_special_tokens:
            ids = [i for i in ids if not self.k3.is_special(i)]
        return self.k3.decode(ids)  # whole-sequence UTF-8, exactly kimik3's decode

    def apply_chat_template(self, conversation, tools: list | None = None, documents=None, chat_template=None,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            tokenize: bool = True, padding=False, truncation: bool = False, max_length=None,
                            return_tensors=None, return_dict: bool = True, return_assistant_tokens_mask: bool = False,
                            tokenizer_kwargs=None, **kwargs: Any):
        """kimik3's XTML encoder behind transformers' signature.

        Keywords besides transformers' own: thinking (default True), thinking_effort (default "max"), tool_choice,
        response_format, image_prompts (see `kimik3.tokenizer.encode_chat`). `add_generation_prompt` defaults to
        False as in transformers (encode_chat's default is True). Returns ids (tokenize=True, return_dict=False),
        a BatchEncoding with input_ids, attention_mask and, with return_assistant_tokens_mask, assistant_masks
        (1 on the ids an SFT loss trains on: `encode_chat_with_mask`), or the rendered text (tokenize=False).
        A batch (a list of conversations) gives lists.
        """
        if documents or continue_final_message or (chat_template not in (None, self.chat_template)):
            raise ValueError("KimiK3Tokenizer.apply_chat_template: documents, continue_final_message and another "
                             "chat_template are not supported (K3's format is kimik3's XTML encoder)")
        unknown = set(kwargs) - set(_CHAT_KEYS)
        if unknown:
            raise ValueError(f"KimiK3Tokenizer.apply_chat_template: unknown arguments {sorted(unknown)} "
                             f"(the encoder takes {', '.join(_CHAT_KEYS)})")
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        convs = conversation if batched else [conversation]
        if tokenize and return_tensors is not None:
            batched = True  # tensors always have a batch axis: one conversation gives [1, T]
        chat = {"tools": tools, "add_generation_prompt": add_generation_prompt, **kwargs}
        convs = [[dict(m) for m in c] for c in convs]  # datasets hand rows as Mapping-like objects
        if not tokenize:
            from kimik3.tokenizer import render_chat

            texts = [render_chat(c, **chat) for c in convs]
            return texts if batched else texts[0]
        encoded = [encode_chat_with_mask(self.k3, c, **chat) for c in convs]
        ids = [e[0] for e in encoded]
        if not return_dict:
            out = ids if batched else ids[0]
            return self.pad({"input_ids": out}, padding=padding or bool(return_tensors), max_length=max_length,
                            return_tensors=return_tensors)["input_ids"] if return_tensors else out
        data = {"input_ids": ids}
        if return_assistant_tokens_mask:
            data["assistant_masks"] = [[int(m) for m in e[1]] for e in encoded]
        if not batched:
            data = {k: v[0] for k, v in data.items()}
        return self.pad(data, padding=padding, max_length=max_length, return_tensors=return_tensors,
                        **(tokenizer_kwargs or {}))
