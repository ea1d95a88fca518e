"""GRPO on the arithmetic task, written against a running `noria service` (docs/service.md).

    noria service --model smollm2-135m-instruct          # prints a key for the tenant 'default'
    python examples/service_grpo_arithmetic.py --url http://127.0.0.1:8000 --key tml-...

The service runs the sampling, the forward and backward passes and the optimizer steps on its own
base model and this tenant's LoRA adapter; this process holds only the loop: prompts from Noria's
arithmetic task, rewards from Noria's `numeric` reward, group-relative (GRPO) advantages, and the
importance-sampling loss, whose `logprobs` are the sampler's. It measures held-out accuracy (greedy)
before and after. `examples/service_grpo_async.py` is the same loop sampling step k+1's groups
while step k trains.
"""

from __future__ import annotations

import argparse
import json
import time

from noria.config import LossConfig
from noria.data.chat import render_prompt
from noria.data.tasks import generate_split
from noria.models import load_tokenizer
from noria.models.catalog import model_path
from noria.rewards.registry import get_reward
from noria.service.client import ServiceClient, datum
from noria.train.algorithms.advantages import compute_advantages

IN_FLIGHT = 8  # sample calls queued at once (the service's default queue_depth is 16)


def setup(args: argparse.Namespace):
    """The service client, a new training client (LoRA adapter), the tokenizer, the reward and the prompts."""
    service = ServiceClient(args.url, args.key)
    trainer = service.create_lora_training_client(rank=args.rank, seed=args.seed)
    base = args.tokenizer or service.get_server_capabilities()["supported_models"][0]["model_name"]
    tok = load_tokenizer(model_path(base))
    task = {"n_train": args.steps * args.prompts + args.prompts, "n_test": args.eval, "seed": args.seed, "ops": ["+"]}
    train = [(render_prompt(p, tok), p.label) for p in generate_split("arithmetic", "train", task)]
    test = [(render_prompt(p, tok), p.label) for p in generate_split("arithmetic", "test", task)]
    return trainer, tok, get_reward(args.reward), train, test


def sample(trainer, prompts, n: int, params: dict) -> list[list[dict]]:
    """``n`` sequences for each prompt from the adapter's current weights, ``IN_FLIGHT`` calls at a time."""
    sampler, out = trainer.sampling_client(), []
    for i in range(0, len(prompts), IN_FLIGHT):
        futures = [sampler.sample(ids, n, params) for ids, _ in prompts[i : i + IN_FLIGHT]]
        out += [f.result()["sequences"] for f in futures]
    return out


def score(tok, reward, prompts, groups) -> list[list[float]]:
    return [[reward(tok.decode(s["tokens"], skip_special_tokens=True), label, {}) for s in g] for (_, label), g in zip(prompts, groups)]


def accuracy(trainer, tok, reward, test, max_tokens: int) -> float:
    rewards = score(tok, reward, test, sample(trainer, test, 1, {"max_tokens": max_tokens, "temperature": 0.0}))
    return sum(r[0] for r in rewards) / len(rewards)


def train_batch(prompts, groups, rewards) -> list[dict]:
    """One datum per sample of a group whose rewards differ: the importance-sampling loss's inputs."""
    batch = []
    for (ids, _), group, rs, advs in zip(prompts, groups, rewards, compute_advantages(LossConfig(advantage="grpo"), rewards)):
        if len(set(rs)) == 1:  # equal rewards, advantages all 0: nothing to learn from this group
            continue
        n = len(ids) - 1  # target i is predicted at position i: the answer's first token at position n
        for s, adv in zip(group, advs):
            full = ids + s["tokens"]
            batch.append(datum(full[:-1], full[1:], logprobs=[0.0] * n + s["logprobs"], advantages=[0.0] * n + [adv] * len(s["tokens"])))
    return batch


def run(args: argparse.Namespace) -> dict:
    trainer, tok, reward, train, test = setup(args)
    params = {"max_tokens": args.new_tokens, "temperature": args.temperature}
    figures = {"model_id": trainer.model_id, "accuracy_before": accuracy(trainer, tok, reward, test, args.new_tokens), "steps": []}
    figures["train_start"] = time.time()
    for step in range(args.steps):
        prompts = train[step * args.prompts : (step + 1) * args.prompts]
        groups = sample(trainer, prompts, args.samples, params)  # the weights of the last optim_step
        rewards = score(tok, reward, prompts, groups)
        batch, fb = train_batch(prompts, groups, rewards), None
        if batch:  # forward_backward and optim_step are queued back to back; they run in order
            fb = trainer.forward_backward(batch, "importance_sampling")
            trainer.optim_step({"learning_rate": args.lr}).result()
        figures["steps"].append(report(step, args, rewards, groups, batch, fb.result() if fb else None))
    figures["train_end"] = time.time()
    figures["accuracy_after"] = accuracy(trainer, tok, reward, test, args.new_tokens)
    return finish(args, figures)


def report(step: int, args, rewards, groups, batch, fb) -> dict:
    line = {"step": step + 1, "reward": sum(map(sum, rewards)) / sum(map(len, rewards)), "datums": len(batch),
            "sampled_tokens": sum(len(s["tokens"]) for g in groups for s in g), "trained_tokens": sum(len(d["loss_fn_inputs"]["target_tokens"]["data"]) for d in batch),
            "loss": fb["metrics"]["loss:sum"] if fb else None}  # fmt: skip
    print(f"step {step + 1}/{args.steps} reward {line['reward']:.3f} datums {line['datums']} loss {line['loss']}", flush=True)
    return line


def finish(args, figures: dict) -> dict:
    """Totals of the training steps, the accuracies printed, and the figures written to ``--json``."""
    figures["sampled_tokens"] = sum(s["sampled_tokens"] for s in figures["steps"])
    figures["trained_tokens"] = sum(s["trained_tokens"] for s in figures["steps"])
    print(f"held-out accuracy {figures['accuracy_before']:.1%} -> {figures['accuracy_after']:.1%} ({args.eval} problems, greedy)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return figures


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the service")
    p.add_argument("--key", required=True, help="this tenant's API key")
    p.add_argument("--tokenizer", help="catalog name or folder of the base model's tokenizer (default: the service's base model)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (the group)")
    p.add_argument("--new-tokens", type=int, default=32, help="most tokens per answer")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--lr", type=float, default=5e-4, help="Adam learning rate of the adapter")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--eval", type=int, default=50, help="held-out problems")
    p.add_argument("--reward", default="numeric", help="a reward of noria.rewards, or pkg.module:fn(response, label, metadata)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures here")
    return p


def main(argv: list[str] | None = None) -> dict:
    return run(parser().parse_args(argv))


if __name__ == "__main__":
    main()
