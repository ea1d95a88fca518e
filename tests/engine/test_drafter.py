"""The mlp drafter (``engine.speculative.method: mlp``): it learns online from the engine's own
samples, and with it greedy equals greedy, the sampled distribution is the model's (chi-square),
deterministic mode's logprobs equal the trainer's bit for bit, low acceptance falls back to plain
decoding, its state saves and loads, and a drafter made for another vocabulary is refused.

CPU, on the tiny random qwen2 of ``test_speculative`` (64-token vocabulary).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from noria.config import ConfigError, EngineConfig
from noria.config.engine import SpeculativeConfig
from noria.engine import Engine, GenerateRequest, SamplingParams
from noria.engine.drafter import Draft, MlpDrafter
from noria.engine.sampling import inverse_cdf

from test_speculative import VOCAB, _greedy, _joint, _model, _prompts, _run, joint_pvalue, trainer_gap


def _spec(**kw) -> SpeculativeConfig:
    base = dict(method="mlp", num_tokens=3, train_every_tokens=64, train_steps=25, draft_confidence=0.0, min_acceptance=0.0,
                policy="always")
    base.update(kw)
    return SpeculativeConfig(**base)


def _engine(model, spec: SpeculativeConfig, **overrides) -> Engine:
    settings = dict(kv_cache_tokens=8192, block_size=4, chunked_prefill_size=16, max_batch_tokens=128, speculative=spec)
    settings.update(overrides)
    return Engine(model, None, EngineConfig(**settings))


def _trained(engine: Engine, requests: list[GenerateRequest], rounds: int = 3) -> None:
    """Generate ``requests`` ``rounds`` times, each time until the drafter's training round is done
    (it trains while the engine has no request)."""
    for _ in range(rounds):
        _run(engine, requests)
        deadline = time.monotonic() + 60
        while engine.speculator.drafter.train_due() and time.monotonic() < deadline:
            time.sleep(0.01)


@pytest.fixture(scope="module")
def model():
    return _model()


def test_the_drafter_learns_online_and_greedy_equals_greedy(model):
    """Untrained it drafts nothing; after training rounds on its own greedy outputs it drafts, its
    loss fell, most drafts are accepted, and the tokens are those of plain greedy decoding."""
    plain, spec = _engine(model, SpeculativeConfig()), _engine(model, _spec())
    try:
        requests = [GenerateRequest(input_ids=p, sampling=_greedy(40)) for p in _prompts()]
        expected = _run(plain, requests)
        first = _run(spec, requests)
        m0 = spec.metrics()
        assert m0["spec_verify_steps"] == 0 and m0["spec_drafter_rounds"] >= 1  # not trained while it generated
        _trained(spec, requests, rounds=4)
        m1 = spec.metrics()
        got = _run(spec, requests)
        m2 = spec.metrics()
        assert m1["spec_drafter_loss"] < 0.9 * _first_loss(model)
        assert m2["spec_verify_steps"] > m1["spec_verify_steps"]
        accepted = m2["spec_accepted_tokens"] - m1["spec_accepted_tokens"]
        assert accepted > 0.5 * (m2["spec_proposed_tokens"] - m1["spec_proposed_tokens"])  # it learned these outputs
        for e, g in zip(expected + expected, first + got):
            assert g.output_ids == e.output_ids
            assert max(abs(a - b) for a, b in zip(g.logprobs, e.logprobs)) < 1e-4
    finally:
        plain.shutdown(1)
        spec.shutdown(1)


def _first_loss(model) -> float:
    """The loss of one training step of an untrained drafter on the model's greedy outputs."""
    engine = _engine(model, _spec(train_steps=1))
    try:
        _trained(engine, [GenerateRequest(input_ids=p, sampling=_greedy(40)) for p in _prompts()], rounds=1)
        return engine.metrics()["spec_drafter_loss"]
    finally:
        engine.shutdown(1)


