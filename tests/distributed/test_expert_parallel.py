"""Expert parallelism on CPU: 2 and 4 gloo processes equal one process (inference, gradients, EP + FSDP2 steps).

Every rank builds the same randomized fp32 tiny model (8 experts, top-3) and global batch, takes its own uneven
share of the rows (rank r: r + 1 rows of 32 tokens) and compares its EP result with the single-process model run
in the same worker. One spawn per world size runs every scenario and sends back plain numbers; the tests read
them. The sharded loader is also checked in-process, with a spy on safe_open.get_tensor.

Tolerances. Logits match bit for bit here: each expert sees the same rows in the same order as in one process,
the combine adds in the reference's order, and with >= 4 rows per matmul this CPU's GEMM results do not depend
on the batch. Gradients cannot: backward sums the z gradients of the A slots in another order than autograd
does in one process, which moves the KDA dt_bias/A_log gradients (long fp32 sums) by up to ~5e-6 relative
(everything else <~1e-6), so per-tensor gradients are held to the fp32 bound 1e-5 and all of them together to
1e-6. The two optimizer steps use SGD with momentum: Adam's first step is ~lr * sign(g), which turns that
gradient noise on near-zero entries into ~1e-5 weight differences (measured), so it cannot test 1e-6.
"""

from __future__ import annotations

import copy
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from kimik3.checkpoint import load, save
from kimik3.checkpoint.inventory import without_vision
from kimik3.checkpoint.keys import parse_expert_key
from kimik3.checkpoint.sharded import ExpertShard, slice_experts
from kimik3.config import K3Config
from kimik3.distributed import expert_parallel as ep
from kimik3.distributed.parallelize import parallelize
from kimik3.model import K3ForCausalLM, K3ForConditionalGeneration
from kimik3.model.moe import Experts, LatentMoE, MXFP4Experts
from kimik3.quant import pack_experts
from tests.helpers import CONFIGS, free_port, randomize

T = 32  # tokens per row: enough that every expert's matmuls see >= 4 rows
STEPS, LR, MOMENTUM, MAX_NORM = 2, 0.05, 0.9, 0.5


def _cfg() -> K3Config:
    return without_vision(K3Config.from_file(CONFIGS / "tiny.json"))


def _rows(rank: int, world: int) -> slice:
    start = rank * (rank + 1) // 2  # rank r holds r + 1 rows: uneven token counts across ranks
    return slice(start, start + rank + 1)


