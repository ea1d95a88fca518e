"""Config: closed, typed, validated, dotted overrides, every shipped example parses."""


import pytest
import yaml

from noria.config import ConfigError, RunConfig, field_docs, load_config, parse_overrides, save_config, to_dict
from repo_util import ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
BASE = ["--model.path", "some-model", "--data.task", "arithmetic"]


def test_examples_exist():
    assert EXAMPLES, "examples/ holds no configs"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_shipped_example_parses(path):
    config = load_config(path)
    assert isinstance(config, RunConfig)
    assert config.model.path


def test_overrides_are_typed_and_applied():
    config = load_config(None, BASE + ["--rollout.n_samples", "4", "--eval.temperature=0.5", "--data.metadata_keys", "[a, b]"])
    assert config.rollout.n_samples == 4
    assert config.eval.temperature == 0.5
    assert config.data.metadata_keys == ["a", "b"]


def test_override_beats_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "m"}, "data": {"task": "arithmetic"}, "rollout": {"n_samples": 2}}))
    assert load_config(path, ["--rollout.n_samples", "16"]).rollout.n_samples == 16


@pytest.mark.parametrize(
    "override, words",
    [
        (["--rollout.n_sample", "8"], ["rollout.n_sample", "rollout.n_samples"]),
        (["--modle.path", "x"], ["modle", "'model'"]),
        (["--eval.max_new_token", "8"], ["eval.max_new_token", "eval.max_new_tokens"]),
    ],
)
def test_misspelled_key_names_path_and_closest(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, BASE + override)
    for word in words:
        assert word in str(e.value)


def test_misspelled_key_in_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  path: m\n  dtyp: float32\ndata:\n  task: arithmetic\n")
    with pytest.raises(ConfigError, match=r"model\.dtyp.*did you mean 'model\.dtype'"):
        load_config(path)


@pytest.mark.parametrize(
    "override, match",
    [
        (["--rollout.n_samples", "many"], "rollout.n_samples: expected int"),
        (["--model.dtype", "bf16"], "did you mean 'bfloat16'"),
        (["--rollout.temperature", "-1"], "rollout.temperature must be >= 0"),
        (["--rollout.top_p", "0"], "rollout.top_p"),
        (["--data.path", "x.jsonl"], "exactly one of data.task"),
        (["--eval.batch_size", "0"], "eval.batch_size"),
        (["--data.shuffle", "3"], "data.shuffle: expected bool"),
        (["--rollout", "5"], "rollout must be a mapping"),
    ],
)
def test_bad_values_rejected(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, BASE + override)


def test_missing_model_path_rejected():
    with pytest.raises(ConfigError, match="model.path is required"):
        load_config(None, ["--data.task", "arithmetic"])


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="has no value"):
        parse_overrides(["--rollout.n_samples"])
    with pytest.raises(ConfigError, match="expected an override"):
        parse_overrides(["rollout.n_samples", "3"])


def test_resolved_config_roundtrips(tmp_path):
    config = load_config(None, BASE + ["--rollout.stop", "['</answer>']"])
    path = save_config(config, tmp_path / "run" / "config.yaml")
    again = load_config(path)
    assert to_dict(again) == to_dict(config)
    assert yaml.safe_load(path.read_text())["rollout"]["max_new_tokens"] == 256  # defaults are written out


def test_every_field_is_documented():
    for key, _type, _default, help_text in field_docs():
        assert help_text, f"config key {key} has no help text"


@pytest.mark.parametrize("key", ["train.optim.lr", "rollout.temperature", "reward.timeout_s"])
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_non_finite_numbers_are_refused(key, value):
    """`.nan` for reward.timeout_s once made 3,176 of 3,200 samples time out, and the run exit 0."""
    with pytest.raises(ConfigError, match=rf"{key}: .* is not a finite number"):
        load_config(None, ["--model.path", "x", "--data.task", "arithmetic", f"--{key}", value])


def test_validate_writes_nothing_and_resolve_is_the_named_step():
    from noria.config import from_dict

    raw = from_dict(RunConfig, {"model": {"path": "some-model"}, "data": {"task": "arithmetic"}})
    before = to_dict(raw)
    raw.validate()
    assert to_dict(raw) == before  # checks only
    assert raw.rollout.prompts_per_step is None and raw.model.dtype == "auto"
    raw.resolve()  # resolve_batch, resolve_dtypes
    assert (raw.rollout.prompts_per_step, raw.train.global_batch, raw.train.steps_per_rollout) == (8, 64, 1)
    assert raw.model.dtype in ("bfloat16", "float32") and raw.train.param_dtype == raw.model.dtype
    assert to_dict(load_config(None, BASE)) == to_dict(raw)  # loading is parse, validate, resolve


