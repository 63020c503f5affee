"""Grammar constraints on the demo vocabulary: any walk through the mask is a schema-valid, parseable K3 turn."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from kimik3.inference.constraints import GrammarConstraint, GrammarVocab, json_grammar, tool_call_grammar
from kimik3.presets import DEMO_MODEL
from kimik3.tokenizer import Tokenizer, parse_response

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "mood": {"enum": ["merry", "sad"]},
                                           "word": {"type": "string", "maxLength": 6}},
          "required": ["n", "mood", "word"], "additionalProperties": False}


@pytest.fixture(scope="module")
def vocab():
    return GrammarVocab(Tokenizer.from_file(DEMO_MODEL), vocab_size=Tokenizer.from_file(DEMO_MODEL).vocab_size + 7)


def _walk(constraint, gen, limit=400):
    """Sample uniformly among allowed ids (a worst-case 'model') until the grammar finishes."""
    out = []
    while not constraint.is_finished():
        mask = constraint.allowed()
        assert mask.dtype == torch.bool and mask[-7:].sum() == 0  # ids past the tokenizer are never allowed
        ids = mask.nonzero().flatten()
        assert len(ids) > 0 and len(out) < limit
        t = int(ids[torch.randint(len(ids), (), generator=gen)])
        out.append(t)
        constraint.accept(t)
    return out


@pytest.mark.parametrize("thinking", [True, False])
def test_json_schema_walks_validate(vocab, thinking):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    grammar = vocab.compile(json_grammar(SCHEMA, thinking=thinking))
    for _ in range(5):
        out = _walk(GrammarConstraint(vocab, grammar), gen)
        p = parse_response(vocab.tokenizer, out, start_in="think" if thinking else "response")
        assert p.complete and p.reasoning_content == "" and p.tool_calls == [] and p.remainder == ""
        jsonschema.validate(json.loads(p.content), SCHEMA)


def test_tool_call_walks_are_well_formed_calls(vocab):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    tools = [("get_weather", SCHEMA), ('odd "name" & co', {"type": "object", "properties": {"x": {"type": "boolean"}},
                                                          "required": ["x"], "additionalProperties": False})]
    grammar = vocab.compile(tool_call_grammar(tools, thinking=True))
    names = set()
    for _ in range(8):
        out = _walk(GrammarConstraint(vocab, grammar), gen)
        p = parse_response(vocab.tokenizer, out)
        assert p.complete and p.content == "" and len(p.tool_calls) == 1
        call = p.tool_calls[0]
        schema = dict(tools)[call["name"]]
        jsonschema.validate(call["arguments"], schema)
        names.add(call["name"])
    assert names <= {n for n, _ in tools}


def test_rejected_token_ends_the_turn_and_bad_schema_is_a_value_error(vocab):
    c = GrammarConstraint(vocab, vocab.compile(json_grammar(None, thinking=False)))
    first = c.allowed()
    bad = int((~first[:vocab.tokenizer.vocab_size]).nonzero()[0])
    c.accept(bad)
    assert c.is_finished() and c.error
    assert c.allowed().nonzero().flatten().tolist() == [vocab.tokenizer.eos_id]
    fork = GrammarConstraint(vocab, vocab.compile(json_grammar(None, thinking=False))).fork()
    assert torch.equal(fork.allowed(), first) and not fork.is_finished()
    with pytest.raises(ValueError, match="schema"):
        vocab.compile(json_grammar({"type": "nonsense"}, thinking=True))


def _mask_after(vocab, schema, text):
    """The mask after a forced call's header and `text` of its json arguments (thinking on)."""
    c = GrammarConstraint(vocab, vocab.compile(tool_call_grammar([("f", schema)], thinking=True)))
    head = ('<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
            '<|open|>call tool="f" index="1"<|sep|><|open|>json type="object"<|sep|>')
    for t in vocab.tokenizer.encode(head, allow_special=True) + vocab.tokenizer.encode(text):
        assert c.allowed()[t], (text, vocab.tokenizer.decode([t]))
        c.accept(t)
    return c.allowed()


@pytest.mark.parametrize("schema, text, closes", [
    ({"type": "object", "properties": {"city": {"type": "string"}}}, '{"city":"Mantua"', True),
    ({"type": "object", "properties": {"at": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
     '{"at":{"x":1', True),
    ({"anyOf": [{"type": "object", "properties": {"city": {"type": "string"}}}]}, '{"city":"Mantua"', True),
    ({"type": "object", "properties": {"city": {"type": "string"}}, "additionalProperties": True},
     '{"city":"Mantua"', False),
    ({"type": "object", "properties": {"city": {"type": "string"}}, "additionalProperties": {"type": "integer"}},
     '{"city":"Mantua"', False),
    ({"allOf": [{"type": "object", "properties": {"city": {"type": "string"}}},
                {"type": "object", "properties": {"mood": {"type": "string"}}}]}, '{"city":"Mantua"', False),
    ({"type": "object"}, '{"city":"Mantua"', False),
])
def test_open_object_schemas_close_after_their_declared_keys(vocab, schema, text, closes):
    """An object that declares properties and says nothing of additionalProperties is generated closed: after its
    declared keys only `}` follows. An explicit additionalProperties, an allOf (subschemas checked together) or an
    object with no declared properties stays open."""
    mask = _mask_after(vocab, schema, text)
    comma, brace = vocab.tokenizer.encode(","), vocab.tokenizer.encode("}")
    assert len(comma) == 1 and len(brace) == 1
    assert bool(mask[brace[0]]) and bool(mask[comma[0]]) is not closes
