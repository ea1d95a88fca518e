"""Speculative decoding (n-gram drafter) in the built-in engine: greedy equals greedy, the sampled
distribution is the model's (chi-square against the exact distribution of a forward), deterministic
mode's logprobs equal the trainer's bit for bit, stops and lengths are kept, bad config is refused.

CPU only, on a tiny random qwen2 with a 64-token vocabulary whose next-token distributions are
neither flat nor one-hot, so n-gram drafts are both accepted and rejected (every test checks that
speculation ran and, where it matters, that both happened).
"""

from __future__ import annotations

import pytest
import torch

from noria.config import ConfigError, EngineConfig, TrainConfig
from noria.config.engine import SpeculativeConfig
from noria.engine import Engine, GenerateRequest, SamplingParams
from noria.engine.speculative import NgramIndex, SpeedPolicy
from noria.models import DecoderLM, save_model
from noria.models.config import ModelArgs, RopeScaling
from noria.train.fsdp import FSDPBackend
from noria.train.packing import pack_samples
from noria.types import Sample

VOCAB = 64


def _model() -> DecoderLM:
    args = ModelArgs(
        model_type="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=RopeScaling(),
        o_bias=False, mlp_bias=False, max_position_embeddings=512, bos_token_id=None, eos_token_ids=(2,),
        qkv_bias=True, qk_norm=False, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = DecoderLM(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
        model.lm_head.weight.mul_(3.0)  # peaked next-token distributions, as a trained model's
    return model.eval()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_model(_model(), tmp_path_factory.mktemp("spec") / "qwen2"))


@pytest.fixture(scope="module")
def model():
    return _model()


def _prompts() -> list[list[int]]:
    """Prompts with copyable structure (a pattern repeated, as tool output repeats), of several lengths."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() * r for n, r in ((12, 3), (5, 4), (9, 2), (30, 1))]


def _engine(model, method: str, **overrides) -> Engine:
    spec = SpeculativeConfig(method=method, num_tokens=4, max_batch=overrides.pop("max_batch", 8),
                             draft_budget=overrides.pop("draft_budget", 16), policy=overrides.pop("policy", "always"))
    settings = dict(kv_cache_tokens=8192, block_size=4, chunked_prefill_size=16, max_batch_tokens=128)
    settings.update(overrides)
    return Engine(model, None, EngineConfig(speculative=spec, **settings))


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True, **kw)


def _run(engine: Engine, requests: list[GenerateRequest]):
    return engine.generate_batch(requests, timeout_s=120)


# ------------------------------------------------------------------------------ the drafter


def test_ngram_draft_copies_what_followed_the_latest_earlier_occurrence():
    index = NgramIndex(1, 3)
    assert index.draft([1, 2, 3, 4, 9, 2, 3], 2) == [4, 9]  # (2, 3) was followed by 4, 9
    assert index.draft([1, 2, 3, 4, 9, 2, 3, 7, 2, 3], 2) == [7, 2]  # the latest occurrence wins
    assert NgramIndex(1, 3).draft([5, 6, 5, 6], 5) == [5, 6, 5, 6, 5]  # a repeat keeps repeating
    assert NgramIndex(2, 3).draft([1, 2, 3, 4], 3) == []  # no earlier occurrence
    assert NgramIndex(1, 1).draft([7], 3) == []


# ------------------------------------------------------------------------------ greedy


@pytest.mark.parametrize("attention", ["auto", "torch"])
def test_greedy_with_speculation_equals_greedy_without(model, attention):
    """Token for token and logprob within fp32 rounding, in one continuous batch (a late joiner's
    prefill shares steps with verify chunks), then again through the prefix cache (continuations
    of the first outputs: cached KV must hold no rejected draft)."""
    plain, spec = _engine(model, "none", attention=attention), _engine(model, "ngram", attention=attention)
    try:
        first = [GenerateRequest(input_ids=p, sampling=_greedy(40)) for p in _prompts()]
        expected, got = _run(plain, first), _run(spec, first)
        second = [GenerateRequest(input_ids=r.input_ids + o.output_ids, sampling=_greedy(17)) for r, o in zip(first, expected)]
        expected2, got2 = _run(plain, second), _run(spec, second)
        assert all(o.cached_tokens > 0 for o in got2)
        for e, g in zip(expected + expected2, got + got2):
            assert g.output_ids == e.output_ids
            assert len(g.logprobs) == len(e.logprobs) == len(g.weight_versions)
            assert max(abs(a - b) for a, b in zip(g.logprobs, e.logprobs)) < 1e-4
            assert g.finish_reason == e.finish_reason
        m = spec.metrics()
        assert 0 < m["spec_accepted_tokens"] < m["spec_proposed_tokens"]  # accepted and rejected drafts
        assert m["spec_tokens_per_verify"] > 1
        assert m["generated_tokens"] == sum(len(o.output_ids) for o in got + got2)
    finally:
        plain.shutdown(1)
        spec.shutdown(1)


def test_speculation_is_off_above_max_batch(model):
    spec = _engine(model, "ngram", max_batch=2)
    try:
        _run(spec, [GenerateRequest(input_ids=p, sampling=_greedy(12)) for p in _prompts()[:3]])
        assert spec.metrics()["spec_verify_steps"] == 0  # three rows decode together: above max_batch
        _run(spec, [GenerateRequest(input_ids=p, sampling=_greedy(12)) for p in _prompts()[:2]])
        assert spec.metrics()["spec_verify_steps"] > 0
    finally:
        spec.shutdown(1)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Row:
    """A request as the policy sees it (a key with its gain)."""


def _steps(policy: SpeedPolicy, clock: _Clock, rows: list, n: int, seconds: dict[bool, float], accepted: int) -> list[bool]:
    """n decode steps of ``rows`` under ``policy``: a speculating step takes seconds[True] and each
    row has ``accepted`` drafts accepted in it, a plain one takes seconds[False]; the kinds run."""
    kinds = []
    for _ in range(n):
        kind = policy.speculate(rows)
        clock.now += seconds[kind]
        if kind:
            for r in rows:
                policy.accepted(r, accepted)
        policy.record(len(rows))
        kinds.append(kind)
    return kinds


def test_the_measured_policy_speculates_where_the_rows_gain_pays_for_the_step():
    clock = _Clock()
    policy = SpeedPolicy(clock)
    cost = {True: 0.03, False: 0.02}  # a speculating step costs 1.5 plain ones
    copying = [_Row()]
    kinds = _steps(policy, clock, copying, 200, cost, accepted=2)  # 3 tokens a step for 1.5x the time
    assert kinds[:8] == [True] * 8 and kinds[8:16] == [False] * 8  # each kind's cost measured first
    assert policy.seconds[(0, True)] == pytest.approx(0.03) and policy.seconds[(0, False)] == pytest.approx(0.02)
    assert kinds[16:] == [True] * 184
    # its text stops being copyable: within a few stretches its gain is gone and it decodes plainly,
    # tried again once the gain has recovered far enough, each time for one stretch
    kinds = _steps(policy, clock, copying, 800, cost, accepted=0)
    stop = kinds.index(False)
    assert 8 <= stop <= 24 and 0 < sum(kinds[stop:]) <= 7 * 8 and sum(kinds[stop:]) % 8 == 0  # one stretch per ~128 steps
    tries = [i for i in range(stop + 1, len(kinds)) if kinds[i] and not kinds[i - 1]]
    assert all(b - a >= 100 for a, b in zip(tries, tries[1:]))  # then one stretch per 100+ steps
    # a new request in the same bucket is tried at once: its gain is not known to be low
    assert _steps(policy, clock, [_Row()], 8, cost, accepted=2) == [True] * 8
    # batch 4 (another bucket): measured on its own; 1.2 tokens a row for 1.5x the time does not pay
    batch = [_Row() for _ in range(4)]
    kinds = _steps(policy, clock, batch, 300, {True: 0.06, False: 0.04}, accepted=0)
    assert kinds[:16] == [True] * 8 + [False] * 8 and sum(kinds) <= 32  # then two or three tries in 300 steps


def test_a_measured_engine_times_both_kinds_of_step_and_keeps_the_output(model):
    """policy: measured on a real engine: its decode steps are timed into both kinds' figures for
    the batch size, and greedy output stays what plain decoding gives."""
    plain, spec = _engine(model, "none"), _engine(model, "ngram", policy="measured")
    try:
        requests = [GenerateRequest(input_ids=p, sampling=_greedy(80)) for p in _prompts()[:1]]
        got, expected = _run(spec, requests), _run(plain, requests)
        seconds = spec.speculator.policy.seconds
    finally:
        plain.shutdown(1)
        spec.shutdown(1)
    assert [o.output_ids for o in got] == [o.output_ids for o in expected]
    assert seconds.get((0, True), 0) > 0 and seconds.get((0, False), 0) > 0  # batch 1: speculating and plain stretches timed
    assert spec.metrics()["spec_verify_steps"] > 0


def test_the_step_line_shows_each_steps_own_acceptance(model):
    """``rollout/spec_acceptance`` and ``rollout/spec_tokens_per_verify`` on a step's line are the
    step's own (the engine keeps running totals): a step without traffic shows 0."""
    from noria.launch.engine_figures import local_engine_figures

    spec, seen = _engine(model, "ngram"), {}
    try:
        _run(spec, [GenerateRequest(input_ids=p, sampling=_greedy(24)) for p in _prompts()[:2]])
        m = spec.metrics()
        first = local_engine_figures(m, seen)
        assert first["rollout/spec_acceptance"] == m["spec_accepted_tokens"] / m["spec_proposed_tokens"] > 0
        assert first["rollout/spec_tokens_per_verify"] == m["spec_verify_tokens"] / m["spec_verify_rows"] > 1
        _run(spec, [GenerateRequest(input_ids=p, sampling=_greedy(24)) for p in _prompts()[2:]])
        m2 = spec.metrics()
        second = local_engine_figures(m2, seen)
        accepted, proposed = (m2[k] - m[k] for k in ("spec_accepted_tokens", "spec_proposed_tokens"))
        assert proposed > 0 and second["rollout/spec_acceptance"] == accepted / proposed  # this step alone
        assert local_engine_figures(spec.metrics(), seen)["rollout/spec_acceptance"] == 0.0  # nothing since
    finally:
        spec.shutdown(1)


# ------------------------------------------------------------------------------ the distribution


@torch.no_grad()
def _joint(model, prompt: list[int], temperature: float) -> torch.Tensor:
    """Exact P(x1, x2 | prompt) [V, V] at ``temperature``, from two forwards."""
    first = torch.softmax(model(torch.tensor([prompt]))[0, -1].float() / temperature, -1)
    both = torch.tensor([prompt + [x] for x in range(VOCAB)])
    second = torch.softmax(model(both)[:, -1].float() / temperature, -1)
    return first.unsqueeze(1) * second


def test_sampled_distribution_is_the_models_at_temperature_1(model):
    """The first two tokens after a fixed prompt, 3000 seeded samples with speculation on, against
    the exact joint distribution (chi-square over the pairs expected 5 times or more, the rest in
    one bin). The prompt is cached first, so each sample's first token is already a verify chunk's:
    both tokens are speculated positions."""

    prompt = _prompts()[1]
    with torch.no_grad():  # the model's own greedy continuation: its n-grams draft what the model may say
        for _ in range(24):
            prompt = prompt + [int(model(torch.tensor([prompt]))[0, -1].argmax())]
    joint = _joint(model, prompt, 1.0)
    draft = NgramIndex(1, 3).draft(prompt, 2)
    # Neither draft token is sure or hopeless: both positions accept and reject.
    assert 0.3 < joint[draft[0]].sum() < 0.9 and 0.1 < joint[draft[0], draft[1]] / joint[draft[0]].sum() < 0.9
    spec = _engine(model, "ngram", max_batch=4096, draft_budget=2048, max_running_requests=256, max_batch_tokens=2048)  # above the 3,000 requests queued: every row speculates
    try:
        _run(spec, [GenerateRequest(input_ids=prompt, sampling=_greedy(1))])  # caches the prompt
        n = 3000
        params = [SamplingParams(temperature=1.0, max_new_tokens=3, ignore_eos=True, seed=i) for i in range(n)]
        outs = _run(spec, [GenerateRequest(input_ids=prompt, sampling=p) for p in params])
        m = spec.metrics()
    finally:
        spec.shutdown(1)
    assert m["spec_verify_rows"] >= n and 0 < m["spec_accepted_tokens"] < m["spec_proposed_tokens"]
    assert joint_pvalue(outs, joint) > 1e-3


def joint_pvalue(outs, joint: torch.Tensor) -> float:
    """Chi-square p-value of the outputs' first two tokens against ``joint`` [V, V] (the pairs
    expected 5 times or more, the rest in one bin)."""
    from scipy.stats import chisquare

    counts = torch.zeros(VOCAB, VOCAB)
    for o in outs:
        counts[o.output_ids[0], o.output_ids[1]] += 1
    expected = joint * len(outs)
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)]).double()
    wanted = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)]).double()
    wanted *= observed.sum() / wanted.sum()  # float rounding of the exact mass
    assert big.sum() >= 20
    return float(chisquare(observed.numpy(), wanted.numpy()).pvalue)


