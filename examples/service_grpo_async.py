"""The GRPO loop of `service_grpo_arithmetic.py`, asynchronous: step k+1's groups are sampled while step k trains.

    python examples/service_grpo_async.py --url http://127.0.0.1:8000 --key tml-...

Every call to the service is a future, and a tenant's calls run in the order it sent them. The loop
sends step k+1's sample calls BEFORE step k's forward_backward and optim_step: they sample the
weights as of the optim_step before them (version k), the engine generates them while the service
trains step k, and step k+1 then trains on samples one version old. The importance-sampling loss
weighs each token by exp(logp_now - logp_sampler), which corrects for that. Same arguments and
figures as the synchronous loop; `--prompts` must stay below the service's queue_depth minus 2
(every sample call of a step is in flight at once, with the step's two training calls).
"""

from __future__ import annotations

import time

from service_grpo_arithmetic import accuracy, finish, parser, report, score, setup, train_batch


def submit(trainer, prompts, n: int, params: dict) -> list:
    """The sample calls of a step's prompts, queued now (futures)."""
    sampler = trainer.sampling_client()
    return [sampler.sample(ids, n, params) for ids, _ in prompts]


def run(args) -> dict:
    trainer, tok, reward, train, test = setup(args)
    params = {"max_tokens": args.new_tokens, "temperature": args.temperature}
    figures = {"model_id": trainer.model_id, "accuracy_before": accuracy(trainer, tok, reward, test, args.new_tokens), "steps": []}
    figures["train_start"] = time.time()
    prompts_of = lambda k: train[k * args.prompts : (k + 1) * args.prompts]  # noqa: E731
    pending = submit(trainer, prompts_of(0), args.samples, params)
    for step in range(args.steps):
        prompts, groups = prompts_of(step), [f.result()["sequences"] for f in pending]
        if step + 1 < args.steps:  # queued before this step's optim_step: sampled from version `step` while it trains
            pending = submit(trainer, prompts_of(step + 1), args.samples, params)
        rewards = score(tok, reward, prompts, groups)
        batch, fb = train_batch(prompts, groups, rewards), None
        if batch:
            fb = trainer.forward_backward(batch, "importance_sampling")
            trainer.optim_step({"learning_rate": args.lr}).result()
        figures["steps"].append(report(step, args, rewards, groups, batch, fb.result() if fb else None))
    figures["train_end"] = time.time()
    figures["accuracy_after"] = accuracy(trainer, tok, reward, test, args.new_tokens)
    return finish(args, figures)


def main(argv: list[str] | None = None) -> dict:
    return run(parser().parse_args(argv))


if __name__ == "__main__":
    main()
