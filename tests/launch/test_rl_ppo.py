"""PPO with GAE through the RL job: the critic trains beside the policy, checkpoints with it, learns."""

from __future__ import annotations

import torch

from noria.config import load_config
from noria.launch.parts import critic_checkpoint
from noria.launch.rl import run_rl
from noria.train import latest_checkpoint
from rl_util import mean, read_jsonl, rewards, rl_args


def test_ppo_with_gae_learns_and_resumes_with_its_critic(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    ppo = {"train.loss.advantage": "gae", "train.critic.lr": "1e-3", "train.save_every": 12}
    config = load_config(None, rl_args(tiny_model_dir, **{"train.max_steps": 24, **ppo}))
    run_rl(config, run_dir=str(run), progress=False)
    rows = read_jsonl(run / "metrics.jsonl")
    first = rewards(run)
    assert mean(first[-5:]) > mean(first[:5]) + 0.15, first  # the policy learned to answer in digits
    assert all("critic/value_loss" in r and r["critic/skipped"] == 0.0 for r in rows)
    explained = [r["critic/explained_variance"] for r in rows if "critic/explained_variance" in r]
    assert len(explained) > 10 and mean(explained[-5:]) > mean(explained[:3]), explained  # the critic learns too
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and (critic_checkpoint(ckpt) / "COMMITTED").is_file()
    # a resumed leg loads the critic: its first value loss continues the trained critic's, not a fresh one's
    config = load_config(None, rl_args(tiny_model_dir, **{"train.max_steps": 26, **ppo}))
    run_rl(config, resume=str(run), progress=False)
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 27))
    fresh_value_mean = rows[0]["critic/value_mean"]
    assert abs(rows[24]["critic/value_mean"] - rows[23]["critic/value_mean"]) < abs(rows[24]["critic/value_mean"] - fresh_value_mean)
    assert torch.isfinite(torch.tensor([r["loss"] for r in rows])).all()