def test_a_section_is_validated_once_whether_loaded_or_built_in_code():
    from noria.config import TrainConfig
    from noria.train.fsdp import FSDPBackend

    calls = []
    loaded = load_config(None, BASE).train
    loaded.validate = lambda: calls.append("loaded")  # validated when loaded: not again
    FSDPBackend(loaded)
    built = TrainConfig()
    built.validate = lambda: calls.append("built")  # built in code: once, by the component
    FSDPBackend(built)
    assert calls == ["built"]
    with pytest.raises(ConfigError, match="train.world_size > 1 needs train.backend: fsdp2"):
        FSDPBackend(TrainConfig(world_size=2))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["--launch", "ray"], "launch: ray in RL starts its own engines"),
        (["--train.backend", "fsdp2", "--train.world_size", "2"], r"train.world_size > 1 in RL starts its own engines"),
        (["--rollout.engines", "2"], "rollout.engines > 1 starts a fleet"),
        (["--rollout.placement", "disaggregated", "--rollout.engines", "0"], "rollout.engines must be >= 1"),
        (["--launch", "ray", "--rollout.placement", "disaggregated", "--ray.engine_resources", "{GPU: -1}"], "ray.engine_resources"),
        (["--launch", "kubernetes"], "is not one of"),
    ],
)
def test_launch_and_fleet_settings_are_checked(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["--model.path", "x", "--data.task", "arithmetic", *overrides])


def test_a_ray_fleet_config_loads_with_its_placement():
    config = load_config(None, [
        "--model.path", "x", "--data.task", "arithmetic", "--launch", "ray", "--ray.address", "auto",
        "--rollout.placement", "disaggregated", "--rollout.engines", "3", "--train.backend", "fsdp2",
        "--train.world_size", "2", "--ray.trainer_resources", "{CPU: 2, GPU: 1}",
    ])  # fmt: skip
    assert (config.launch, config.ray.address, config.rollout.engines) == ("ray", "auto", 3)
    assert config.ray.trainer_resources == {"CPU": 2, "GPU": 1}


def test_boolean_flags_stand_alone_or_negated():
    flags = BASE + ["--sync.verify", "--eval.temperature", "0.5"]
    config = load_config(None, flags)
    assert config.sync.verify is True and config.eval.temperature == 0.5
    assert load_config(None, BASE + ["--sync.verify", "false"]).sync.verify is False
    assert load_config(None, [*BASE, "--sync.verify", "--no-sync.verify"]).sync.verify is False
    with pytest.raises(ConfigError, match="has no value"):
        load_config(None, BASE + ["--rollout.n_samples"])


def test_a_single_value_where_a_list_is_expected():
    config = load_config(None, BASE + ["--log.loggers", "jsonl"])
    assert config.log.loggers == ["jsonl"]
    assert load_config(None, BASE + ["--data.metadata_keys", "[a, b]"]).data.metadata_keys == ["a", "b"]


def test_config_files_include_others(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "common.yaml").write_text(
        "model: {path: m, dtype: float32}\ndata: {task: arithmetic}\nrollout: {n_samples: 2, max_new_tokens: 7}\n"
    )
    (tmp_path / "mid.yaml").write_text("extends: base/common.yaml\nrollout: {n_samples: 4}\n")
    (tmp_path / "run.yaml").write_text("defaults: [mid.yaml]\nrollout: {temperature: 0.5}\n")
    config = load_config(tmp_path / "run.yaml", ["--rollout.max_new_tokens", "9"])
    assert (config.rollout.n_samples, config.rollout.temperature, config.rollout.max_new_tokens) == (4, 0.5, 9)
    assert config.model.dtype == "float32" and config.data.task == "arithmetic"


def test_config_include_cycles_and_missing_files_are_refused(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("defaults: [a.yaml]\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("extends: nope.yaml\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: extends names nope\.yaml, not found"):
        load_config(tmp_path / "c.yaml")


def test_engine_args_are_for_a_vllm_server_the_run_starts():
    config = load_config(None, ["--model.path", "m", "--data.task", "arithmetic", "--rollout.placement", "disaggregated", "--rollout.engine", "vllm",
                                "--rollout.engine_args", "['--enforce-eager', '--max-num-seqs', '64']"])  # fmt: skip
    assert config.rollout.engine_args == ["--enforce-eager", "--max-num-seqs", "64"]
    for extra in (["--rollout.engine", "noria"], ["--rollout.engine_url", "http://127.0.0.1:30000"]):
        with pytest.raises(ConfigError, match="rollout.engine_args"):
            load_config(None, ["--model.path", "m", "--data.task", "arithmetic", "--rollout.placement", "disaggregated", "--rollout.engine", "vllm",
                               "--rollout.engine_args", "['--enforce-eager']", *extra])  # fmt: skip
