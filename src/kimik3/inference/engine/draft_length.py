"""How many tokens a speculative step drafts (issue 39): chosen each step from each sequence's measured acceptance
and the measured cost of a step of each verification width, so that the step commits the most tokens per second.
`--num-speculative-tokens` is the ceiling. Where drafting loses (acceptance fallen, as it does late in long
contexts; verification dear against its tokens: many rows that cannot draft, a slow proposer) the step drafts
nothing and replays the decode graph.

Legend: b the step's batch bucket (the graphs' row count), k draft tokens per row (0: a decode step), a a
sequence's acceptance rate.

Why one k per step and not per sequence: a graphed verification step pads every row to 1 + k, so its cost is set by
the widest row, and a shorter draft beside it saves nothing. The step's k is therefore chosen over all its rows
(each sequence's expected tokens at that k, summed, against the step's cost), and every drafting sequence drafts up
to it (fewer where its length limits leave fewer). Seeded sampling requests keep the ceiling: speculative sampling
is exact for any k, but which random numbers a row draws depends on its k, and a k chosen from timings would make a
seeded request's text differ from run to run. Greedy tokens do not depend on k (the verification rule keeps the
argmax), so greedy rows follow the choice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kimik3.inference.spec.oracle import expected_accepted_length

PRIOR = 0.5  # the acceptance rate assumed before any draft was verified
PRIOR_WEIGHT = 4.0  # in tried draft tokens: how much evidence the prior (a sequence's: the engine's) is worth
DECAY = 0.9  # per verification, so a rate that falls late in a long generation is followed
PROBE_EVERY = 4  # steps without drafts before one drafts again (k = 1), to measure acceptance afresh: text is
# predictable in spans, and on the demo (CPU) probing every 4 steps ran 3-4% faster than every 16
PROPOSER_RATE = 0.25  # how far one timed proposal moves the proposer's cost


def draft_lengths(ceiling: int) -> tuple[int, ...]:
    """The draft lengths a step may verify: those of 1, 3, 7, 15 (rows of a power of two) up to half the ceiling,
    and the ceiling. Each has its own verification graphs, so their number grows with log k, not k; a length
    close under the ceiling (3 under 4) would add graphs for a step one token narrower."""
    return tuple(sorted({k for k in (1, 3, 7, 15) if 2 * k <= ceiling} | {ceiling}))


@dataclass
class Acceptance:
    """Decayed counts of one sequence's (or the engine's) verified drafts: `tried`, the draft tokens verification
    reached (the accepted ones and the first rejected one), `accepted`, those kept; `asked` and `drafted`, the
    steps a draft was asked for and the steps the proposer returned one (suffix decoding often has no match)."""

    accepted: float = 0.0
    tried: float = 0.0
    asked: float = 0.0
    drafted: float = 0.0

    def record(self, drafted: int, accepted: int) -> None:
        """A draft of `drafted` tokens (0: asked, none proposed) of which `accepted` were kept."""
        d = DECAY
        self.asked, self.drafted = self.asked * d + 1, self.drafted * d + (drafted > 0)
        if drafted:  # the rate decays by verifications, not by steps without a draft
            self.accepted = self.accepted * d + accepted
            self.tried = self.tried * d + min(drafted, accepted + 1)

    def rate(self, prior: float) -> float:
        """The acceptance rate, `prior` weighing PRIOR_WEIGHT tried tokens (the geometric model's estimate)."""
        return (self.accepted + PRIOR_WEIGHT * prior) / (self.tried + PRIOR_WEIGHT)

    def draft_rate(self) -> float:
        """How often a draft was there when asked for (1 until known)."""
        return (self.drafted + 1) / (self.asked + 1)


class StepCosts:
    """Seconds of a step of b rows that verifies k drafts each (k = 0: decode), per batch bucket: the forward
    measured by `measure(b)` -> {k: seconds} the first time the bucket is asked for (at warm-up, every bucket), plus,
    for k > 0, the proposer's own time, followed as the engine drafts (`proposed`: a drafter's pass)."""

    def __init__(self, measure: Callable[[int], dict[int, float]], buckets: list[int]):
        self.measure, self.buckets = measure, sorted(buckets)
        self.table: dict[tuple[int, int], float] = {}
        self.proposer: dict[int, float] = {}  # bucket -> seconds the proposer takes a step

    def bucket(self, rows: int) -> int:
        return next((b for b in self.buckets if b >= rows), self.buckets[-1])

    def __call__(self, rows: int, k: int) -> float:
        b = self.bucket(rows)
        if (b, 0) not in self.table:
            self.table.update({(b, kk): s for kk, s in self.measure(b).items()})
        return self.table[b, k] + (self.proposer.get(b, 0.0) if k else 0.0)

    def proposed(self, rows: int, seconds: float) -> None:
        """The proposer took `seconds` to draft for a step of `rows` rows."""
        b = self.bucket(rows)
        have = self.proposer.get(b)
        self.proposer[b] = seconds if have is None else have + PROPOSER_RATE * (seconds - have)


@dataclass(frozen=True)
class Row:
    """One running sequence that can draft, as the choice sees it: its proposer's id, the drafts its length limits
    leave (`cap`, at least 1), and whether it keeps the ceiling (a seeded sampling request)."""

    id: int
    cap: int
    fixed: bool = False


class DraftLength:
    """Chooses the step's k (`choose`) and learns from verification (`record`). `adaptive=False`: always the
    ceiling (what `--no-adaptive-speculation` asks for, and the benchmarks' fixed-k rows)."""

    def __init__(self, ceiling: int, adaptive: bool = True):
        self.ceiling, self.adaptive = ceiling, adaptive
        self.lengths = draft_lengths(ceiling) if adaptive else (ceiling,)
        self.costs: StepCosts | None = None  # set by the engine once its runner can time steps
        self.seqs: dict[int, Acceptance] = {}
        self.engine = Acceptance()  # every sequence's verifications: the prior of a sequence with few
        self.idle = 0  # steps since the last one that drafted

    def rate(self, seq_id: int) -> tuple[float, float]:
        """(acceptance rate, draft rate) of a sequence."""
        mine = self.seqs.get(seq_id) or Acceptance()
        return mine.rate(self.engine.rate(PRIOR)), mine.draft_rate()

    def choose(self, rows: list[Row], batch: int) -> int:
        """The step's k for these drafting rows in a step of `batch` rows (those that cannot draft decode beside
        them): the k of `lengths` or 0 that maximizes expected committed tokens per second of the step."""
        if not rows:
            return 0
        fixed = self.ceiling if any(r.fixed for r in rows) else 0
        k = max(fixed, self._best(rows, batch)) if self.adaptive else self.ceiling
        self.idle = 0 if k else self.idle + 1
        return k

    def _best(self, rows: list[Row], batch: int) -> int:
        if self.costs is None:
            return self.ceiling
        if self.idle + 1 >= PROBE_EVERY:  # drafting was off long enough: measure acceptance again, cheaply
            return self.lengths[0]
        rates = [self.rate(r.id) for r in rows]
        others = max(batch - len(rows), 0)  # decode rows: one token whatever k is

        def value(k: int) -> float:
            tokens = sum(1 + d * (expected_accepted_length(a, min(k, r.cap)) - 1) for r, (a, d) in zip(rows, rates))
            return (others + tokens) / self.costs(batch, k)

        return max((0, *self.lengths), key=lambda k: (value(k), -k))

    def record(self, seq_id: int, drafted: int, accepted: int) -> None:
        self.seqs.setdefault(seq_id, Acceptance()).record(drafted, accepted)
        self.engine.record(drafted, accepted)

    def finish(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
