"""Grammar-constrained decoding: JSON output and forced tool calls that hold by construction.

Legend: V vocabulary (the model's logits width; may exceed the tokenizer's ids).

A `GrammarConstraint` is the engine's `TokenConstraint`: before each sample it gives a bool [V] mask of the tokens
the grammar allows next, the engine fills the others with -inf after the forward (so a CUDA graph covering the
forward is untouched) and reports the sampled id back through `accept`. The grammar engine is llguidance
(guidance-ai): a maintained Rust library with a CPU mask computation (~10-100 us per token) whose result is a host
bitmask, the same path vLLM and SGLang use before copying the mask to the GPU; xgrammar would also do, but pulls
transformers and triton into the server's install.

The grammars cover the whole K3 assistant turn, markers included, so a constrained turn is also a well-formed
message: `<|close|>think<|sep|>` (when the prompt opened think: a constrained turn does not reason, or a model that
never closes its thinking, like the Shakespeare demo, would never reach the JSON), the response or tools block,
then `<|close|>message<|sep|><|end_of_msg|>`. JSON is compact (no free whitespace), so a model cannot pad it
forever. An object schema that declares `properties` and says nothing of `additionalProperties` is generated
closed (`_bounded`): every output still validates against the client's schema, and once the declared keys are
written the only way on is `}` (issue 27: the demo model, free to add keys, wrote keys no function declared until
max_tokens). An explicit `additionalProperties` (true or a schema) or `patternProperties` keeps the object open.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kimik3.tokenizer import Tokenizer

__all__ = ["GrammarConstraint", "GrammarVocab", "json_grammar", "tool_call_grammar"]

_THINK_CLOSE = '<|close|> "think" <|sep|> '


def _lit(text: str) -> str:
    """A Lark string literal (JSON escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


_SUBSCHEMAS = ("properties", "$defs", "definitions")  # name -> subschema maps
_OPEN_KEYS = {"additionalProperties", "patternProperties", "unevaluatedProperties"}
# keywords that apply several subschemas to one instance at once: closing any of them could reject keys another
# declares (or make a schema unsatisfiable), so a schema that uses them is left as the client wrote it
_INTERSECTIONS = {"allOf", "if", "dependentSchemas", "dependencies"}


def _bounded(schema: Any) -> Any:
    """`schema` with each object that declares `properties` and none of `_OPEN_KEYS` closed
    (`additionalProperties: false`), recursively; a copy, the input is untouched.

    Closing is a restriction (a subset of the valid instances), so it is safe wherever a subschema is checked on
    its own: properties, definitions, items, and the branches of an anyOf / oneOf that stands alone. Not where
    subschemas are checked together (`_INTERSECTIONS`, or an anyOf beside `properties`), nor under `not` (there
    it would widen the schema).
    """
    return schema if _intersects(schema) else _close(schema)


def _intersects(node: Any) -> bool:
    if isinstance(node, dict):
        return bool(_INTERSECTIONS & node.keys()) or any(_intersects(v) for v in node.values())
    return isinstance(node, list) and any(_intersects(v) for v in node)


def _close(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    if "properties" in node and ("anyOf" in node or "oneOf" in node):
        return node  # the branches are checked together with this level's properties: close neither
    out = dict(node)
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _close(v) for k, v in out[key].items()}
    for key in ("prefixItems", "anyOf", "oneOf"):
        if isinstance(out.get(key), list):
            out[key] = [_close(v) for v in out[key]]
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key])
    if isinstance(out.get("properties"), dict) and not _OPEN_KEYS & out.keys():
        out["additionalProperties"] = False
    return out


def _compact(schema: dict[str, Any] | None) -> dict[str, Any]:
    schema = _bounded(dict(schema)) if schema is not None else {"type": "object"}
    schema["x-guidance"] = {**schema.get("x-guidance", {}), "whitespace_flexible": False}
    return schema


def json_grammar(schema: dict[str, Any] | None, *, thinking: bool) -> str:
    """Lark grammar of an assistant turn whose content is one JSON value matching `schema` (None: any object)."""
    head = (_THINK_CLOSE + '<|open|> "response" <|sep|> ') if thinking else ""
    return (f'start: {head}body <|close|> "response" <|sep|> <|close|> "message" <|sep|> <|end_of_msg|>\n'
            f"body: %json {json.dumps(_compact(schema))}\n")


