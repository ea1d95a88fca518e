"""The trainer on a tiny Qwen3-MoE: routing replay (R3), route metrics, load balancing (CPU).

Rollouts come from the real engine (``return_routed_experts``); the trainer is the real
``FSDPBackend`` (one process, and FSDP2 on two gloo ranks). In deterministic mode the engine's
routes are the trainer's own and every logprob agrees bit for bit (|dlogprob| = 0, like the dense
families). With other numerics (a bf16 engine, an fp32 trainer) and a near-tied router, the
trainer's own routes differ from the engine's for some tokens: replay makes the experts it
computes with the engine's (``moe/route_mismatch`` 0) and brings its logprobs closer to the
engine's than routing by itself does.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from moe_util import tiny_moe_folder
from noria.config import EngineConfig, TrainConfig
from noria.engine import Engine, GenerateRequest, SamplingParams
from noria.models import load_model
from noria.rollout.buffer import group_from_dict, group_to_dict
from noria.train.fsdp import FSDPBackend, rank_process
from noria.train.packing import pack_samples, replay_rows
from noria.train.prefix_tree import share_prefixes
from noria.types import Group, Prompt, Sample

PROMPT_LENS = [3, 11, 40, 40]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-train")
    return {"plain": tiny_moe_folder(root, "plain"), "tied": tiny_moe_folder(root, "tied", router_scale=0.02)}


def rollout(folder, deterministic: bool, dtype=torch.bfloat16, new_tokens: int = 12) -> list[Sample]:
    config = EngineConfig(kv_cache_tokens=4096, block_size=4, chunked_prefill_size=24, max_batch_tokens=48,
                          attention="torch", deterministic=deterministic)
    engine = Engine(load_model(folder, dtype=dtype), None, config)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    prompts[-1] = list(prompts[-2])  # two samples of one prompt: a shared prefix in the trainer
    params = [SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=i) for i in range(4)]
    try:
        outs = engine.generate_batch([GenerateRequest(p, s, return_routed_experts=True) for p, s in zip(prompts, params)])
    finally:
        engine.shutdown(1)
    return [
        Sample(prompt_ids=p, response_ids=o.output_ids, loss_mask=[1] * len(o.output_ids), rollout_logprobs=o.logprobs,
               weight_versions=o.weight_versions, routed_experts=o.routed_experts)
        for p, o in zip(prompts, outs)
    ]


def trainer(folder, deterministic: bool, dtype: str = "bfloat16", **overrides) -> FSDPBackend:
    cfg = TrainConfig(param_dtype=dtype, algorithm="rl", **overrides)
    cfg.optim.lr = 1e-5
    backend = FSDPBackend(cfg, deterministic=deterministic)
    backend.init(folder)
    return backend


def test_packed_routes_sit_at_the_position_that_predicted_each_token():
    routes = torch.arange(3 * 2 * 2, dtype=torch.int8).view(3, 2, 2)
    a = Sample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10], loss_mask=[1, 0, 1], routed_experts=routes)
    b = Sample(prompt_ids=[5, 6, 7], response_ids=[11, 12, 13], loss_mask=[1, 1, 1], routed_experts=routes + 20)
    batch = pack_samples([a, b], replay_routes=True)
    assert batch.replay_routes and batch.routed_experts.dtype == torch.int8
    # Aligned to the predicted token, non-policy rows -1 (b's token 9 is an environment token).
    assert torch.equal(batch.routed_experts[3], routes[0]) and (batch.routed_experts[4] == -1).all()
    rows = replay_rows(batch)
    assert torch.equal(rows[2], routes[0]) and (rows[3] == -1).all() and torch.equal(rows[4], routes[2])
    assert (rows[:2] == -1).all() and torch.equal(rows[8:11], routes + 20)
    # Prefix tree: the prompt's last position routes differently in the two samples (their first
    # tokens' rows), so the tree splits before it and each sample keeps its own route there.
    shared, keep, _ = share_prefixes(batch, min_prefix=2)
    assert shared.parents.tolist() == [-1, 0, 1, 2, 3, 4, 1, 6, 7, 8]  # [5, 6] shared, then 7 8 9 10 | 7 11 12 13
    assert torch.equal(shared.routed_experts, batch.routed_experts[keep])
    srows = replay_rows(shared)
    assert torch.equal(srows[2], routes[0]) and (srows[3] == -1).all() and torch.equal(srows[4], routes[2])
    assert torch.equal(srows[6:9], routes + 20) and (srows[:2] == -1).all()


def test_routes_of_the_wrong_shape_are_refused_naming_the_sample():
    a = Sample(prompt_ids=[1], response_ids=[2, 3], loss_mask=[1, 1], routed_experts=torch.zeros(3, 2, 2, dtype=torch.int8))
    with pytest.raises(ValueError, match="sample 0: routed_experts"):
        pack_samples([a])


def test_routes_survive_the_buffer_state_in_json():
    routes = torch.randint(-1, 100, (5, 3, 4), dtype=torch.int8)
    group = Group(0, Prompt("p"), (Sample(prompt_ids=[1], response_ids=[2] * 5, loss_mask=[1] * 5, routed_experts=routes),))
    data = json.loads(json.dumps(group_to_dict(group)))  # trainer_state.json keeps the buffer as JSON
    assert len(data["samples"][0]["routed_experts"]["data"]) < 5 * 3 * 4 * 2  # its bytes, not a list of ints
    back = group_from_dict(data).samples[0].routed_experts
    assert back.dtype == torch.int8 and torch.equal(back, routes)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_deterministic_moe_engine_and_trainer_agree_bitwise(folders, dtype):
    """|dlogprob| = 0 at step 0 for a MoE model, routes equal, with and without replay."""
    samples = rollout(folders["plain"], True, getattr(torch, dtype))
    for replay in (False, True):
        batch = pack_samples(samples, torch.linspace(-1, 1, len(samples)).tolist(), replay_routes=replay)
        backend = trainer(folders["plain"], True, dtype, micro_batch_tokens=100, logprob_chunk_tokens=50)
        trained = batch.loss_mask > 0
        lp = backend.compute_logprobs(batch).logprobs[trained]
        assert (lp - batch.rollout_logprobs[trained]).abs().max().item() == 0.0
        metrics = backend.train_step(batch)
        assert metrics["rollout_logprob_abs_diff_max"] == 0.0 and metrics["rollout_kl"] == 0.0
        assert metrics["moe/route_mismatch"] == 0.0 and metrics["moe/router_disagreement"] == 0.0


def test_replay_removes_route_mismatch_and_shrinks_the_logprob_gap(folders):
    """A bf16 engine, an fp32 trainer, a near-tied router: without replay the trainer routes some
    tokens elsewhere; with it, it computes with the engine's experts and its logprobs move closer."""
    samples = rollout(folders["tied"], False, torch.bfloat16, new_tokens=16)
    gaps, metrics = {}, {}
    for replay in (False, True):
        batch = pack_samples(samples, replay_routes=replay)
        backend = trainer(folders["tied"], False, "float32")
        trained = batch.loss_mask > 0
        lp = backend.compute_logprobs(batch).logprobs[trained]
        gaps[replay] = (lp - batch.rollout_logprobs[trained]).abs().mean().item()
        metrics[replay] = backend.train_step(batch)
    print(f"\n[moe replay] gap {gaps} mismatch {[metrics[r]['moe/route_mismatch'] for r in (False, True)]}")
    assert metrics[False]["moe/route_mismatch"] > 0.01
    assert metrics[False]["moe/router_disagreement"] == metrics[False]["moe/route_mismatch"]
    assert metrics[True]["moe/route_mismatch"] == 0.0 and metrics[True]["moe/router_disagreement"] > 0
    assert gaps[True] < gaps[False]
    assert metrics[True]["rollout_logprob_abs_diff"] < metrics[False]["rollout_logprob_abs_diff"]


