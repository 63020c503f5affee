"""K3 tokenizer, XTML chat encoder and response parser (spec §5).

    tok = Tokenizer.from_file("/ckpt/Kimi-K3")                 # the checkpoint's tiktoken.model
    ids = encode_chat(tok, [{"role": "user", "content": "Hi"}], thinking_effort="high")
    ...generate until tok.eos_id (<|end_of_msg|>)...
    out = parse_response(tok, generated_ids)                   # reasoning_content, content, tool_calls

Streaming: `tok.stream_decoder()` for raw text, `ResponseParser(tok).feed(ids)` for structured deltas.
Training (SFT): `ids, mask = encode_chat_with_mask(tok, conversation, add_generation_prompt=False)`, mask True on
the assistant turns' generated ids.
"""

from pathlib import Path

from .bpe import NUM_SPECIAL, PATTERN, SPECIAL_OFFSETS, StreamDecoder, Tokenizer, load_ranks
from .chat import IMAGE_PLACEHOLDER, THINKING_EFFORTS, encode_chat, encode_chat_with_mask, image_prompt, render_chat
from .parse import Delta, ParsedResponse, ResponseParser, parse_response, parse_text

# The same prompt as a Jinja template, for what reads templates rather than Python (transformers' apply_chat_template,
# vLLM --chat-template, llama.cpp): tokenizer_config.json and GGUF files carry it; its header says where it and
# encode_chat can differ
CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text(encoding="utf-8")

__all__ = [
    "CHAT_TEMPLATE", "IMAGE_PLACEHOLDER", "NUM_SPECIAL", "PATTERN", "SPECIAL_OFFSETS", "THINKING_EFFORTS", "Delta",
    "ParsedResponse", "ResponseParser", "StreamDecoder", "Tokenizer", "encode_chat", "encode_chat_with_mask",
    "image_prompt", "load_ranks", "parse_response", "parse_text", "render_chat",
]
