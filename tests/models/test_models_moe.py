"""Native Qwen3-MoE vs transformers, route capture and replay, load balancing, exact numerics (CPU).

Each case is a random tiny ``Qwen3MoeForCausalLM`` built from transformers' own config class and
saved with ``save_pretrained`` (per-expert tensors on disk), weights re-drawn larger than HF's init
so that routes and logits are far from trivial. Replay is checked against transformers itself, its
router made to return the given experts with R3's weights. Exact mode is checked per token: a
token's bits must not depend on the other tokens of the call (run this file under
``NORIA_CPU_ISA=avx2`` for the AVX2 paths).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from noria.models import CheckpointMismatch, DecoderLM, PackedContext, load_model, save_model
from noria.models.config import ModelArgs, UnsupportedModel
from noria.models.decoder import DETERMINISTIC_ROWS, MLP
from noria.models.moe import NO_ROUTE, Routing, SparseMoeBlock, loop_experts, route_dtype, route_mismatch

TOL = 1e-4
VOCAB = 96
# (experts, top-k, norm_topk_prob, decoder_sparse_step, mlp_only_layers): several expert counts
# and top-k, both weightings, and both ways of keeping a layer dense.
CASES = {
    "e4k1": (4, 1, False, 1, []),
    "e8k2-norm": (8, 2, True, 1, [1]),
    "e16k4-step2": (16, 4, True, 2, []),
    "e6k3": (6, 3, False, 1, [0]),
}


def hf_config(experts: int, top_k: int, norm: bool, step: int, mlp_only: list[int], layers: int = 3, **extra):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=norm, decoder_sparse_step=step, mlp_only_layers=mlp_only, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, **extra,
    )


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else noise / p.shape[-1] ** 0.5)


def tiny_hf(folder, case: str = "e8k2-norm", **extra):
    """A random tiny HF Qwen3-MoE saved to ``folder``; the HF model (eval, fp32)."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(hf_config(*CASES[case], **extra))
    randomize(model)
    model.save_pretrained(folder)
    return model.eval()