def tool_call_grammar(tools: Sequence[tuple[str, dict[str, Any] | None]], *, thinking: bool) -> str:
    """Lark grammar of an assistant turn that is exactly one call of one of `tools` ((name, parameters schema)).

    The arguments are written as a json block (`<|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>`), one of
    the two forms the K3 format and our parser accept, so the schema constrains them directly.
    """
    if not tools:
        raise ValueError("constraints: tool_call_grammar needs at least one (name, schema) tool")
    head = (_THINK_CLOSE + '<|open|> "response" <|sep|> ') if thinking else ""
    rules = [(f'start: {head}<|close|> "response" <|sep|> <|open|> "tools" <|sep|> call <|close|> "tools" <|sep|> '
              '<|close|> "message" <|sep|> <|end_of_msg|>'),
             "call: " + " | ".join(f"call{k}" for k in range(len(tools)))]
    for k, (name, schema) in enumerate(tools):
        escaped = name.replace("&", "&amp;").replace('"', "&quot;")
        header, json_open = _lit('call tool="' + escaped + '" index="1"'), _lit('json type="object"')
        rules.append(f'call{k}: <|open|> {header} <|sep|> <|open|> {json_open} <|sep|> args{k} <|close|> "json" '
                     '<|sep|> <|close|> "call" <|sep|>')
        rules.append(f"args{k}: %json {json.dumps(_compact(schema))}")
    return "\n".join(rules) + "\n"


class GrammarVocab:
    """The tokenizer's vocabulary as llguidance sees it; built once per tokenizer and model vocabulary width.

    Args:
        tokenizer: the K3 tokenizer (its tiktoken ranks, special tokens and pre-tokenizer pattern).
        vocab_size: V, the model's logits width (>= tokenizer.vocab_size; ids past the tokenizer's are never allowed).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None):
        from llguidance.tiktoken import lltokenizer_from_encoding

        vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(f"constraints: vocab_size {vocab_size} is below the tokenizer's {tokenizer.vocab_size}")
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        # the Tokenizer wraps a tiktoken Encoding (ranks + specials + pattern): exactly what llguidance reads
        self.ll = lltokenizer_from_encoding(tokenizer._enc, n_vocab=tokenizer.vocab_size, eos_token=tokenizer.eos_id)

    def compile(self, lark: str) -> str:
        """The llguidance grammar of a Lark text; ValueError with the library's message if it does not compile."""
        from llguidance import LLMatcher

        try:
            grammar = LLMatcher.grammar_from_lark(lark)
        except Exception as e:  # noqa: BLE001 (the binding raises plain exceptions on syntax errors)
            raise ValueError(f"constraints: grammar does not compile: {e}") from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.ll)
        if is_error:
            raise ValueError(f"constraints: grammar does not compile: {messages[0].strip()}")
        return grammar


class GrammarConstraint:
    """One sequence's grammar state (the engine's `TokenConstraint`).

    `allowed()` -> bool [V] (on the CPU; the engine moves it next to the logits), `accept(id)` advances,
    `is_finished()` once the grammar is complete (the turn's `<|end_of_msg|>` was accepted). A token the grammar
    rejects (the engine sampled outside the mask) puts the constraint in an error state: it then allows only EOS, so
    the request ends instead of producing output that silently breaks the contract.
    """

    def __init__(self, vocab: GrammarVocab, grammar: str):
        from llguidance import LLMatcher

        self._vocab = vocab
        self._grammar = grammar
        self._matcher = LLMatcher(vocab.ll, grammar, log_level=0)
        if self._matcher.is_error():
            raise ValueError(f"constraints: {self._matcher.get_error()}")

    def fork(self) -> GrammarConstraint:
        """A fresh constraint of the same grammar (for the engine's constraint_factory, n > 1)."""
        return GrammarConstraint(self._vocab, self._grammar)

    def allowed(self) -> torch.Tensor | None:
        V, n = self._vocab.vocab_size, self._vocab.tokenizer.vocab_size
        mask = torch.zeros(V, dtype=torch.bool)
        if self._matcher.is_error():
            mask[self._vocab.tokenizer.eos_id] = True
            return mask
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[:n]  # bit i of 32-bit word j (little-endian) = id 32j + i
        mask[:n] = torch.from_numpy(bits.astype(np.bool_))
        return mask

    def accept(self, token_id: int) -> None:
        self._matcher.consume_token(int(token_id))

    def forced(self) -> list[int]:
        """The tokens the grammar allows alone from here (llguidance's fast-forward tokens), not consumed: a forced
        tool call's opening (the channel markers, the call header, its JSON up to the first free value)."""
        return [] if self._matcher.is_error() else list(self._matcher.compute_ff_tokens())

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (speculative decoding walks the drafts through the grammar)."""
        self._matcher.rollback(n)

    def is_finished(self) -> bool:
        return self._matcher.is_stopped() or self._matcher.is_error()

    @property
    def error(self) -> str | None:
        """The grammar engine's error message (a token outside the mask was accepted), else None."""
        return self._matcher.get_error() if self._matcher.is_error() else None
