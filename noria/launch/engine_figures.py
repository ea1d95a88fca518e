"""The rollout engines' figures on each step's line (``engine/*``, ``rollout/spec_*``).

An engine keeps running totals since its start (prompt tokens admitted and those its prefix cache
served, drafted and accepted tokens, ...); a step's line shows each ratio over the interval since the
previous line (:data:`RATES`), so a step without traffic shows 0, not the history. ``noria serve``
engines report their share of KV blocks in use through ``/get_load`` (:func:`kv_usage`).
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

RATES = {
    "engine/prefix_hit_rate": ("prefix_cached_tokens", "prefix_prompt_tokens"),
    "rollout/spec_acceptance": ("spec_accepted_tokens", "spec_proposed_tokens"),
    "rollout/spec_tokens_per_verify": ("spec_verify_tokens", "spec_verify_rows"),
}
"""A step line's ratio -> (numerator, denominator): running totals of ``Engine.metrics()``."""


def local_engine_figures(metrics: dict[str, Any], seen: dict[str, float]) -> dict[str, float]:
    """The step's figures of an in-process engine from its ``metrics()``: retractions and KV usage as
    read, and each of :data:`RATES` the engine reports over the interval since ``seen`` (the totals
    at the previous line, updated here; 0 when the denominator did not move)."""
    out = {f"engine/{k}": float(metrics[k]) for k in ("retractions", "kv_usage") if k in metrics}
    for name, (num, den) in RATES.items():
        if num in metrics and den in metrics:
            moved = metrics[den] - seen.get(den, 0)
            out[name] = (metrics[num] - seen.get(num, 0)) / moved if moved > 0 else 0.0
            seen[num], seen[den] = metrics[num], metrics[den]
    if "spec_fallbacks" in metrics:
        out["rollout/spec_fallbacks"] = float(metrics["spec_fallbacks"])
    if "spec_drafter_loss" in metrics:  # the mlp drafter
        out["rollout/spec_drafter_loss"] = float(metrics["spec_drafter_loss"])
        out["rollout/spec_drafter_train_s"] = metrics["spec_drafter_train_s"] - seen.get("spec_drafter_train_s", 0.0)
        seen["spec_drafter_train_s"] = metrics["spec_drafter_train_s"]
    if "prefix_prompt_tokens" not in metrics and "prefix_hit_rate" in metrics:  # the generic engine's own rate
        out["engine/prefix_hit_rate"] = float(metrics["prefix_hit_rate"])
    return out


def kv_usage(engines: list[tuple[str, str]], timeout_s: float = 5.0) -> dict[str, float]:
    """``engine/kv_usage``: the mean share of KV blocks in use over the ``noria serve`` engines at
    (url, key), from their ``/get_load`` (one loopback request each); left out when one does not
    answer in ``timeout_s`` (a step's line is no reason to stop a run)."""
    shares = []
    for url, key in engines:
        request = urllib.request.Request(f"{url}/get_load", headers={"Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                shares.append(float(json.loads(answer.read())["kv_usage"]))
        except (OSError, ValueError, KeyError):  # not measured this step: busy, stopping or restarting
            return {}
    return {"engine/kv_usage": sum(shares) / len(shares)} if shares else {}
