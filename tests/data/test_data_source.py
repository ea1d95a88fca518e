"""Reading prompt files: each format loads, each kind of bad input names file, row and field (CPU, fast)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from noria.config import DataConfig
from noria.data import DataError, FieldMap, load_prompts, read_prompt_file

ROWS = [
    {"prompt": "What is 1 + 1?", "label": "2", "level": 1},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}],
     "label": "4", "level": 2},
    {"prompt": "What is 3 * 3?", "label": 9, "level": 1},
]
FIELDS = FieldMap("prompt", "label", ("level",))


def write_jsonl(path: Path, rows: list, extra_lines: tuple[str, ...] = ()) -> Path:
    lines = [json.dumps(r) for r in rows] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def check_rows(prompts, source: Path) -> None:
    assert [p.label for p in prompts] == ["2", "4", 9]
    assert prompts[0].prompt == "What is 1 + 1?"
    assert prompts[1].prompt == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
    )
    assert [p.metadata for p in prompts] == [{"level": 1}, {"level": 2}, {"level": 1}]
    assert [p.index for p in prompts] == [0, 1, 2]
    assert {p.source for p in prompts} == {str(source)}


def test_jsonl_loads(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    check_rows(read_prompt_file(path, FIELDS).prompts, path)


def test_parquet_loads(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [dict(r, label=str(r["label"])) for r in ROWS if isinstance(r["prompt"], str)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    prompts = read_prompt_file(path, FIELDS).prompts
    assert [p.prompt for p in prompts] == ["What is 1 + 1?", "What is 3 * 3?"]
    assert [p.metadata["level"] for p in prompts] == [1, 1]


def test_parquet_chat_messages_load(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": ROWS[1]["prompt"], "label": "4"}]), path)
    (prompt,) = read_prompt_file(path, FieldMap("prompt", "label")).prompts
    assert prompt.prompt[1] == {"role": "user", "content": "What is 2 + 2?"}


def test_hf_dataset_folder_and_arrow_file_load(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [dict(r, label=str(r["label"])) for r in ROWS if isinstance(r["prompt"], str)]
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    by_folder = read_prompt_file(folder, FIELDS).prompts
    assert [p.label for p in by_folder] == ["2", "9"]
    (arrow_file,) = folder.glob("*.arrow")
    by_file = read_prompt_file(arrow_file, FIELDS).prompts
    assert [p.prompt for p in by_file] == [p.prompt for p in by_folder]


def test_hf_dataset_dict_folder_names_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"prompt": "hi", "label": "x"}])
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match="several splits.*train"):
        read_prompt_file(tmp_path / "dd", FIELDS)
    assert len(read_prompt_file(tmp_path / "dd" / "train", FieldMap("prompt", "label"))) == 1


def test_unknown_extension_names_file_and_supported(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("prompt,label\n")
    with pytest.raises(DataError, match=r"data\.csv.*\.jsonl.*\.parquet"):
        read_prompt_file(path, FIELDS)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found.*nope.jsonl"):
        read_prompt_file(tmp_path / "nope.jsonl", FIELDS)


BAD_ROWS = {
    "invalid json": ('{"prompt": "x", "label": ', r"line 2: not valid JSON"),
    "not an object": ('["a list"]', r"line 2: expected an object"),
    "missing prompt": (json.dumps({"label": "1", "level": 0}), r"line 2: field 'prompt' is missing"),
    "missing label": (json.dumps({"prompt": "x", "level": 0}), r"line 2: field 'label' is missing"),
    "null label": (json.dumps({"prompt": "x", "label": None, "level": 0}), r"line 2: field 'label'"),
    "missing metadata": (json.dumps({"prompt": "x", "label": "1"}), r"line 2: field 'level' is missing"),
    "prompt wrong type": (
        json.dumps({"prompt": 5, "label": "1", "level": 0}),
        r"line 2: field 'prompt': expected a string",
    ),
    "empty prompt": (
        json.dumps({"prompt": "  ", "label": "1", "level": 0}),
        r"line 2: field 'prompt': the prompt is empty",
    ),
    "empty messages": (
        json.dumps({"prompt": [], "label": "1", "level": 0}),
        r"line 2: field 'prompt': the message list is empty",
    ),
    "bad role": (
        json.dumps({"prompt": [{"role": "wizard", "content": "x"}], "label": "1", "level": 0}),
        r"line 2: field 'prompt\[0\]\.role'",
    ),
    "content not a string": (
        json.dumps({"prompt": [{"role": "user", "content": 3}], "label": "1", "level": 0}),
        r"line 2: field 'prompt\[0\]\.content'",
    ),
    "no user message": (
        json.dumps({"prompt": [{"role": "system", "content": "s"}], "label": "1", "level": 0}),
        r"line 2: field 'prompt': the messages contain no 'user'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_row_names_file_line_and_field(tmp_path, case):
    line, pattern = BAD_ROWS[case]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + line + "\n")
    with pytest.raises(DataError, match=pattern) as info:
        read_prompt_file(path, FIELDS)
    assert str(path) in str(info.value)


def test_bad_parquet_row_names_row_and_field(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "ok", "label": "1"}, {"prompt": "", "label": "2"}]), path)
    with pytest.raises(DataError, match=r"bad\.parquet: row 2: field 'prompt'"):
        read_prompt_file(path, FieldMap("prompt", "label"))


def test_line_numbers_count_blank_lines_but_indices_do_not(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text("\n" + json.dumps(ROWS[0]) + "\n\n" + json.dumps({"prompt": ""}) + "\n")
    with pytest.raises(DataError, match="line 4"):
        read_prompt_file(path, FIELDS)
    good = tmp_path / "good.jsonl"
    good.write_text("\n" + json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[2]) + "\n")
    assert [p.index for p in read_prompt_file(good, FIELDS)] == [0, 1]


def test_skip_bad_rows_counts_and_keeps_reasons(tmp_path):
    bad = [BAD_ROWS[k][0] for k in ("invalid json", "missing label", "empty prompt")]
    path = write_jsonl(tmp_path / "mixed.jsonl", ROWS, extra_lines=tuple(bad))
    dataset = read_prompt_file(path, FIELDS, skip_bad_rows=True)
    assert len(dataset) == 3 and dataset.n_skipped == 3
    assert "line 4: not valid JSON" in dataset.skip_reasons[0]
    assert "line 5: field 'label' is missing" in dataset.skip_reasons[1]
    assert "line 6: field 'prompt'" in dataset.skip_reasons[2]


def test_skip_reasons_are_capped(tmp_path):
    path = write_jsonl(tmp_path / "many.jsonl", [ROWS[0]] + [{"prompt": ""}] * 20)
    dataset = read_prompt_file(path, FIELDS, skip_bad_rows=True)
    assert dataset.n_skipped == 20 and len(dataset.skip_reasons) == 5


def test_no_label_key(tmp_path):
    path = write_jsonl(tmp_path / "nolabel.jsonl", [{"q": "hello"}])
    (prompt,) = read_prompt_file(path, FieldMap("q", None)).prompts
    assert prompt.prompt == "hello" and prompt.label is None


def test_load_prompts_file_splits(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    test = write_jsonl(tmp_path / "test.jsonl", ROWS[:1])
    cfg = DataConfig(path=str(train), test_path=str(test), metadata_keys=["level"])
    assert len(load_prompts(cfg, "train")) == 3
    assert len(load_prompts(cfg, "test")) == 1
    with pytest.raises(DataError, match="test_path"):
        load_prompts(DataConfig(path=str(train)), "test")


def test_load_prompts_all_rows_bad_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "allbad.jsonl", [{"prompt": ""}])
    with pytest.raises(DataError, match="no usable prompts"):
        load_prompts(DataConfig(path=str(path), skip_bad_rows=True), "train")


def test_load_prompts_task_split():
    cfg = DataConfig(task="arithmetic", task_args={"n_train": 7, "n_test": 3})
    assert [len(load_prompts(cfg, s)) for s in ("train", "test")] == [7, 3]


def test_folder_that_is_not_a_saved_dataset(tmp_path):
    pytest.importorskip("datasets")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="plain: not a dataset folder"):
        read_prompt_file(tmp_path / "plain", FIELDS)


def test_oversized_row_is_refused_by_line_without_being_held(tmp_path):
    """An 80 MiB line used to be read whole (a 200 MB one grew memory past 16 GB)."""
    import tracemalloc

    from noria.data.source import MAX_ROW_BYTES

    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        f.write(json.dumps(ROWS[0]) + "\n")
        f.write('{"prompt": "' + "x" * (80 << 20) + '", "label": "1", "level": 0}\n')
        f.write(json.dumps(ROWS[2]) + "\n")
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=rf"{path}: line 2: longer than {MAX_ROW_BYTES} bytes"):
            read_prompt_file(path, FIELDS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * MAX_ROW_BYTES  # bounded by the limit, not by the line (80 MiB here)
    kept = read_prompt_file(path, FIELDS, skip_bad_rows=True)
    assert [p.index for p in kept] == [0, 2] and kept.n_skipped == 1  # the next line is read as a row of its own


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(ROWS[0]).encode() + b'\n{"prompt": "caf\xe9", "label": "1", "level": 0}\n')
    with pytest.raises(DataError, match=rf"{path}: line 2: not valid UTF-8"):
        read_prompt_file(path, FIELDS)
