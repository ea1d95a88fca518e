"""`noria bench train` on the tiny model: every side runs and the JSON has the benchmark shape (docs/architecture.md).

CPU; each side is a fresh subprocess (about 30 s in all). No timing assertions: the figures of a
tiny model on a shared machine mean nothing, only the plumbing is checked.
"""

import importlib.util
import json

import pytest

from noria.bench import train as bench_train


def test_bench_train_writes_the_json_shape(tmp_path, tiny_model_dir):
    peers = ["hf_padded"] + (["trl"] if importlib.util.find_spec("trl") else [])
    out = tmp_path / "train.json"
    results = bench_train.run(str(tiny_model_dir), sequences=4, min_len=8, max_len=24, steps=1, peers=peers,
                              json_path=str(out), micro_batch_tokens=32, warmup=1)
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "train" and {"command", "date", "machine"} <= set(doc)
    assert doc["results"] == results
    speed, memory = results
    assert speed["metric"] == "tokens_per_s" and memory["metric"] == "peak_rss_mb"
    for row in results:
        assert "seqs=4" in row["case"] and set(row["peers"]) == set(peers)
        assert row["noria"] > 0 and all(v > 0 for v in row["peers"].values())
    assert speed["bound"] > 0 and memory["bound"] is None


def test_sequences_are_seeded_and_split_in_halves(tiny_model_dir):
    job = {"model": str(tiny_model_dir), "sequences": 5, "min_len": 6, "max_len": 11, "micro_batch_tokens": 20}
    seqs, adv = bench_train.make_case(job)
    assert (seqs, adv) == bench_train.make_case(job) and len(adv) == 5
    assert [len(p) + len(r) for p, r in seqs] == bench_train.case_lengths(job)
    assert all(len(p) == (len(p) + len(r)) // 2 and 6 <= len(p) + len(r) <= 11 for p, r in seqs)
    assert bench_train.peer_micro_seqs(job) >= 1


def test_bad_arguments_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown"):
        bench_train.run(str(tiny_model_dir), peers=["deepspeed"])