# ------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_deterministic_speculated_logprobs_equal_the_trainers_bitwise(folder, dtype):
    from noria.models import load_model

    engine = Engine(
        load_model(folder, dtype=getattr(torch, dtype)), None,
        EngineConfig(kv_cache_tokens=4096, block_size=4, chunked_prefill_size=24, max_batch_tokens=96, attention="torch",
                     deterministic=True, speculative=SpeculativeConfig(method="ngram", num_tokens=3, policy="always")),
    )
    try:
        prompts = _prompts()
        params = [SamplingParams(temperature=0.7, max_new_tokens=24, ignore_eos=True, seed=i) for i in range(len(prompts))]
        outs = _run(engine, [GenerateRequest(input_ids=p, sampling=s) for p, s in zip(prompts, params)])
        m = engine.metrics()
    finally:
        engine.shutdown(1)
    assert 0 < m["spec_accepted_tokens"] < m["spec_proposed_tokens"]
    assert trainer_gap(folder, dtype, prompts, outs, 0.7) == 0.0


def trainer_gap(folder: str, dtype: str, prompts: list[list[int]], outs, temperature: float) -> float:
    """max |rollout logprob - the deterministic trainer's| over the outputs' tokens."""
    samples = [
        Sample(prompt_ids=p, response_ids=o.output_ids, loss_mask=[1] * len(o.output_ids), rollout_logprobs=o.logprobs,
               weight_versions=o.weight_versions)
        for p, o in zip(prompts, outs)
    ]
    batch = pack_samples(samples, torch.linspace(-1, 1, len(samples)).tolist())
    backend = FSDPBackend(TrainConfig(param_dtype=dtype, algorithm="rl", device="cpu", logprob_chunk_tokens=50),
                          deterministic=True, temperature=temperature)
    backend.init(folder)
    trained = batch.loss_mask > 0
    lp = backend.compute_logprobs(batch).logprobs[trained]
    return (lp - batch.rollout_logprobs[trained]).abs().max().item()