def _half_vocabulary(drafter: MlpDrafter):
    """``drafter.propose`` replaced by one whose q is uniform over the even token ids, whatever the
    state: far from the model's p (about uniform over all 64), so a rejected draft's token must come
    from max(0, p - q), which holds no even id; drawing it from p with the draft token removed, as
    for a point mass, would put about 1.5x p on even ids and 0.5x on odd ones."""
    vocab = torch.arange(VOCAB)
    q = (vocab % 2 == 0).float() / (VOCAB // 2)

    def propose(hidden, tokens, k, params=None, uniforms=None):
        drafter._set_vocab(vocab)
        out = []
        for row in range(len(tokens)):
            draws = inverse_cdf(q.expand(k, -1), uniforms[row]).tolist()
            out.append(Draft(draws, q.expand(k, -1).clone()))
        return out

    drafter.propose = propose


@pytest.mark.parametrize("drafter_kind", ["trained", "skewed", "half"])
def test_sampled_distribution_is_the_models_at_temperature_1(model, drafter_kind):
    """The first two tokens after a fixed prompt, 2000 (half: 6000) seeded samples, the second drawn from the
    drafter's q and verified (accepted with min(1, p/q), else drawn from max(0, p - q)), against the
    exact joint distribution (chi-square). The drafter: ``trained``; ``skewed``, its stage weights
    scaled up after training, so q is sharper than p; ``half``, q uniform over half the vocabulary
    (:func:`_half_vocabulary`), where a wrong residual draw shows at once."""
    skewed = drafter_kind == "skewed"
    prompt = _prompts()[1]
    joint = _joint(model, prompt, 1.0)
    spec = _engine(model, _spec(num_tokens=2, draft_budget=2048), max_running_requests=256, max_batch_tokens=2048)
    try:
        sampled = [SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=1000 + i) for i in range(64)]
        _trained(spec, [GenerateRequest(input_ids=prompt, sampling=p) for p in sampled], rounds=3)
        drafter = spec.speculator.drafter
        if skewed:
            spec.speculator.config.draft_confidence = 0.0  # every draft goes out, however unsure
            with torch.no_grad():
                drafter.stage.norm.mul_(4.0)  # logits x4: q is p's shape at T = 1/4
        drafter.config.online_training = False  # q stays what it is while sampling
        hidden = torch.randn(2, model.args.hidden_size)
        uniforms = torch.rand(2, 2, generator=torch.Generator().manual_seed(0))
        for draft in drafter.propose(hidden, [5, 6], 2, [SamplingParams(temperature=1.0)] * 2, uniforms):
            assert draft.q is not None and torch.allclose(draft.q.sum(-1), torch.ones(len(draft.tokens)))
        if drafter_kind == "half":
            _half_vocabulary(drafter)
        spec.speculator.config.max_batch = 4096  # every row speculates
        n = 6000 if drafter_kind == "half" else 2000  # half: a wrong residual draw read p = 3e-4 at 2000, 5e-8 at 6000
        params = [SamplingParams(temperature=1.0, max_new_tokens=3, ignore_eos=True, seed=i) for i in range(n)]  # x2 drafted
        before = spec.metrics()
        outs = _run(spec, [GenerateRequest(input_ids=prompt, sampling=p) for p in params])
        m = spec.metrics()
    finally:
        spec.shutdown(1)
    assert m["spec_verify_rows"] - before["spec_verify_rows"] >= n // 2  # a row decodes plainly in a step whose prefills leave no room
    accepted = m["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert 0 < accepted < m["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    assert joint_pvalue(outs, joint) > 1e-3


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_deterministic_drafted_logprobs_equal_the_trainers_bitwise(tmp_path, dtype):
    from noria.models import load_model, save_model

    folder = str(save_model(_model(), tmp_path / "qwen2"))
    engine = _engine(load_model(folder, dtype=getattr(torch, dtype)), _spec(), block_size=4, chunked_prefill_size=24,
                     max_batch_tokens=96, attention="torch", deterministic=True)
    try:
        prompts = _prompts()
        params = [SamplingParams(temperature=0.7, max_new_tokens=24, ignore_eos=True, seed=i) for i in range(len(prompts))]
        requests = [GenerateRequest(input_ids=p, sampling=s) for p, s in zip(prompts, params)]
        _trained(engine, requests, rounds=3)
        before = engine.metrics()
        outs = _run(engine, requests)
        m = engine.metrics()
    finally:
        engine.shutdown(1)
    assert 0 < m["spec_accepted_tokens"] - before["spec_accepted_tokens"] < m["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    assert trainer_gap(folder, dtype, prompts, outs, 0.7) == 0.0


def test_low_acceptance_falls_back_to_plain_decoding(model):
    """Above the share it can reach, min_acceptance turns speculation off after a window of 64
    drafted tokens, until the drafter's next round; the tokens stay greedy's."""
    plain, spec = _engine(model, SpeculativeConfig()), _engine(model, _spec(min_acceptance=0.99, train_every_tokens=10**6))
    try:
        requests = [GenerateRequest(input_ids=p, sampling=_greedy(60)) for p in _prompts()]
        spec.speculator.drafter.config.train_every_tokens = 64
        _trained(spec, requests, rounds=2)
        spec.speculator.drafter.config.train_every_tokens = 10**6  # no further round: no retry
        before = spec.metrics()
        got, expected = _run(spec, requests), _run(plain, requests)
        m = spec.metrics()
    finally:
        plain.shutdown(1)
        spec.shutdown(1)
    assert m["spec_fallbacks"] > before["spec_fallbacks"]
    drafted = m["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    assert 0 < drafted < 64 + 4 * 3  # one window (plus the step that closed it), then plain decoding
    assert [o.output_ids for o in got] == [o.output_ids for o in expected]


def test_state_saves_and_loads_and_another_vocabulary_is_refused(model, tmp_path):
    spec = _engine(model, _spec())
    try:
        _trained(spec, [GenerateRequest(input_ids=p, sampling=_greedy(40)) for p in _prompts()], rounds=2)
        assert spec.save_drafter(tmp_path / "drafter.pt")
        mine = spec.speculator.drafter
        hidden = torch.randn(3, model.args.hidden_size)
        drafts = mine.propose(hidden, [5, 6, 7], 3)
    finally:
        spec.shutdown(1)
    loaded = MlpDrafter(model, _spec(model_path=str(tmp_path / "drafter.pt")))
    assert loaded.ready and loaded.steps == mine.steps and torch.equal(loaded.vocab.cpu(), mine.vocab.cpu())
    assert loaded.propose(hidden, [5, 6, 7], 3) == drafts
    other = _model()
    other.args = dataclasses.replace(other.args, vocab_size=VOCAB * 2)  # another tokenizer's vocabulary
    with pytest.raises(ConfigError, match=r"vocab_size 64.*vocab_size 128"):
        MlpDrafter(other, _spec(model_path=str(tmp_path / "drafter.pt")))
    state = torch.load(tmp_path / "drafter.pt", weights_only=True)
    state["tokenizer"] = "0" * 64
    mine_tok = MlpDrafter(model, _spec(), tokenizer=_Tokenizer())
    with pytest.raises(ConfigError, match="tokenizer"):
        mine_tok.load_state_dict(state)
    (tmp_path / "junk.pt").write_bytes(b"not a drafter")
    with pytest.raises(ConfigError, match="junk.pt"):
        MlpDrafter(model, _spec(model_path=str(tmp_path / "junk.pt")))


class _Tokenizer:
    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(VOCAB)}


@pytest.mark.parametrize(("overrides", "message"), [
    ({"method": "ngram", "model_path": "d.pt"}, "model_path is the mlp drafter's"),
    ({"method": "mlp", "online_training": False}, "needs a trained drafter"),
    ({"method": "mlp", "draft_confidence": 1.0}, "draft_confidence"),
    ({"method": "mlp", "min_acceptance": -0.1}, "min_acceptance"),
    ({"method": "mlp", "draft_vocab": 0}, "draft_vocab"),
])
def test_bad_drafter_config_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig(**overrides).validate()
