"""A reward's ``prepare`` hook runs once, with the reward's keyword arguments, before the run's
first call (``noria.rewards.registry.prepared_reward``), and a reward without one is returned as is."""

from __future__ import annotations

from noria.rewards.registry import prepared_reward

CALLS: list[dict] = []


def with_prepare(response, label, metadata=None, scale=1.0):
    return scale * float(response == label)


with_prepare.prepare = lambda **kwargs: CALLS.append(kwargs)


def plain(response, label, metadata=None):
    return 1.0


def test_prepare_runs_once_with_the_rewards_kwargs_and_a_plain_reward_needs_none():
    assert prepared_reward("test_registry_prepare:with_prepare", {"scale": 2.0}) is with_prepare
    assert CALLS == [{"scale": 2.0}]
    assert prepared_reward("test_registry_prepare:plain") is plain
    assert prepared_reward("numeric").__name__  # a built-in, without the hook
    assert CALLS == [{"scale": 2.0}]


def test_the_digit_rewards_prepare_their_classifier(monkeypatch, tmp_path):
    from noria.diffusion import rewards

    monkeypatch.setenv("NORIA_HOME", str(tmp_path))
    monkeypatch.setattr(rewards, "_loaded", {})
    prepared_reward("noria.diffusion.rewards:digit_correct", {"classifier": "logreg"})
    assert set(rewards._loaded) == {"logreg"} and (tmp_path / "diffusion" / "digits-logreg" / "info.json").is_file()
