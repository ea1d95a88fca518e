"""`noria bench sync` on the tiny model: every case runs and the JSON has the benchmark shape (docs/architecture.md).

CPU; starts two ``noria serve`` subprocesses and a gloo receiver (about 20 s). No timing
assertions: a tiny model's figures on a shared machine mean nothing, only the plumbing is checked.
"""

import json

import pytest
import torch

from noria import hardware
from noria.bench import sync as bench_sync
from noria.cli import main


def test_bench_sync_writes_the_json_shape(tmp_path, tiny_model_dir):
    out = tmp_path / "sync.json"
    results = bench_sync.run([str(tiny_model_dir)], bucket_mb=1, repeats=1, json_path=str(out), work_dir=str(tmp_path))
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "sync" and {"command", "date", "machine"} <= set(doc)
    assert doc["results"] == results
    delta = {r["metric"]: r for r in results if "disk delta" in r["case"]}
    pushes = [r for r in results if r["metric"] in ("gb_per_s", "push_s") and "disk delta" not in r["case"]]
    assert len(pushes) == 2 * (len(bench_sync.TRANSPORT_CASES) - 1)
    for row in pushes:
        assert row["noria"] > 0 and row["bound"] > 0 and row["peers"] == {}
    for row in results:
        assert set(row) == {"case", "metric", "noria", "peers", "bound"}
    assert set(delta) == {"push_s", "bytes_written", "changed_frac"}  # against the full disk push of the same run
    assert delta["push_s"]["noria"] > 0 and delta["push_s"]["peers"]["disk"] > 0
    assert 0 < delta["bytes_written"]["noria"] < delta["bytes_written"]["peers"]["disk"]
    assert 0 < delta["changed_frac"]["noria"] < 1
    cases = " ".join(r["case"] for r in pushes)
    for words in ("in-process", "shared-memory (noria serve subprocess, cpu)", "broadcast gloo", "disk", "vs memcpy", "vs gloo_broadcast"):
        assert words in cases
    assert list(tmp_path.glob("noria-bench-sync-*")) == []  # the work folder is removed
    requantized = {r["case"].split("engine.quantization=")[1].split(":")[0]: r for r in results if "re-quantization" in r["case"]}
    # each quantized engine's commit, beside the unquantized repack; where a bf16 model has no fast path
    # (acting as AVX2: oneDNN has no bf16 kernels) there is neither a repack nor integer layers to time
    repacked = any("engine repack" in r["case"] for r in results)
    assert repacked == hardware.packed_linear_ok(torch.bfloat16)
    assert set(requantized) == ({"int8", "int4"} if repacked else set())
    assert all(r["noria"] > 0 and r["peers"]["unquantized repack"] > 0 for r in requantized.values())


def test_bad_arguments_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown"):
        bench_sync.run([str(tiny_model_dir)], transports=["carrier-pigeon"])
    with pytest.raises(SystemExit):
        main(["bench", "sync", "--repeats", "x"])
