"""Speculative decoding in the engine (issue 30): tokens/s with and without, and the accepted length.

Rows, all in one call:
  demo      the demo model with its shipped drafter (and suffix decoding): mean accepted length on held-out
            prompts (DEMO_PROMPTS), batch-1 greedy tokens/s with and without speculation;
  oracle    slice-12 (random weights): an oracle proposer right with probability p (expected accepted length
            (1 - p^(k+1)) / (1 - p), k = 7: p = 0.5 and 0.72, 2.0 and 3.3): tokens/s at batch 1 and 8 vs no speculation
            (target: accepted length 3.3 at batch 1 >= 2.2x); then the same length from k = 3 drafts (p = 0.87: a
            verification step of 4 tokens reads fewer experts than one of 8) and from k = 7 with every token routed
            to one expert set; beside each fixed-k row the engine choosing k up to 7 itself ("chosen": the default
            a user gets; issue 39's target is >= 90% of the best fixed k's bytes ceiling);
  copy      slice-12, suffix decoding on a copy workload (the output repeats part of the prompt, see
            `slice_rows`) at batch 1 (target >= 1.5x).

Every speculative run is checked against the run without speculation, token for token (greedy).

    PYTHONPATH=src:. python3 bench/bench_spec.py             # device: demo + slice-12, $OUT/bench_spec.json
    PYTHONPATH=src:. python3 bench/bench_spec.py --cpu-demo  # the demo rows on the CPU
    PYTHONPATH=src:. python3 bench/bench_spec.py --slice-only  # device: the slice-12 rows alone
    PYTHONPATH=src:. python3 bench/bench_spec.py --paths-only  # device: the paths' logprobs vs a full forward
    (device flags: --profile, the host and device time of the copy row's verification steps; --replay-profile,
    only the kernels of a verification graph beside a decode graph of as many tokens; --shared-only, only the
    oracle row with every token routed to one expert set; --token-map, only the oracle rows at 3.3 on the slice with
    its attention outputs zeroed, see `token_map_rows`)
    PYTHONPATH=src:. python3 bench/bench_spec.py --smoke     # CPU check of this script at toy sizes
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import replace

import torch

from bench.common import DEVICE, capture_graphs, environment, smoke_config, sync, table, write_json
from kimik3.inference import SamplingParams
from kimik3.inference.engine import Engine, EngineConfig, Request, SpeculativeConfig
from kimik3.inference.spec.oracle import OracleProposer, expected_accepted_length, p_for_accepted_length
from kimik3.model import K3ForCausalLM

# short_k: the batch-1 row that reaches the last p's accepted length from fewer drafts
SIZES = {"device": dict(new=128, prompt=256, ps=(0.5, 0.72), k=7, short_k=3, batches=(1, 8), demo_new=128),
         "cpu-demo": dict(new=0, prompt=0, ps=(), k=7, short_k=3, batches=(), demo_new=48),
         "smoke": dict(new=12, prompt=40, ps=(0.5, 0.8), k=3, short_k=2, batches=(1, 2), demo_new=8)}
HEADER = ["row", "accepted length", "tok/s off", "tok/s on", "speedup", "greedy vs off"]
# held out: openings from the demo's validation works (Othello, Twelfth Night, the Sonnets; recipes/demo/prepare.py),
# which neither the demo model nor its drafter trained on
DEMO_PROMPTS = ["OTHELLO:\nIt is the cause, it is the cause, my soul,", "IAGO:\nO, beware, my lord, of jealousy;",
                "DUKE:\nIf music be the food of love, play on,", "XVIII\n\nShall I compare thee to a summer's day?"]


def engine_for(model, prompts, new: int, graphs: bool | None, speculative=None) -> Engine:
    """An engine sized for the prompts run together, no prefix cache (the same sizes give the same graphs, spans
    and so the same sums: the fixed points below and the timed runs share them)."""
    budget = max(64, sum(map(len, prompts)))
    engine = Engine(model, EngineConfig(max_num_seqs=len(prompts), max_num_batched_tokens=budget,
                                        max_model_len=max(map(len, prompts)) + new + 8, enable_prefix_cache=False,
                                        use_cuda_graphs=graphs, speculative=speculative))
    capture_graphs(engine)  # before any timed run
    return engine


def timed(model, prompts, new: int, speculative=None, graphs: bool | None = False
          ) -> tuple[list[list[int]], float, Engine]:
    """(greedy outputs, tokens/s, the engine) for the prompts run together."""
    engine = engine_for(model, prompts, new, graphs, speculative)
    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    engine.generate(prompts, params)  # warm: kernels, graphs, autotuning
    if speculative is not None:  # a fresh proposer: nothing it kept from the warm-up run
        engine = engine_for(model, prompts, new, graphs, speculative)
    sync()
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync()
    dt = time.perf_counter() - t
    return [o.outputs[0].token_ids for o in outs], len(prompts) * new / dt, engine


def step_times(engine: Engine, prompts, new: int, profile: bool = False) -> dict:
    """Median ms of the engine's verification and decode steps over one more run of the prompts (synchronised
    around each step); `profile`: the host and device time of four verification steps, by op."""
    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"steps-{i}", p, params))
    times: dict[str, list[float]] = {"verify": [], "decode": []}
    parts: dict[str, float] = {"forward": 0.0, "verify": 0.0, "commit": 0.0}

    def timing(obj, name: str, part: str):  # the wrapped call, synchronised, its ms summed into parts[part]
        real = getattr(obj, name)

        def call(*args, **kw):
            sync()
            t0 = time.perf_counter()
            out = real(*args, **kw)
            sync()
            parts[part] += (time.perf_counter() - t0) * 1e3
            return out
        setattr(obj, name, call)
        return real

    runner, spec = engine.runner, engine.speculator
    originals = [(runner, "run", timing(runner, "run", "forward")),
                 (runner, "commit", timing(runner, "commit", "commit")),
                 (spec, "verify", timing(spec, "verify", "verify"))]
    split: dict[str, float] = {}
    prof, profiled = None, 0
    while engine.has_unfinished():
        drafts = engine.speculator.stats.as_metrics()["spec_decode_num_drafts"]
        if profile and prof is None and times["verify"]:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            prof = torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        sync()
        t = time.perf_counter()
        engine.step()
        sync()
        ms = (time.perf_counter() - t) * 1e3
        verified = engine.speculator.stats.as_metrics()["spec_decode_num_drafts"] > drafts
        times["verify" if verified else "decode"].append(ms)
        if verified and len(times["verify"]) > 1:  # the first verification step's parts: not counted (warm-up)
            for key, v in parts.items():
                split[key] = split.get(key, 0.0) + v
            split["step"] = split.get("step", 0.0) + ms
        parts.update(dict.fromkeys(parts, 0.0))
        if prof is not None and profiled < 4:
            profiled += verified
            if profiled == 4 or not engine.has_unfinished():
                prof.__exit__(None, None, None)
                profiled = 4
                print(f"-- profile: {profiled} engine steps with verification (host, then device)", flush=True)
                for key in ("self_cpu_time_total", "self_device_time_total"):
                    print(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60), flush=True)
    for obj, name, real in originals:
        setattr(obj, name, real)
    # the captured graphs alone (their inputs as the last step left them): device time with no host work between
    replay = {}
    graphs = [(f"step rows={r} span={sp} row_len={L}", g.graph) for (r, sp, L), g in runner.graphs.items()
              if r == min(b for b in runner.sizes if b >= len(prompts))]
    graphs += [(f"commit rows={r}", g.graph) for r, g in runner.commit_graphs.items()
               if r == min(b for b in runner.verify_sizes if b >= len(prompts))]
    for name, graph in graphs:
        if graph is None:
            continue
        sync()
        t = time.perf_counter()
        for _ in range(20):
            graph.replay()
        sync()
        replay[name] = (time.perf_counter() - t) * 1e3 / 20
    med = lambda x: sorted(x)[len(x) // 2] if x else float("nan")  # noqa: E731
    n = max(len(times["verify"]) - 1, 1)
    # mean ms of a verification step's parts (forward: the runner's run; verify: the acceptance on the host;
    # commit: the KDA commit; step: the whole engine step), each synchronised on its own (so they add up)
    return {"verify_step_ms": med(times["verify"]), "decode_step_ms": med(times["decode"]),
            "verify_steps": len(times["verify"]), "decode_steps": len(times["decode"]),
            "verify_step_parts_ms": {k: v / n for k, v in split.items()}, "graph_replay_ms": replay}


def divergence(outs: list[list[int]], refs: list[list[int]], margins: list[list[float]] | None) -> str:
    """"exact", or where the first row that differs leaves the run without speculation and the top-2 logprob gap
    of the run without speculation there (bf16 kernels sum differently over a verify step's rows than over one
    decode row: a near-tie there can flip; the reference ops are bitwise equal, tests/inference)."""
    for i, (o, r) in enumerate(zip(outs, refs)):
        if o != r:
            t = next(j for j, (a, b) in enumerate(zip(o, r)) if a != b)
            gap = f", top-2 gap {margins[i][t]:.3f} nats" if margins is not None else ""
            return f"row {i} from token {t}{gap}"
    return "exact"


def top2_gaps(model, prompts, new: int, graphs: bool) -> list[list[float]]:
    """Per row and generated token: the gap between the two largest logprobs, without speculation."""
    outs = engine_for(model, prompts, new, graphs).generate(
        prompts, SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True, logprobs=2))
    return [[lp.top[0][1] - lp.top[1][1] for lp in o.outputs[0].logprobs] for o in outs]


def check(name: str, outs, refs, margins, exact: bool, result: dict) -> None:
    """Record how the speculative greedy run compares with the one without; on the reference ops (`exact`) assert
    equality."""
    how = divergence(outs, refs, margins)
    result["greedy_vs_off"] = how
    if exact:
        assert how == "exact", f"{name}: speculative greedy differs ({how})"
    elif how != "exact":
        print(f"{name}: speculative greedy differs at {how}", flush=True)


def demo_rows(s: dict, results: dict, rows: list) -> None:
    from kimik3.checkpoint.loader import load
    from kimik3.presets import DEMO_DRAFTER, DEMO_MODEL
    from kimik3.tokenizer import Tokenizer

    lm = load(DEMO_MODEL, dtype=torch.float32, text_only=True, quiet=True, device=DEVICE).language_model.eval()
    tok = Tokenizer.from_file(DEMO_MODEL / "tiktoken.model")
    prompts = [tok.encode(p) for p in DEMO_PROMPTS]
    # fp32, where greedy with speculation is the same tokens (`kimik3 generate --dtype float32`; without the flag
    # it loads the demo's bf16, where a near-tie can flip: docs/speculative.md); graphs: the engine's default
    new, graphs = s["demo_new"], None
    base = [timed(lm, [p], new, graphs=graphs) for p in prompts]
    off = sum(b[1] for b in base) / len(base)
    # k as a user gets it: `--speculative-method` without `--num-speculative-tokens` (SpeculativeConfig's default:
    # up to 4, the engine choosing each step's)
    for name, cfg in (("draft", SpeculativeConfig("draft", str(DEMO_DRAFTER))),
                      ("suffix", SpeculativeConfig("suffix"))):
        runs = [timed(lm, [p], new, cfg, graphs) for p in prompts]
        assert all(r[0] == b[0] for r, b in zip(runs, base)), f"demo {name}: speculative greedy differs"
        acc = sum(r[2].speculator.stats.mean_accepted_length for r in runs) / len(runs)
        on = sum(r[1] for r in runs) / len(runs)
        results[f"demo {name}"] = dict(accepted_length=acc, tokens_per_s=on, tokens_per_s_off=off, speedup=on / off)
        rows.append([f"demo {name} B=1", f"{acc:.2f}", f"{off:.1f}", f"{on:.1f}", f"{on / off:.2f}x", "exact"])
        print(" | ".join(rows[-1]), flush=True)


def fixed_point(model, prompts_of, proposer_of, ref: list[list[int]], new: int, k: int, graphs: bool,
                max_passes: int, adaptive: bool = False) -> tuple[list[list[int]], int]:
    """The continuation a benchmark's proposer drafts from, made the speculative run's own greedy output: run on
    `prompts_of(ref)` with `proposer_of(ref)` (a fresh one each pass), make the output the reference, again, until
    the output is its reference or `max_passes` ran. On bf16 kernels a verification step's rows sum differently
    from decode's, and near a tie of the random slice that picks another token (the paths row measures how far the
    paths are apart); a proposer drafting the other run's tokens then drafts nothing from there on. The passes
    agree on a longer prefix each time (the same drafts, rows and kernels up to where they first differ).
    Returns (that reference, passes)."""
    engine = engine_for(model, prompts_of(ref), new, graphs,
                        SpeculativeConfig(OracleProposer([], 0.0, 1), None, k, adaptive=adaptive))
    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    for n in range(1, max_passes + 1):
        engine.speculator.proposer = proposer_of(ref)
        out = [o.outputs[0].token_ids for o in engine.generate(prompts_of(ref), params)]
        if out == ref:
            return ref, n
        ref = out
    return ref, max_passes


@contextlib.contextmanager
def shared_routing(model):
    """Within the block every MoE layer selects the same top-k experts for every token (a selection bias of 1e4 on
    its first top_k experts; the bias only selects, the weights stay the scores')."""
    gates = [m.gate for m in model.modules() if hasattr(m, "gate") and hasattr(m.gate, "e_score_correction_bias")]
    saved = [gate.e_score_correction_bias.clone() for gate in gates]
    for gate in gates:
        gate.e_score_correction_bias[: gate.top_k] += 1e4
    try:
        yield
    finally:
        for gate, bias in zip(gates, saved):
            gate.e_score_correction_bias.copy_(bias)


@contextlib.contextmanager
def attention_off(model):
    """Every attention layer's o_proj zeroed: the model becomes a map from each token to its next (see the copy
    row in `slice_rows`)."""
    projs = [m.o_proj for m in model.modules() if hasattr(m, "o_proj") and hasattr(m, "g_proj")]
    assert projs, "no attention layer found"
    saved = [proj.weight.clone() for proj in projs]
    for proj in projs:
        proj.weight.zero_()
    try:
        yield
    finally:
        for proj, w in zip(projs, saved):
            proj.weight.copy_(w)


def bytes_ratio(model, tokens: int) -> float:
    """The bytes a verification step of `tokens` independently routed tokens of one sequence reads over a decode
    step's (`bench.build.step_weight_bytes`; on slice-12: 1.83x for 8 tokens, 1.40x for 4; BENCHMARKS.md, "the
    bytes ceiling")."""
    from bench.build import step_weight_bytes

    return step_weight_bytes(model, tokens) / step_weight_bytes(model, 1)


def best_ceiling(model, p: float, ks) -> tuple[int, float]:
    """(k, bytes ceiling) of the best fixed k of `ks` at batch 1 for an oracle right with probability p: its expected
    accepted length over its verification step's bytes ratio."""
    return max(((k, expected_accepted_length(p, k) / bytes_ratio(model, 1 + k)) for k in ks), key=lambda x: x[1])


def oracle_row(model, name: str, prompts, s: dict, p: float, results: dict, rows: list, exact: bool,
               adaptive: bool = False, ceiling: bool = True) -> None:
    """One oracle row: the run without speculation, the oracle's fixed point, the timed run and its steps. k is
    s["k"], or (`adaptive`) the engine's choice up to it each step: the row then reports the mean draft length.
    At batch 1 with independent routing (`ceiling`) it reports the bytes ceiling: a fixed k's at its accepted length,
    and for the engine's choice the best fixed k's, with the share of it reached (issue 39's target: >= 90%)."""
    V, k, new, graphs = model.config.vocab_size, s["k"], s["new"], DEVICE.type == "cuda"
    ref, off, _ = timed(model, prompts, new, graphs=graphs)
    gaps = None if exact else top2_gaps(model, prompts, new, graphs)
    target, passes = fixed_point(model, lambda _: prompts, lambda r: OracleProposer(
        [q + t for q, t in zip(prompts, r)], p, V, seed=1), ref, new, k, graphs, max_passes=24, adaptive=adaptive)
    proposer = OracleProposer([q + r for q, r in zip(prompts, target)], p, V, seed=1)
    out, on, engine = timed(model, prompts, new, SpeculativeConfig(proposer, None, k, adaptive=adaptive), graphs)
    stats = engine.speculator.stats
    acc = stats.mean_accepted_length
    r = results[name] = dict(accepted_length=acc, expected=expected_accepted_length(p, k), tokens_per_s=on,
                             tokens_per_s_off=off, speedup=on / off, fixed_point_passes=passes,
                             vs_its_reference=divergence(out, target, None),
                             mean_draft=stats.spec_decode_num_draft_tokens / max(stats.spec_decode_num_drafts, 1))
    note = ""
    if ceiling and len(prompts) == 1:
        if adaptive:
            best_k, r["bytes_ceiling"] = best_ceiling(model, p, engine.speculator.lengths.lengths)
            note = f"; {r['speedup'] / r['bytes_ceiling']:.0%} of the best fixed k's ({best_k}) bytes ceiling"
        else:
            r["bytes_ceiling"] = acc / bytes_ratio(model, 1 + k)
            note = f"; {r['speedup'] / r['bytes_ceiling']:.0%} of its bytes ceiling"
        note = f"; mean draft {r['mean_draft']:.2f}, bytes ceiling {r['bytes_ceiling']:.2f}x" + note
    check(name, out, ref, gaps, exact, r)
    r.update(step_times(engine, prompts, new))
    print(f"{name} steps: {r}", flush=True)
    rows.append([name, f"{acc:.2f}", f"{off:.1f}", f"{on:.1f}", f"{on / off:.2f}x",
                 f"{r['greedy_vs_off']}; oracle's reference: {r['vs_its_reference']} ({passes} passes){note}"])
    print(" | ".join(rows[-1]), flush=True)


def slice_rows(model, s: dict, results: dict, rows: list, exact: bool, profile: bool = False) -> None:
    """The oracle and copy rows; `exact`: the model runs the reference ops (CPU), so speculation must not change a
    token (on the GPU's bf16 kernels the rows report where it first does, and how close a call that was)."""
    V, k, new, graphs = model.config.vocab_size, s["k"], s["new"], DEVICE.type == "cuda"
    g = torch.Generator().manual_seed(0)
    oracle_rows(model, "", s["ps"], g, s, results, rows, exact)
    # the same with every token routed to one expert set (the router's selection bias): a verified row then reads
    # the experts a decode token reads, so the row measures the engine apart from the random routing's expert bytes
    with shared_routing(model):
        prompts = [torch.randint(0, min(V, 1000), (s["prompt"],), generator=g).tolist()]
        oracle_row(model, f"oracle B=1 p={s['ps'][-1]}, one expert set", prompts, s, s["ps"][-1], results, rows,
                   exact, ceiling=False)
    # copy workload: random weights never copy, so the row runs the slice with every attention's o_proj zeroed
    # (`attention_off`): each position's logits are then a function of its own token (no positions, nothing mixes
    # them), greedy decoding follows a token map, and a prompt x + y + x with y = greedy(x) is continued by y. The
    # step reads the same bytes and runs the same kernels as the slice's. y is the suffix-decoding run's own output
    # (a fixed point, as the oracle's reference: bf16 paths sum differently near a tie)
    from kimik3.inference.spec import SuffixProposer

    with attention_off(model):
        x = torch.randint(0, min(V, 1000), (s["prompt"] // 2,), generator=g).tolist()
        y, _, _ = timed(model, [x], new, graphs=graphs)
        (y,), passes = fixed_point(model, lambda r: [x + r[0] + x], lambda _: SuffixProposer(), y, new, k, graphs,
                                   max_passes=12)
        copy_row(model, x + y + x, y, passes, s, results, rows, exact, profile)


def copy_row(model, prompt, y, passes: int, s: dict, results: dict, rows: list, exact: bool, profile: bool) -> None:
    """The copy row: suffix decoding on `prompt`, whose greedy continuation is `y` (found by `fixed_point`)."""
    new, k, graphs = s["new"], s["k"], DEVICE.type == "cuda"
    ref, off, _ = timed(model, [prompt], new, graphs=graphs)
    out, on, engine = timed(model, [prompt], new, SpeculativeConfig("suffix", None, k, adaptive=False), graphs)
    acc = engine.speculator.stats.mean_accepted_length
    r = results["copy suffix B=1"] = dict(accepted_length=acc, tokens_per_s=on, tokens_per_s_off=off,
                                          speedup=on / off, fixed_point_passes=passes,
                                          vs_copied_text=divergence(out, [y], None),
                                          distinct_tokens_copied=len(set(y)))
    check("copy suffix B=1", out, ref, None if exact else top2_gaps(model, [prompt], new, graphs), exact, r)
    r.update(step_times(engine, [prompt], new, profile=profile))
    print(f"copy suffix B=1 steps: {r}", flush=True)
    rows.append(["copy suffix B=1", f"{acc:.2f}", f"{off:.1f}", f"{on:.1f}", f"{on / off:.2f}x",
                 f"{r['greedy_vs_off']}; the copied text: {r['vs_copied_text']} ({passes} passes, "
                 f"{len(set(y))} distinct tokens)"])
    print(" | ".join(rows[-1]), flush=True)


def oracle_rows(model, prefix: str, ps, g: torch.Generator, s: dict, results: dict, rows: list, exact: bool) -> None:
    """The oracle rows at each p and batch size, prompts drawn from `g`; at batch 1 also the last p's accepted
    length from short_k drafts (1 + short_k tokens verified: fewer experts read)."""
    V = model.config.vocab_size
    for B in s["batches"]:
        prompts = [torch.randint(0, min(V, 1000), (s["prompt"],), generator=g).tolist() for _ in range(B)]
        for p in ps:
            oracle_row(model, f"{prefix}oracle B={B} p={p}", prompts, s, p, results, rows, exact)
            oracle_row(model, f"{prefix}oracle B={B} p={p} k<={s['k']} chosen", prompts, s, p, results, rows, exact,
                       adaptive=True)
        if B == 1:
            short = {**s, "k": s["short_k"]}
            q = p_for_accepted_length(expected_accepted_length(ps[-1], s["k"]), short["k"])
            oracle_row(model, f"{prefix}oracle B=1 p={q:.3f} k={short['k']}", prompts, short, q, results, rows, exact)
            oracle_row(model, f"{prefix}oracle B=1 p={q:.3f} k<={s['k']} chosen", prompts, s, q, results, rows,
                       exact, adaptive=True)


def token_map_rows(model, s: dict, results: dict, rows: list, exact: bool) -> None:
    """The oracle rows at the last p on the slice as a token map (`attention_off`, as the copy row): on the random
    slice a verification step's tokens differ from decode's near ties (the paths row), so the oracle's reference, a
    fixed point, can end before the run does and the steps after it decode undrafted; the token map has no such
    drift, at the same bytes and kernels."""
    with attention_off(model):
        oracle_rows(model, "token map: ", s["ps"][-1:], torch.Generator().manual_seed(0), s, results, rows, exact)


def path_rows(model, results: dict, rows: list, new: int = 24, k: int = 7) -> None:
    """Where speculative greedy leaves the run without it on bf16 kernels: the logprob of each generated token as
    decode steps compute it, as verification chunks compute it (an oracle that drafts the decode run's tokens,
    p = 1, with CUDA graphs as the timed rows run), as a prefill computes it (`prompt_logprobs`), and as the full
    forward without a cache does (the reference): the largest difference of each path from the reference, over
    the tokens up to where the verified run first picks another token."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 1000, (256,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True, logprobs=1)
    graphs = DEVICE.type == "cuda"
    cfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=512, max_model_len=512, enable_prefix_cache=False,
                       use_cuda_graphs=graphs)
    dec = Engine(model, cfg).generate([prompt], params)[0].outputs[0]
    proposer = OracleProposer([prompt + dec.token_ids], 1.0, model.config.vocab_size)
    spec = SpeculativeConfig(proposer, None, k, adaptive=False)
    ver = Engine(model, replace(cfg, speculative=spec)).generate([prompt], params)[0]
    ver = ver.outputs[0]
    same = next((j for j, (a, b) in enumerate(zip(ver.token_ids, dec.token_ids)) if a != b), new)
    full_ids = prompt + dec.token_ids
    pre = Engine(model, cfg).generate([full_ids], SamplingParams(temperature=0, max_new_tokens=1, prompt_logprobs=0))
    pre_lp = [e.logprob for e in pre[0].prompt_logprobs[len(prompt):]]
    logits = model(torch.tensor([full_ids], device=DEVICE))
    logits = (logits.logits if hasattr(logits, "logits") else logits)[0, len(prompt) - 1: -1].float()
    ref = logits.log_softmax(-1).gather(1, torch.tensor(dec.token_ids, device=DEVICE)[:, None])[:, 0].tolist()
    err = lambda lps, n: max(abs(a - b) for a, b in zip(lps[:n], ref[:n]))  # noqa: E731
    out = {"tokens_compared": same, "decode": err([e.logprob for e in dec.logprobs], new),
           "verify": err([e.logprob for e in ver.logprobs], max(same, 1)), "prefill": err(pre_lp, new)}
    results["paths"] = out
    print(f"paths: {out}", flush=True)
    for name in ("decode", "verify", "prefill"):
        n = out["tokens_compared"] if name == "verify" else new
        rows.append([f"|logprob - full forward|, {name}", f"{out[name]:.2e}", f"over {n} tokens", "", "", ""])


def replay_profiles(model, prompt_len: int = 256, k: int = 7) -> None:
    """The kernels of one verification graph (1 row of 1 + k tokens) beside the decode graph of as many tokens
    (1 + k rows of 1), each replayed alone: where the verification step's extra device time goes."""
    from bench.common import profile_top

    prompts = [list(range(prompt_len))]
    engine = Engine(model, EngineConfig(max_num_seqs=k + 1, max_num_batched_tokens=512, max_model_len=prompt_len + 64,
                                        enable_prefix_cache=False, warmup=True,  # every bucket's graphs
                                        speculative=SpeculativeConfig("suffix", None, k, adaptive=False)))
    engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    for (rows, span, L), g in sorted(engine.runner.graphs.items()):
        if (rows, L) in ((1, k + 1), (k + 1, 1)) and g.graph is not None:
            profile_top(g.graph.replay, f"graph replay: {rows} rows of {L} tokens, span {span} blocks", iters=10)


@torch.no_grad()
def main(mode: str, slice_only: bool = False, paths_only: bool = False, profile: bool = False,
         replay_only: bool = False, shared_only: bool = False, token_map: bool = False) -> None:
    s = SIZES[mode]
    results, rows = {}, []
    if mode != "smoke" and not slice_only:
        demo_rows(s, results, rows)
    if mode == "device":
        from bench.build import experts_backend_of, materialize
        from kimik3.presets import load_config

        with torch.device("meta"):
            model = K3ForCausalLM(load_config("slice-12").text, torch.bfloat16)
        model = materialize(model).eval()
        results["experts"] = experts_backend_of(model)  # Humming's layout where it runs, as `kimik3 serve` does
        print(f"slice-12 experts: {results['experts']}", flush=True)
        if replay_only:
            return replay_profiles(model)
        if token_map:
            token_map_rows(model, s, results, rows, exact=False)
            table("speculative decoding (device, the slice as a token map)", HEADER, rows)
            return write_json("bench_spec", {"mode": "token-map", "sizes": s, "env": environment(), "results": results})
        if shared_only:  # the one-expert-set row alone, 64 new tokens
            with shared_routing(model):
                prompts = [torch.randint(0, 1000, (s["prompt"],), generator=torch.Generator().manual_seed(0)).tolist()]
                oracle_row(model, "oracle B=1 p=0.72, one expert set", prompts, {**s, "new": 64}, 0.72, results, rows,
                           False)
            return table("speculative decoding (device, one expert set)", HEADER, rows)
        path_rows(model, results, rows)
        if not paths_only:
            slice_rows(model, s, results, rows, exact=DEVICE.type != "cuda", profile=profile)
    elif mode == "smoke":
        model = K3ForCausalLM(smoke_config("slice-12").text, torch.float32).init_weights(0).eval()
        path_rows(model, results, rows, new=8, k=3)
        slice_rows(model, s, results, rows, exact=True, profile=profile)
        token_map_rows(model, s, results, rows, exact=True)
    table(f"speculative decoding ({mode})", HEADER, rows)
    write_json("bench_spec", {"mode": mode, "sizes": s, "env": environment(), "results": results})


if __name__ == "__main__":
    flags = sys.argv[1:]
    paths_only = "--paths-only" in flags  # the device's logprob comparison of the paths alone
    replay_only = "--replay-profile" in flags  # the device's kernels of a verification graph beside a decode graph
    shared_only = "--shared-only" in flags  # the device's one-expert-set row alone
    token_map = "--token-map" in flags  # the device's oracle rows at 3.3 with attention outputs zeroed
    slice_only = paths_only or replay_only or shared_only or token_map or "--slice-only" in flags  # slice-12 alone
    options = ("--slice-only", "--paths-only", "--profile", "--replay-profile", "--shared-only", "--token-map")
    flag = next((f for f in flags if f not in options), "")
    main({"--smoke": "smoke", "--cpu-demo": "cpu-demo", "": "device"}[flag], slice_only, paths_only,
         "--profile" in flags, replay_only, shared_only, token_map)
