"""``noria service`` over HTTP on 127.0.0.1: tenants training their own adapters on one tiny base.

One real service process serves the whole file (fp32, tiny Llama); the last test restarts it.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch
from service_util import PROBE, PROMPT, ServiceProcess, check_samples_follow_the_adapter, logprobs, target_data, train

from noria.service.client import RequestFailed, ServiceClient, ServiceError, datum

KEYS = {
    "alice": "tml-alice-0123456789abcdef",
    "bob": "tml-bob-0123456789abcdef01",
    "carol": "tml-carol-0123456789abcdef",
}


@pytest.fixture(scope="module")
def service(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("service")
    keys = folder / "keys.yaml"
    keys.write_text(
        "tenants:\n"
        f"  alice: {{key: {KEYS['alice']}, max_adapters: 8}}\n"
        f"  bob: {{key: {KEYS['bob']}}}\n"
        f"  carol: {{key: {KEYS['carol']}, max_adapters: 1, tokens_per_minute: 64}}\n"
    )
    proc = ServiceProcess(tiny_model_dir, keys, folder / "state", folder).wait_ready()
    info = {"proc": proc, "keys": keys, "state": folder / "state", "folder": folder, "model": tiny_model_dir}
    yield info
    info["proc"].stop()


def client(service, tenant: str) -> ServiceClient:
    return ServiceClient(service["proc"].url, KEYS[tenant])


def test_two_tenants_train_their_own_adapters_concurrently(service):
    trainers = {t: client(service, t).create_lora_training_client(rank=4) for t in ("alice", "bob")}
    targets = {"alice": 100, "bob": 200}
    losses: dict[str, list[float]] = {}

    def run(tenant: str) -> None:
        losses[tenant] = train(trainers[tenant], target_data(targets[tenant]), steps=4)

    threads = [threading.Thread(target=run, args=(t,)) for t in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for tenant, curve in losses.items():
        # the tiny model's logits are bounded (a final norm over 32 dims): a drop of 10% is learning
        assert curve[-1] < 0.9 * curve[0] and curve == sorted(curve, reverse=True), (tenant, curve)
    # each learnt its own target: alice's adapter gives 100 more mass than bob's does, and the reverse
    alice_on_100 = logprobs(trainers["alice"], target_data(100))[0][-1]
    bob_on_100 = logprobs(trainers["bob"], target_data(100))[0][-1]
    assert alice_on_100 > bob_on_100 + 0.5
    # alice training on does not move bob's adapter by a single bit
    before = logprobs(trainers["bob"])
    train(trainers["alice"], target_data(100), steps=2)
    assert logprobs(trainers["bob"]) == before
    assert trainers["alice"].get_info()["optimizer_steps"] == 6 and trainers["bob"].get_info()["optimizer_steps"] == 4


def test_logprobs_are_those_of_base_plus_the_adapter(service):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = client(service, "alice").create_lora_training_client(rank=4, train_mlp=False)
    fb = trainer.forward_backward(target_data(42), "cross_entropy")
    train(trainer, target_data(42), steps=2)
    data = PROBE + [datum([7, 8, 9], [9, 10, 11])]  # two lengths: padding must not change a row
    served = logprobs(trainer, data)
    path = trainer.save_weights_for_sampler("probe").result()["path"]
    model_id, _, name = path.removeprefix("tinker://").split("/")
    folder = service["state"] / "alice" / model_id / "sampler_weights" / name
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(service["model"], dtype=torch.float32), str(folder)).eval()
    for row, d in zip(served, data):
        tokens = d["model_input"]["chunks"][0]["tokens"]
        targets = torch.tensor(d["loss_fn_inputs"]["target_tokens"]["data"])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
        direct = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(row), direct, atol=1e-5, rtol=0)
    # forward_backward returns the logprobs of the weights it ran on (before the step that followed)
    assert len(fb.result()["loss_fn_outputs"][0]["logprobs"]["data"]) == len(PROMPT)


def test_importance_sampling_raises_a_positive_advantage_token(service):
    trainer = client(service, "alice").create_lora_training_client(rank=4)
    tokens, targets = PROMPT, PROMPT[1:] + [300]
    before = logprobs(trainer, [datum(tokens, targets)])[0]
    advantages = [0.0] * (len(tokens) - 1) + [1.0]
    d = datum(tokens, targets, logprobs=before, advantages=advantages)
    out = trainer.forward_backward([d], "importance_sampling").result()
    # at ratio 1 the loss is -sum(advantages); ppo agrees there (nothing clipped)
    assert out["metrics"]["loss:sum"] == pytest.approx(-1.0, abs=1e-5)
    trainer.optim_step({"learning_rate": 0.01}).result()
    after = logprobs(trainer, [datum(tokens, targets)])[0]
    assert after[-1] > before[-1] + 1e-3
    ppo = trainer.forward([datum(tokens, targets, logprobs=after, advantages=advantages)], "ppo").result()
    assert ppo["metrics"]["loss:sum"] == pytest.approx(-1.0, abs=1e-5)


def test_samples_come_from_the_adapters_own_weights(service):
    check_samples_follow_the_adapter(client(service, "alice"), client(service, "bob"))


def test_another_tenants_adapter_is_not_found_and_keys_are_checked(service):
    alice, bob = client(service, "alice"), client(service, "bob")
    trainer = alice.create_lora_training_client(rank=2)
    saved = trainer.save_state("mine").result()["path"]
    future = trainer.forward(PROBE)
    future.result()
    calls = [
        lambda: bob.post("forward", {"model_id": trainer.model_id, "forward_input": {"data": PROBE, "loss_fn": "cross_entropy"}}),
        lambda: bob.post("get_info", {"model_id": trainer.model_id}),
        lambda: bob.post("retrieve_future", {"request_id": future.request_id}),
        lambda: bob.post("saved_state_info", {"path": saved}),
    ]
    for call in calls:
        with pytest.raises(ServiceError) as err:
            call()
        assert err.value.status == 404, err.value
    url = service["proc"].url + "/api/v1/get_info"
    assert httpx.post(url, json={"model_id": trainer.model_id}).status_code == 401
    assert httpx.post(url, json={"model_id": trainer.model_id}, headers={"X-API-Key": "tml-not-a-tenant-key"}).status_code == 403
    assert trainer.get_info()["model_id"] == trainer.model_id


def test_every_deflate_body_is_answered_415_unread_and_the_connections_go_on_serving(service):
    """A deflate body is refused before the key or the body is read (``noria.net.deflate_body``: aiohttp
    can leave such a request unanswered); the plain requests beside it on one client are answered."""
    import asyncio

    from engine_server_util import deflate_among_good_codes, split_deflate_status

    url = service["proc"].url + "/api/v1/get_info"
    assert asyncio.run(split_deflate_status(url, {"X-API-Key": KEYS["bob"]})) == 415  # its end after the headers
    codes = asyncio.run(deflate_among_good_codes(url, b'{"model_id": "none"}', {"X-API-Key": KEYS["bob"]}))
    assert set(codes[1::2]) <= {415, 400} and set(codes[::2]) == {404}, codes


def test_quotas_are_answered_429_with_retry_after(service):
    carol = client(service, "carol")
    trainer = carol.create_lora_training_client(rank=2)
    with pytest.raises(ServiceError) as err:
        carol.create_lora_training_client(rank=2)
    assert err.value.status == 429 and err.value.retry_after_s >= 1 and "max_adapters" in err.value.message
    long = [datum(list(range(1, 71)), list(range(2, 72)))]  # 70 tokens: over 64 a minute in one call
    with pytest.raises(ServiceError) as err:
        trainer.forward_backward(long, "cross_entropy")
    assert err.value.status == 429 and "tokens_per_minute" in err.value.message
    half = [datum(list(range(1, 41)), list(range(2, 42)))]
    trainer.forward_backward(half, "cross_entropy").result()
    with pytest.raises(ServiceError) as err:
        trainer.forward_backward(half, "cross_entropy")
    assert err.value.status == 429 and 1 <= err.value.retry_after_s <= 60
    trainer.unload().result()  # the adapter quota is freed
    carol.create_lora_training_client(rank=2)


def test_a_tenants_nonfinite_loss_touches_no_adapter(service):
    alice, bob = client(service, "alice"), client(service, "bob")
    mine, theirs = alice.create_lora_training_client(rank=4), bob.create_lora_training_client(rank=4)
    for trainer in (mine, theirs):
        train(trainer, target_data(50), steps=1)
    before = {"alice": logprobs(mine), "bob": logprobs(theirs)}
    lp = before["alice"][0]
    overflow = datum(PROMPT, PROMPT[1:] + [17], logprobs=lp, advantages=[3e38] * len(PROMPT))  # finite, sums to inf
    with pytest.raises(RequestFailed) as err:
        mine.forward_backward([overflow], "importance_sampling").result()
    assert err.value.category == "user" and "the loss is -inf" in str(err.value)
    nan = datum(PROMPT, PROMPT[1:] + [17], logprobs=lp, advantages=[float("nan")] * len(PROMPT))
    body = {"model_id": mine.model_id, "forward_backward_input": {"data": [nan], "loss_fn": "importance_sampling"}}
    url = service["proc"].url + "/api/v1/forward_backward"  # NaN as Python's json writes it (httpx refuses to)
    answer = httpx.post(url, content=json.dumps(body), headers={"X-API-Key": KEYS["alice"], "Content-Type": "application/json"})
    assert answer.status_code == 400 and "data[0].loss_fn_inputs.advantages[0]: nan" in answer.json()["error"]["message"]
    # nothing was kept: no gradient waits for a step, and neither adapter moved
    with pytest.raises(RequestFailed, match="no forward_backward"):
        mine.optim_step({"learning_rate": 0.01}).result()
    assert {"alice": logprobs(mine), "bob": logprobs(theirs)} == before
    train(theirs, target_data(50), steps=1)  # the other tenant trains on
    assert logprobs(mine) == before["alice"]


def _state(folder) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter.safetensors")), torch.load(folder / "optimizer.pt", weights_only=True)


def _same_optimizer(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(torch.equal(a["state"][k][n], b["state"][k][n]) for k in a["state"] for n in a["state"][k])


def test_save_and_load_state_round_trip_bit_for_bit(service):
    trainer = client(service, "bob").create_lora_training_client(rank=4)
    train(trainer, target_data(60), steps=2)
    path = trainer.save_state("two").result()["path"]
    at_save = logprobs(trainer)
    train(trainer, target_data(61), steps=2)
    assert logprobs(trainer) != at_save
    trainer.load_state(path).result()
    assert logprobs(trainer) == at_save
    trainer.save_state("again").result()
    root = service["state"] / "bob" / trainer.model_id / "weights"
    (w1, o1), (w2, o2) = _state(root / "two"), _state(root / "again")
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    assert _same_optimizer(o1, o2) and len(o1["state"]) == len(w1)
    service["resume"] = (path, at_save, trainer.get_info()["optimizer_steps"])


def test_a_restarted_service_resumes_from_the_saved_state(service):
    path, at_save, _ = service["resume"]
    service["proc"].stop()
    args = ("--service.sampler", "false")  # training only: the restart need not load the engine too
    service["proc"] = ServiceProcess(service["model"], service["keys"], service["state"], service["folder"], *args).wait_ready()
    bob = client(service, "bob")
    trainer = bob.create_training_client_from_state(path)
    assert logprobs(trainer) == at_save
    assert trainer.get_info()["optimizer_steps"] == 2
    with pytest.raises(ServiceError) as err:  # saved states are the tenant's own after a restart too
        client(service, "alice").create_training_client_from_state(path)
    assert err.value.status == 404
    train(trainer, target_data(60), steps=1)
