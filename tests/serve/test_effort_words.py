"""The effort words each field accepts are the ones its error lists: `reasoning_effort` takes "none" (thinking off,
as docs/serving.md says) besides the effort words; `thinking.effort` does not."""

import pytest

from kimik3.inference import SamplingParams
from kimik3.serve.protocol import APIError, parse_chat

USER = [{"role": "user", "content": "hi"}]


def plan(**body):
    return parse_chat({"messages": USER, **body}, defaults=SamplingParams(), vocab_size=1000)


def test_reasoning_effort_none_is_accepted_and_named_in_the_error():
    assert plan(reasoning_effort="none").thinking is False
    with pytest.raises(APIError, match=r"^reasoning_effort: must be one of \[.*'max'.*'none'\], got 'extreme'$"):
        plan(reasoning_effort="extreme")
    with pytest.raises(APIError) as e:
        plan(thinking={"type": "enabled", "effort": "none"})
    assert str(e.value).startswith("thinking.effort: must be one of") and "'none'" not in str(e.value).split("got")[0]