def ids(batch: int, seq_len: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = tiny_hf(folder, request.param)
    return request.param, folder, hf, load_model(folder)


@torch.no_grad()
def test_logits_match_transformers(pair):
    case, _, hf, native = pair
    assert isinstance(native, DecoderLM) and native.args.moe is not None
    x = ids(3, 24)
    logits = native(x)
    assert logits.std() > 0.5
    diff = (logits - hf(x).logits).abs().max().item()
    print(f"\n[max-abs-diff] qwen3_moe {case}: {diff:.3e}")
    assert diff <= TOL


def test_sparse_and_dense_layers_follow_transformers(pair):
    _, _, hf, native = pair
    for ours, theirs in zip(native.model.layers, hf.model.layers):
        assert isinstance(ours.mlp, SparseMoeBlock) == (type(theirs.mlp).__name__ == "Qwen3MoeSparseMoeBlock")
        assert isinstance(ours.mlp, MLP) == (type(theirs.mlp).__name__ == "Qwen3MoeMLP")


@torch.no_grad()
def test_captured_routes_are_transformers_top_k(pair):
    _, _, hf, native = pair
    x = ids(2, 16)
    routing = Routing()
    native(x, routing=routing)
    routes = routing.routes()
    k = native.args.moe.top_k
    assert routes.shape == (2, 16, len(native.args.moe_layers), k) and routes.dtype == torch.int8
    theirs = hf(x, output_router_logits=True).router_logits  # one [B*T, E] per MoE layer
    assert len(theirs) == len(native.args.moe_layers)
    want = torch.stack([t.topk(k, dim=-1).indices for t in theirs], dim=1).view(2, 16, -1, k)
    assert route_mismatch(routes, want) == (0, 2 * 16 * len(theirs))


@torch.no_grad()
def test_packed_sequences_equal_sequences_alone(pair):
    _, _, _, native = pair
    a, b = ids(1, 9, seed=3), ids(1, 14, seed=4)
    packed = native(torch.cat([a, b], 1), attn=PackedContext([9, 14]))
    alone = torch.cat([native(a), native(b)], 1)
    assert (packed - alone).abs().max().item() <= 1e-5


def test_save_writes_per_expert_tensors_that_transformers_loads(pair, tmp_path):
    from transformers import Qwen3MoeForCausalLM

    _, folder, hf, native = pair
    out = save_model(native, tmp_path / "saved", max_shard_bytes=40_000, source=folder)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    layer = native.args.moe_layers[0]
    experts = native.args.moe.num_experts
    for e in range(experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" in index
    assert not any(name.endswith(("gate_up_proj", "experts.down_proj")) for name in index)
    reloaded = Qwen3MoeForCausalLM.from_pretrained(out).eval()
    x = ids(2, 12)
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, hf(x).logits)
        assert torch.equal(load_model(out)(x), native(x))


def test_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_hf(tmp_path, "e4k1")
    file = tmp_path / "model.safetensors"
    state = load_file(file)
    del state["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(state, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatch, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        load_model(tmp_path)


@torch.no_grad()
def test_replaying_own_routes_changes_no_bit(pair):
    _, _, _, native = pair
    x = ids(2, 20)
    captured = Routing()
    base = native(x, routing=captured)
    # Any order within a token's k experts is the same route.
    replay = captured.routes().flip(-1)
    again = Routing(replay=replay)
    assert torch.equal(native(x, routing=again), base)
    assert torch.equal(again.routes(), captured.routes())  # the router's own choice, still recorded
    unset = torch.full_like(replay, NO_ROUTE)
    assert torch.equal(native(x, routing=Routing(replay=unset)), base)


def _other_routes(routes: torch.Tensor, experts: int) -> torch.Tensor:
    """Different but valid routes: every expert id shifted by one (mod E)."""
    return ((routes.long() + 1) % experts).to(routes.dtype)


@torch.no_grad()
def test_replay_uses_given_experts_with_r3_weights_like_transformers(pair):
    """Reference: transformers' model whose router returns the given experts, weighted by its own
    softmax probabilities over them (renormalised when norm_topk_prob), as R3 prescribes."""
    case, _, hf, native = pair
    moe = native.args.moe
    x = ids(2, 16)
    captured = Routing()
    native(x, routing=captured)
    replay = _other_routes(captured.routes(), moe.num_experts)
    replay[1, 5:] = NO_ROUTE  # the second row's tail routes by itself
    ours = native(x, routing=Routing(replay=replay))
    routers = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    originals = [r.forward for r in routers]
    for j, router in enumerate(routers):
        router.forward = _replaying(router, replay[:, :, j].reshape(-1, moe.top_k), moe.norm_topk_prob)
    try:
        theirs = hf(x).logits
    finally:
        for router, forward in zip(routers, originals):
            router.forward = forward
    assert (ours - native(x)).abs().max() > 1e-3  # the replayed routes matter
    assert (ours - theirs).abs().max().item() <= TOL


def _replaying(router, given: torch.Tensor, norm: bool):
    def forward(hidden):
        logits = F.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        own = probs.topk(router.top_k, dim=-1).indices
        idx = torch.where(given[:, :1] == NO_ROUTE, own, given.long())
        w = probs.gather(-1, idx)
        if norm:
            w = w / w.sum(-1, keepdim=True)
        return logits, w.to(logits.dtype), idx

    return forward


def test_bad_replay_is_refused_with_the_reason(pair):
    _, _, _, native = pair
    moe = native.args.moe
    x = ids(1, 6)
    layers = len(native.args.moe_layers)
    good = torch.zeros(1, 6, layers, moe.top_k, dtype=torch.int16) + torch.arange(moe.top_k, dtype=torch.int16)
    with pytest.raises(ValueError, match="shape"):
        native(x, routing=Routing(replay=good[:, :5]))
    with pytest.raises(ValueError, match="integer"):
        native(x, routing=Routing(replay=good.float()))
    bad = good.clone()
    bad[0, 2, 0, 0] = moe.num_experts
    with pytest.raises(ValueError, match="outside"):
        native(x, routing=Routing(replay=bad))
    if moe.top_k > 1:
        bad = good.clone()
        bad[0, 2, 0, 1] = NO_ROUTE
        with pytest.raises(ValueError, match="all -1"):
            native(x, routing=Routing(replay=bad))
        bad = good.clone()
        bad[0, 1, 0, 1] = bad[0, 1, 0, 0]
        with pytest.raises(ValueError, match="same expert twice"):
            native(x, routing=Routing(replay=bad))


def test_routing_on_a_dense_model_is_refused(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no MoE layer"):
        load_model(tmp_path)(ids(1, 4), routing=Routing())


def test_route_dtype_is_the_smallest_that_holds_the_ids():
    assert route_dtype(8) == torch.int8 and route_dtype(128) == torch.int8
    assert route_dtype(129) == torch.int16 and route_dtype(32768) == torch.int16
    assert route_dtype(40000) == torch.int32
    # The budget: a 32k-token, 48-layer, top-8 sample costs its int8 indices, 12 MiB.
    routes = torch.zeros(32768, 48, 8, dtype=route_dtype(128))
    assert routes.numel() * routes.element_size() == 12 * 2**20


def test_route_mismatch_counts_token_layer_pairs_as_sets():
    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    b = torch.tensor([[[1, 0], [2, 4]], [[4, 5], [7, 6]]])
    assert route_mismatch(a, b) == (1, 4)
    assert route_mismatch(a, b, mask=torch.tensor([False, True])) == (0, 2)


def test_aux_loss_matches_transformers_and_reaches_the_router(pair):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    _, _, hf, native = pair
    moe = native.args.moe
    x = ids(2, 16)
    routing = Routing(aux=True)
    native(x, routing=routing)
    loss = routing.aux_loss()
    with torch.no_grad():
        theirs = load_balancing_loss_func(hf(x, output_router_logits=True).router_logits, moe.num_experts, moe.top_k)
    assert abs(loss.item() - theirs.item()) <= 1e-5
    loss.backward()
    router = next(m for m in native.modules() if isinstance(m, SparseMoeBlock)).gate
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    native.zero_grad(set_to_none=True)


@torch.no_grad()
def test_router_logits_stay_fp32_in_a_bf16_model(tmp_path):
    tiny_hf(tmp_path, "e8k2-norm")
    model = load_model(tmp_path, dtype=torch.bfloat16)
    block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
    h = torch.randn(5, 64, dtype=torch.bfloat16)
    logits = block.gate(h)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, h.float() @ block.gate.weight.float().t())
    assert model(ids(1, 8)).dtype == torch.bfloat16


# ------------------------------------------------------------------------------ exact numerics

CROWD = 161


def _token_alone_and_in_crowds(block: SparseMoeBlock, dtype: torch.dtype) -> None:
    """A token's output must have the same bits alone, among CROWD - 1 others (more than
    DETERMINISTIC_ROWS per expert), and at another position of the call."""
    gen = torch.Generator().manual_seed(5)
    crowd = torch.randn(1, CROWD, block.gate.weight.shape[1], generator=gen).to(dtype)
    full = block(crowd)
    for i in (0, CROWD // 2, CROWD - 1):
        alone = block(crowd[:, i : i + 1])
        assert torch.equal(alone[0, 0], full[0, i]), f"token {i}"
    shuffled = crowd[:, torch.randperm(CROWD, generator=gen)]
    out = block(shuffled)
    where = {tuple(t.tolist()): j for j, t in enumerate(shuffled[0].float())}
    for i in (0, CROWD // 2, CROWD - 1):
        assert torch.equal(out[0, where[tuple(crowd[0, i].float().tolist())]], full[0, i])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.no_grad()
def test_exact_mode_gives_a_token_the_same_bits_in_any_call(tmp_path, dtype):
    tiny_hf(tmp_path, "e4k1")  # 4 experts: each one gets more than DETERMINISTIC_ROWS of the crowd
    model = load_model(tmp_path, dtype=dtype)
    model.set_exact_numerics(dtype)
    block = next(m for m in model.modules() if isinstance(m, SparseMoeBlock))
    assert block.exact_dtype == dtype and block.gate.exact_dtype == dtype
    assert _crowd_expert_counts(block, dtype).max() > DETERMINISTIC_ROWS
    _token_alone_and_in_crowds(block, dtype)
    # Whole model: a sequence alone and packed after another give the same logits bit for bit.
    a, b = ids(1, 40, seed=7), ids(1, 30, seed=8)
    packed = model(torch.cat([b, a], 1), attn=PackedContext([30, 40], deterministic=True))
    alone = model(a, attn=PackedContext([40], deterministic=True))
    assert torch.equal(packed[:, 30:], alone)


def _crowd_expert_counts(block: SparseMoeBlock, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    crowd = torch.randn(CROWD, block.gate.weight.shape[1], generator=gen).to(dtype)
    chosen = block.gate(crowd).topk(block.top_k, dim=-1).indices.reshape(-1)
    return torch.bincount(chosen, minlength=block.gate.weight.shape[0])


def test_exact_mode_trains_with_the_plain_gradient(tmp_path):
    """Exact mode's backward equals the plain mode's (fp32: the same function, other sums)."""
    tiny_hf(tmp_path, "e8k2-norm")
    x = ids(2, 12)
    grads = []
    for exact in (None, torch.float32):
        model = load_model(tmp_path)
        model.set_exact_numerics(exact)
        routing = Routing(aux=True)
        loss = model(x, routing=routing).logsumexp(-1).mean() + 0.01 * routing.aux_loss()
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if "experts" in n or "gate" in n})
    for name, g in grads[0].items():
        assert g is not None and g.abs().sum() > 0, name
        assert torch.allclose(grads[1][name], g, atol=1e-5, rtol=1e-4), name


def test_loop_experts_matches_a_dense_reference():
    """The expert loop against the plain per-token formula (every token through its k experts)."""
    gen = torch.Generator().manual_seed(0)
    n, h, inter, experts, k = 37, 16, 8, 5, 2
    x = torch.randn(n, h, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, h, generator=gen)
    down = torch.randn(experts, h, inter, generator=gen)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=gen)
    out = loop_experts(x, idx, w, gate_up, down, F.linear)
    want = torch.zeros(n, h)
    for t in range(n):
        for s in range(k):
            g, u = (gate_up[idx[t, s]] @ x[t]).chunk(2)
            want[t] += w[t, s] * (down[idx[t, s]] @ (F.silu(g) * u))
    assert torch.allclose(out, want, atol=1e-5)


# ----------------------------------------------------------------------------------- config


def _cfg(**extra) -> dict:
    base = dict(model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=32, num_experts=8,
                num_experts_per_tok=2)
    return {**base, **extra}


def test_config_parses_moe_fields_and_round_trips():
    args = ModelArgs.from_hf_config(_cfg(decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True))
    assert args.qk_norm and args.head_dim == 16
    assert args.moe.num_experts == 8 and args.moe.top_k == 2 and args.moe.norm_topk_prob
    assert args.moe_layers == (1,)  # layers 1 and 3 are on the step; 3 is mlp-only
    again = ModelArgs.from_hf_config(args.to_hf_config())
    assert again == args
    # transformers 5 writes num_experts as num_local_experts.
    alias = _cfg(num_local_experts=6)
    del alias["num_experts"]
    assert ModelArgs.from_hf_config(alias).moe.num_experts == 6


@pytest.mark.parametrize(
    "extra, field",
    [({"decoder_sparse_step": 0}, "decoder_sparse_step"), ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
     ({"mlp_only_layers": [4]}, "mlp_only_layers")],
)
def test_bad_moe_config_names_the_field(extra, field):
    with pytest.raises(UnsupportedModel, match=field):
        ModelArgs.from_hf_config(_cfg(**extra))


def test_a_model_built_from_args_is_usable_and_saves(tmp_path):
    from transformers import AutoModelForCausalLM

    args = ModelArgs.from_hf_config(_cfg())
    torch.manual_seed(0)
    model = DecoderLM(args)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    out = save_model(model, tmp_path / "m")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_experts"] == 8
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.7.down_proj.weight" in f.keys()
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    x = ids(1, 10)
    with torch.no_grad():
        assert (hf(x).logits - model(x)).abs().max().item() <= TOL