# ------------------------------------------------------------------------------ stops


def test_stops_and_lengths_are_kept_token_by_token(model):
    """A stop token inside an accepted draft ends the output there; max_new_tokens that is no
    multiple of k + 1 is met exactly; the same outputs as without speculation."""
    plain, spec = _engine(model, "none"), _engine(model, "ngram")
    try:
        prompts = _prompts()
        free = _run(plain, [GenerateRequest(input_ids=p, sampling=_greedy(40)) for p in prompts])
        stops = [o.output_ids[len(o.output_ids) // 2] for o in free]  # a token that does occur mid-output
        requests = [GenerateRequest(input_ids=p, sampling=_greedy(40, stop_token_ids=[s])) for p, s in zip(prompts, stops)]
        requests += [GenerateRequest(input_ids=p, sampling=_greedy(n)) for p, n in zip(prompts, (7, 11, 2, 1))]
        expected, got = _run(plain, requests), _run(spec, requests)
        assert spec.metrics()["spec_accepted_tokens"] > 0
        # a draft cut by a stop counts only the tokens kept (the tokens after the stop were not generated)
        assert spec.metrics()["generated_tokens"] == sum(len(g.output_ids) for g in got)
    finally:
        plain.shutdown(1)
        spec.shutdown(1)
    for req, e, g in zip(requests, expected, got):
        assert g.output_ids == e.output_ids and g.finish_reason == e.finish_reason
        assert len(g.output_ids) <= req.sampling.max_new_tokens
    for s, g in zip(stops, got[:4]):
        assert g.finish_reason == {"type": "stop", "matched": s} and g.output_ids.index(s) == len(g.output_ids) - 1
    assert [len(g.output_ids) for g in got[4:]] == [7, 11, 2, 1]


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_tokens=0), "engine.speculative.num_tokens must be >= 1"),
        (dict(ngram_min=3, ngram_max=2), "engine.speculative.ngram_min (3) must not exceed engine.speculative.ngram_max"),
        (dict(max_batch=0), "engine.speculative.max_batch must be >= 1"),
        (dict(num_tokens=40), "engine.speculative.num_tokens must be <= 32"),
    ],
)
def test_bad_speculative_config_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(speculative=SpeculativeConfig(method="ngram", **overrides)).validate()


def test_speculation_where_it_cannot_run_is_refused():
    config = EngineConfig(max_batch_tokens=4, chunked_prefill_size=4, speculative=SpeculativeConfig(method="ngram"))
    with pytest.raises(ConfigError, match="num_tokens \\+ 1 \\(5\\) must not exceed engine.max_batch_tokens"):
        config.validate()
    config = EngineConfig(speculative=SpeculativeConfig(method="ngram"))
    with pytest.raises(ConfigError, match="engine.speculative.method=ngram needs .*model.impl=hf"):
        config.check_model("cpu", "hf")
    with pytest.raises(ConfigError, match="engine.speculative.method=ngram .*rollout.engine=vllm"):
        config.check_model("cpu", "native", rollout_engine="vllm")
    config.check_model("cpu", "native")  # the built-in engine: fine