def test_router_aux_loss_reaches_the_router(folders):
    samples = rollout(folders["plain"], False, torch.float32, new_tokens=6)
    batch = pack_samples(samples, [1.0, -1.0, 0.5, -0.5])
    grads = {}
    for coef in (0.0, 1.0):
        backend = trainer(folders["plain"], False, "float32")
        backend.cfg.loss.router_aux_coef = coef
        metrics = backend.train_step(batch)
        assert ("moe/router_aux_loss" in metrics) == (coef > 0)
        if coef:
            assert 1.0 < metrics["moe/router_aux_loss"] < 4.0  # top-2: 2 at perfect balance, more when skewed
        grads[coef] = torch.cat([p.detach().flatten() for n, p in backend.lm.named_parameters() if n.endswith("mlp.gate.weight")])
    assert not torch.equal(grads[0.0], grads[1.0])


def _fsdp2_worker(rank: int, port: int, folder: str, batch, out) -> None:
    from noria.train.fsdp import init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    init_distributed("cpu")
    backend = trainer(folder, True, backend="fsdp2", world_size=2, micro_batch_tokens=64)
    logprobs = backend.compute_logprobs(batch).logprobs
    metrics = backend.train_step(batch)
    if rank == 0:
        torch.save({"logprobs": logprobs, "metrics": metrics}, out)


def test_replay_under_fsdp2_on_two_ranks(folders, tmp_path):
    samples = rollout(folders["plain"], True, new_tokens=8)
    batch = pack_samples(samples, torch.linspace(-1, 1, len(samples)).tolist(), replay_routes=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_process, args=(_fsdp2_worker, port, str(folders["plain"]), batch, tmp_path / "rank0.pt"), nprocs=2, join=True)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    trained = batch.loss_mask > 0
    assert (got["logprobs"][trained] - batch.rollout_logprobs[trained]).abs().max().item() == 0.0
    assert got["metrics"]["rollout_logprob_abs_diff_max"] == 0.0
    assert got["metrics"]["moe/route_mismatch"] == 0.0
