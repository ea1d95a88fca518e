"""Helpers of the built-in engine tests (tests/engine/): prompts, greedy sampling, the no-cache
reference decode (the native model's full forward, token by token), and submitting to a running
engine. The ``model`` and ``tokenizer`` fixtures they go with are in tests/engine/conftest.py."""

from __future__ import annotations

import concurrent.futures
import time

import torch

from noria.engine import Engine, GenerateRequest, SamplingParams

NEW = 12


def prompt(n: int, salt: int = 0) -> list[int]:
    return [3 + (7 * i + 13 * salt) % 400 for i in range(n)]


def greedy(n_new: int = NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n_new, ignore_eos=True, **kw)


@torch.no_grad()
def reference(model, ids: list[int], n_new: int = NEW) -> tuple[list[int], list[float]]:
    ids, out, lps = list(ids), [], []
    for _ in range(n_new):
        logits = model(torch.tensor([ids]))[0, -1].float()
        token = int(logits.argmax())
        out.append(token)
        lps.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return out, lps


def submit(engine: Engine, req: GenerateRequest) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    engine.submit(req, fut.set_result)
    return fut


def wait_until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.002)
