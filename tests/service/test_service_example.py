"""The cookbook loops (examples/service_grpo_arithmetic.py and its async form) against a real
``noria service`` on the tiny model: two tenants run them at once, each trains only its own adapter.

The tiny model is random: ``numeric`` would score every answer 0 (no group would teach anything),
so the loops take ``toy_rewards:digits``, a reward its answers vary on.
"""

from __future__ import annotations

import sys
import threading

import pytest
from service_util import REPO, ServiceProcess

from noria.service.client import ServiceClient, TrainingClient, datum

sys.path.insert(0, str(REPO / "examples"))
import service_grpo_arithmetic  # noqa: E402
import service_grpo_async  # noqa: E402

KEYS = {"alice": "tml-alice-example-0123456789", "bob": "tml-bob-example-0123456789ab", "carol": "tml-carol-example-0123456789"}
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
PROBE = [datum(PROMPT, PROMPT[1:] + [19])]


@pytest.fixture(scope="module")
def service(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("service-example")
    keys = folder / "keys.yaml"
    keys.write_text("tenants:\n" + "".join(f"  {t}: {{key: {k}}}\n" for t, k in KEYS.items()))
    proc = ServiceProcess(tiny_model_dir, keys, folder / "state", folder).wait_ready()
    yield proc
    proc.stop()


def probe(trainer: TrainingClient) -> list[float]:
    return trainer.forward(PROBE).result()["loss_fn_outputs"][0]["logprobs"]["data"]


def test_two_tenants_run_the_example_loops_concurrently(service):
    # carol's adapter is new (LoRA's B starts at 0: the base model's logprobs) and stays idle
    bystander = ServiceClient(service.url, KEYS["carol"]).create_lora_training_client(rank=4)
    base = probe(bystander)
    tiny = ["--steps", "2", "--prompts", "2", "--samples", "4", "--new-tokens", "8", "--eval", "4",
            "--temperature", "1.0", "--lr", "0.01", "--rank", "4", "--reward", "toy_rewards:digits"]  # fmt: skip
    loops = {"alice": service_grpo_arithmetic.main, "bob": service_grpo_async.main}
    figures: dict[str, dict] = {}
    errors: list[BaseException] = []

    def run(tenant: str, seed: int) -> None:
        try:
            figures[tenant] = loops[tenant](["--url", service.url, "--key", KEYS[tenant], "--seed", str(seed), *tiny])
        except BaseException as e:  # noqa: BLE001 -- re-raised below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t, i)) for i, t in enumerate(loops)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]

    trained = {}
    for tenant, fig in figures.items():
        assert 0.0 <= fig["accuracy_before"] <= 1.0 and 0.0 <= fig["accuracy_after"] <= 1.0, fig
        assert [s["step"] for s in fig["steps"]] == [1, 2] and all(0.0 <= s["reward"] <= 1.0 for s in fig["steps"]), fig
        assert fig["sampled_tokens"] == sum(s["sampled_tokens"] for s in fig["steps"]) > 0
        assert fig["trained_tokens"] > 0 and fig["train_end"] >= fig["train_start"]
        trainer = TrainingClient(ServiceClient(service.url, KEYS[tenant]), fig["model_id"])
        assert trainer.get_info()["optimizer_steps"] == sum(1 for s in fig["steps"] if s["datums"]) >= 1
        trained[tenant] = probe(trainer)
        assert max(abs(a - b) for a, b in zip(trained[tenant], base)) > 1e-4, tenant  # its adapter changed
    assert trained["alice"] != trained["bob"]  # each trained its own
    assert probe(bystander) == base  # and nobody else's
