"""Stop strings, matched incrementally: the one matcher of the engine, `generate()`, the server and batch files.

`StopText` cuts text at the first stop string as it arrives; `StopDecoder` puts a `StreamDecoder` in front of it
for token ids. Each call costs O(new text + longest stop), whatever the length of the output so far: only a
tail that could still grow into a stop string is held back and searched again.
"""

from __future__ import annotations

from collections.abc import Sequence

from .bpe import StreamDecoder, Tokenizer


class StopText:
    """Cuts visible text at the first stop string; holds back a tail that could be the start of one.

    `feed(text)` returns what can be shown now; once a stop string is found, `hit` names it (the one that begins
    first) and nothing more is shown. `flush()` at the end releases the held tail (nothing after a hit).
    """

    def __init__(self, stops: Sequence[str]):
        self.stops, self.held, self.hit = tuple(stops), "", None

    def feed(self, text: str) -> str:
        if self.hit is not None or not self.stops:
            return "" if self.hit is not None else text
        text, self.held = self.held + text, ""
        found = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            cut, self.hit = min(found)
            return text[:cut]
        keep = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held if self.hit is None else ""


class StopDecoder:
    """Token ids -> visible text with stop strings: `push(ids)` returns the newly visible text (an incomplete
    UTF-8 character waits for its last byte); `hit` is the stop string found, if any; `flush()` ends it.
    `skip_special`: special ids (markers) add no text."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = (), *, skip_special: bool = False):
        self.decoder, self.text = StreamDecoder(tokenizer), StopText(stops)
        self.skip = tokenizer.is_special if skip_special else None

    @property
    def hit(self) -> str | None:
        return self.text.hit

    def push(self, ids: Sequence[int]) -> str:
        if self.skip is not None:
            ids = [t for t in ids if not self.skip(t)]
        return self.text.feed(self.decoder.feed(ids))

    def flush(self) -> str:
        return self.text.feed(self.decoder.flush()) + self.text.flush()