def _batch(world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, _cfg().text.vocab_size, (world * (world + 1) // 2, T), generator=g)


def _ce_sum(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1),
                           reduction="sum")


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    den = ref.double().norm()
    diff = (out.double() - ref.double()).norm()
    return float(diff / den) if den > 0 else float(diff)


def _compare(model: torch.nn.Module, ref: torch.nn.Module, value) -> dict:
    """value(param) vs value(ref param): worst relative error over non-expert and over expert tensors, and over
    all of them together. An expert tensor is compared with the rows of the reference this rank holds; FSDP
    DTensors are gathered (a collective: every rank calls this)."""
    shards = {n: m.expert_shard for n, m in model.named_modules() if getattr(m, "expert_shard", None)}
    ref_params = dict(ref.named_parameters())
    out, diff2, ref2 = {"dense": 0.0, "expert": 0.0}, 0.0, 0.0
    for name, p in model.named_parameters():
        want, got = value(ref_params[name]), value(p)
        want = torch.zeros_like(ref_params[name]) if want is None else want  # the unused layer-0 pseudo-query
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        shard = shards.get(name.rsplit(".", 1)[0])
        if shard is not None:
            want = want[shard.start:shard.stop]
        got = torch.zeros_like(want) if got is None else got  # no rows reached these experts: no gradient
        kind = "expert" if shard is not None else "dense"
        out[kind] = max(out[kind], _rel(got, want))
        diff2 += float((got.double() - want.double()).square().sum())
        ref2 += float(want.double().square().sum())
    out["all"] = (diff2 / ref2) ** 0.5
    return out


def _accumulate(ref: K3ForCausalLM, ids: torch.Tensor, world: int) -> float:
    """One process over the same global batch: every rank's rows as one micro-batch, gradients accumulated
    (as in the FSDP test's 1 rank x N micro-batches). Returns the global mean CE."""
    n, total = ids[:, 1:].numel(), 0.0
    for r in range(world):
        loss = _ce_sum(ref(ids[_rows(r, world)]), ids[_rows(r, world)]) / n
        loss.backward()
        total += float(loss)
    return total


def _inference(rank: int, world: int, ref: K3ForCausalLM, ids: torch.Tensor) -> dict:
    widths, real = [], ep._exchange

    def spy(x, send, recv, group):
        widths.append(tuple(x.shape[1:]))
        return real(x, send, recv, group)

    rows = _rows(rank, world)
    with torch.no_grad():
        ep._exchange = spy
        model = ep.apply_expert_parallel(copy.deepcopy(ref))
        out = {"fp32": _rel(model(ids[rows]), ref(ids)[rows]), "exchanges": len(widths), "widths": sorted(set(widths))}
        ep._exchange = real
        twin = copy.deepcopy(model)  # runs its own experts, not the original's
        out["copy"] = all(m.experts.weights.__self__ is m.experts for m in twin.modules() if isinstance(m, LatentMoE))
        packed = pack_experts(copy.deepcopy(ref))
        out["mxfp4"] = _rel(ep.apply_expert_parallel(copy.deepcopy(packed))(ids[rows]), packed(ids)[rows])
        bf16 = randomize(K3ForCausalLM(_cfg().text, torch.bfloat16), seed=0)
        out["bf16"] = _rel(ep.apply_expert_parallel(copy.deepcopy(bf16))(ids[rows]), bf16(ids)[rows])
    return out


def _gradients(rank: int, world: int, ref: K3ForCausalLM, ids: torch.Tensor) -> dict:
    """Plain losses CE_r / N: non-expert gradients all-reduced (SUM), expert gradients used as they are."""
    ref, rows = copy.deepcopy(ref), _rows(rank, world)
    model = ep.apply_expert_parallel(copy.deepcopy(ref))
    ref_loss = _accumulate(ref, ids, world)
    loss = _ce_sum(model(ids[rows]), ids[rows]) / ids[:, 1:].numel()
    loss.backward()
    experts = {id(p) for p in ep.expert_parameters(model)}
    for p in model.parameters():
        if id(p) not in experts and p.grad is not None:
            dist.all_reduce(p.grad)
    total = loss.detach().clone()
    dist.all_reduce(total)
    router = model.model.layers[1].block_sparse_moe.gate.weight.grad
    return {"loss": abs(float(total) / ref_loss - 1), "router": float(router.norm()),
            **_compare(model, ref, lambda p: p.grad), "floor": _fp32_floor(ref, ids)}


def _fp32_floor(ref: K3ForCausalLM, ids: torch.Tensor) -> dict:
    """The fp32 noise floor of the gradient comparison: one process over the whole batch as ONE micro-batch vs
    the accumulated reference. Both are exact in real arithmetic and differ only in summation order, as expert
    parallelism does; measured here, the combined error is ~5e-7 to 7e-7, so a fixed 1e-6 bound on it would sit
    at the floor. Expert parallelism must add no error beyond a small multiple of it."""
    one = copy.deepcopy(ref)
    one.zero_grad()
    (_ce_sum(one(ids), ids) / ids[:, 1:].numel()).backward()
    return _compare(one, ref, lambda p: p.grad)


def _fsdp_steps(rank: int, world: int, ref: K3ForCausalLM, ids: torch.Tensor) -> dict:
    """The trainer's normalization (W * CE_r / N; FSDP averages), activation checkpointing, clipping."""
    n, rows = ids[:, 1:].numel(), _rows(rank, world)
    ref = copy.deepcopy(ref)
    model = parallelize(copy.deepcopy(ref), expert_parallel=True, activation_checkpointing=True,
                        data_parallel=True)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    out = {"loss": 0.0, "norm": 0.0}
    for step in range(STEPS):
        ref_loss = _accumulate(ref, ids, world)
        loss = _ce_sum(model(ids[rows]), ids[rows])
        (loss * (world / n)).backward()
        total = loss.detach() / n
        dist.all_reduce(total)
        out["loss"] = max(out["loss"], abs(float(total) / ref_loss - 1))
        if step == 0:
            out["grads"] = _compare(model, ref, lambda p: p.grad)
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        norm = ep.clip_grad_norm_(model, MAX_NORM)
        out["norm"], out["ref_norm"] = max(out["norm"], abs(norm / ref_norm - 1)), ref_norm
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    out["weights"] = _compare(model, ref, lambda p: p.detach())
    return out


def _sharded_load(rank: int, world: int, ckpt: str, ids: torch.Tensor) -> dict:
    rows = _rows(rank, world)
    with torch.no_grad():
        want = load(ckpt, dtype=torch.float32, keep_experts_packed=True).language_model(ids)[rows]
        model = ep.load_expert_parallel(ckpt, dtype=torch.float32, keep_experts_packed=True).language_model
        held = model.model.layers[1].block_sparse_moe.experts.w1_packed.shape[0]
        return {"rel": _rel(model(ids[rows]), want), "experts": held}


def _worker(rank: int, world: int, port: int, ckpt: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    ids = _batch(world)
    ref = randomize(K3ForCausalLM(_cfg().text, torch.float32), seed=0)
    result = {"inference": _inference(rank, world, ref, ids), "gradients": _gradients(rank, world, ref, ids),
              "fsdp": _fsdp_steps(rank, world, ref, ids), "load": _sharded_load(rank, world, ckpt, ids)}
    queue.put((rank, result))  # plain numbers: a tensor would need this process alive to be read
    dist.barrier()
    dist.destroy_process_group()



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = pack_experts(randomize(K3ForConditionalGeneration(_cfg()), seed=5))
    return save(model, tmp_path_factory.mktemp("ep") / "ck", max_shard_size="300KB", quiet=True)


# four ranks under -m slow (two cover the default run: the 4-rank processes take ~20 s to start on a CPU)
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda w: f"{w}ranks")
def ranks(request, checkpoint) -> list[dict]:
    """Each rank's results of every scenario, for `request.param` gloo processes."""
    world = request.param
    queue = mp.get_context("spawn").Queue()
    mp.start_processes(_worker, args=(world, free_port(), str(checkpoint), queue), nprocs=world,
                       start_method="spawn")
    got = dict(queue.get() for _ in range(world))
    return [got[r] for r in range(world)]


def test_inference_logits_equal_one_process(ranks):
    L, D = _cfg().text.moe.latent_dim, _cfg().text.hidden_size
    moe_layers = sum(_cfg().text.moe_layers)
    for r in ranks:
        got = r["inference"]
        assert got["fp32"] < 1e-6 and got["mxfp4"] < 1e-6 and got["bf16"] < 2e-2, got
        # two all-to-alls per MoE layer, and what travels is the latent width L, never the hidden D
        assert got["exchanges"] == 2 * moe_layers and got["widths"] == [(L,)] and L != D, got
        assert got["copy"], got


def test_training_gradients_equal_one_process(ranks):
    for r in ranks:
        got = r["gradients"]
        assert got["loss"] < 1e-6 and got["router"] > 0, got
        assert got["dense"] < 1e-5 and got["expert"] < 1e-5 and got["all"] < 2 * got["floor"]["all"], got


def test_ep_with_fsdp_two_steps_equal_one_process(ranks):
    for r in ranks:
        got = r["fsdp"]
        grads = got["grads"]  # expert gradients right only with the 1/W scaling (else W times too large)
        floor = r["gradients"]["floor"]["all"]  # the same first-step gradients' fp32 floor (see _fp32_floor)
        assert grads["dense"] < 1e-5 and grads["expert"] < 1e-5 and grads["all"] < 2 * floor, got
        assert got["ref_norm"] > MAX_NORM and got["norm"] < 1e-5, got  # clipping was active, on the same norm
        assert got["loss"] < 1e-6 and got["weights"]["dense"] < 1e-6 and got["weights"]["expert"] < 1e-6, got


def test_sharded_load_runs_expert_parallel(ranks):
    for r in ranks:
        assert r["load"]["rel"] < 1e-6 and r["load"]["experts"] == _cfg().text.moe.num_experts // len(ranks), r


@pytest.mark.parametrize("packed", [True, False], ids=["mxfp4", "dequantized"])
def test_each_rank_reads_only_its_experts(checkpoint, tensors_read, packed):
    full = load(checkpoint, dtype=torch.float32, keep_experts_packed=packed).state_dict()
    read = tensors_read
    world, E = 4, _cfg().text.moe.num_experts
    for rank in range(world):
        read.clear()
        model = load(checkpoint, dtype=torch.float32, keep_experts_packed=packed, expert_shard=(rank, world))
        keys = [parse_expert_key(n) for n in read]
        assert {k.expert for k in keys if k is not None} == set(range(rank * E // world, (rank + 1) * E // world))
        assert None in keys  # and the replicated tensors
        state = model.state_dict()
        assert state.keys() == full.keys()
        for name, t in state.items():
            want = full[name][rank * E // world:(rank + 1) * E // world] if ".experts." in name else full[name]
            assert torch.equal(t, want), name


def test_slicing_keeps_names_and_rejects_bad_sizes(tiny_config):
    model = K3ForCausalLM(tiny_config.text, torch.float32)
    before = {n: t.shape for n, t in model.state_dict().items()}
    slice_experts(model, 1, 4)
    after = {n: t.shape for n, t in model.state_dict().items()}
    assert after.keys() == before.keys()
    assert all(after[n] == ((2,) + before[n][1:] if ".experts." in n else before[n]) for n in before)
    assert all(isinstance(m.experts, Experts) for m in model.modules() if isinstance(m, LatentMoE))
    assert slice_experts(model, 1, 4) is model  # already cut the same way: unchanged
    with pytest.raises(ValueError, match="already sharded"):
        slice_experts(model, 0, 4)
    with pytest.raises(ValueError, match="num_experts"):
        slice_experts(K3ForCausalLM(tiny_config.text, torch.float32), 0, 3)
    with pytest.raises(ValueError, match="num_experts"):
        ExpertShard(0, 3, 8)
    with torch.device("meta"):  # structure only
        packed = slice_experts(pack_experts(K3ForCausalLM(tiny_config.text, torch.float32)), 0, 2)
    moes = [m for m in packed.modules() if isinstance(m, LatentMoE)]
    assert all(isinstance(m.experts, MXFP4Experts) and m.experts.w1_packed.shape[0] == 4 for m in moes)


def test_load_and_apply_need_valid_arguments(checkpoint, tiny_config):
    with pytest.raises(ValueError, match="num_experts"):
        load(checkpoint, expert_shard=(0, 3))
    with pytest.raises(ValueError, match="process group"):
        ep.apply_expert_parallel(K3ForCausalLM(tiny_config.text, torch.float32))
