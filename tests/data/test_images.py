"""Images in data rows: every way a row may carry one loads to the same content hash, and each kind
of bad image is refused naming file, row, field and reason, with nothing loaded from that row (CPU, fast)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from noria.data import DataError, FieldMap, read_prompt_file
from noria.data.images import ImageError, ImageStore, decode_image, default_store, image_hash
from noria.data.vision_chat import prompt_images

FIELDS = FieldMap("prompt", "label")


def png(size=(12, 8), color=90, mode="L") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, color).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media="image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def test_every_form_of_one_image_gives_one_hash(tmp_path):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(png())
    text = {"type": "text", "text": "What is this?"}
    rows = [
        {"prompt": "What is this?", "images": ["pics/a.png"], "label": "1"},  # string prompt + images field
        {"prompt": user({"type": "image"}, text), "images": "pics/a.png", "label": "2"},  # bare part filled in
        {"prompt": user({"type": "image_url", "image_url": {"url": data_url(png())}}, text), "label": "3"},  # OpenAI
        {"prompt": user(text, {"type": "image", "path": str(tmp_path / "pics" / "a.png")}), "label": "4"},  # absolute path
        {"prompt": "no image here", "images": [], "label": "5"},
    ]
    prompts = read_prompt_file(write_rows(tmp_path / "rows.jsonl", rows), FIELDS).prompts
    ref = image_hash(Image.open(io.BytesIO(png())))
    assert [prompt_images(p) for p in prompts] == [[ref], [ref], [ref], [ref], []]
    assert prompts[0].prompt == ({"role": "user", "content": [{"type": "image", "image": ref}, text]},)
    assert prompts[3].prompt[0]["content"] == [text, {"type": "image", "image": ref}]  # order kept
    assert prompts[4].prompt == "no image here"
    assert default_store().get(ref).size == (12, 8)
    json.dumps([p.prompt for p in prompts])  # prompts stay plain JSON (checkpoints, buffer files)


def test_parquet_bytes_and_datasets_image_mapping(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    data = png(color=7)
    refs = []
    for name, images in [("bytes", [[data]]), ("mapping", [[{"bytes": data, "path": None}]])]:
        pq.write_table(pa.table({"prompt": ["one"], "label": ["1"], "images": images}), tmp_path / f"{name}.parquet")
        refs += [prompt_images(p) for p in read_prompt_file(tmp_path / f"{name}.parquet", FIELDS).prompts]
    assert refs == [[image_hash(decode_image(data))]] * 2


def truncated_png() -> bytes:
    out = io.BytesIO()
    Image.effect_noise((64, 64), 40).save(out, format="PNG")
    return out.getvalue()[:-200]


def sixteen_bit_png() -> bytes:
    out = io.BytesIO()
    Image.new("I;16", (4, 4), 300).save(out, format="PNG")
    return out.getvalue()


def huge_png() -> bytes:
    out = io.BytesIO()
    Image.new("1", (5000, 4000), 0).save(out, format="PNG")  # 20M pixels, a few kB encoded
    return out.getvalue()


BAD = [
    ("garbage.png", b"this is not an image at all", "cannot be decoded as an image"),
    ("cut.png", truncated_png(), "cannot be decoded"),
    ("deep.png", sixteen_bit_png(), "pixel mode 'I;16'"),
    ("huge.png", huge_png(), "5000x4000 = 20000000 pixels, more than"),
]


@pytest.mark.parametrize("name, data, reason", BAD, ids=[b[0] for b in BAD])
def test_bad_image_names_file_row_field_and_reason(tmp_path, name, data, reason):
    (tmp_path / name).write_bytes(data)
    rows = [{"prompt": "fine", "label": "1"}, {"prompt": "look", "images": [name], "label": "2"}]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    with pytest.raises(DataError, match=rf"rows\.jsonl: line 2: field 'images\[0\]'.*{reason}") as e:
        read_prompt_file(path, FIELDS)
    assert isinstance(e.value.__cause__ or e.value, (ImageError, DataError))
    skipped = read_prompt_file(path, FIELDS, skip_bad_rows=True)
    assert [p.label for p in skipped.prompts] == ["1"] and skipped.n_skipped == 1  # nothing of the bad row is kept


@pytest.mark.parametrize(
    "value, reason",
    [
        ("https://example.com/cat.png", "https:// URLs are not fetched"),
        ("file:///etc/hosts", "file:// URLs are not fetched"),
        ("missing.png", "image file not found"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("data:text/plain;base64,aGk=", "media type 'text/plain', not an image"),
        (7, "expected a file path, a data URL or bytes, got int"),
    ],
)
def test_refused_sources(tmp_path, value, reason):
    rows = [{"prompt": user({"type": "image_url", "image_url": {"url": value}}, {"type": "text", "text": "hi"}), "label": "1"}]
    with pytest.raises(DataError, match=rf"line 1: field 'prompt\[0\]\.content\[0\]\.image_url'.*{reason}"):
        read_prompt_file(write_rows(tmp_path / "rows.jsonl", rows), FIELDS)


def test_placeholders_and_images_must_agree(tmp_path):
    (tmp_path / "a.png").write_bytes(png())
    too_many = [{"prompt": user({"type": "image"}, {"type": "text", "text": "x"}), "images": ["a.png", "a.png"], "label": "1"}]
    with pytest.raises(DataError, match=r"line 1: field 'images': 2 images but the messages have 1 bare"):
        read_prompt_file(write_rows(tmp_path / "many.jsonl", too_many), FIELDS)
    too_few = [{"prompt": user({"type": "image"}, {"type": "image"}), "images": ["a.png"], "label": "1"}]
    with pytest.raises(DataError, match=r"field 'prompt\[0\]\.content\[1\]': an image part without an image"):
        read_prompt_file(write_rows(tmp_path / "few.jsonl", too_few), FIELDS)
    unknown = [{"prompt": user({"type": "audio"}), "label": "1"}]
    with pytest.raises(DataError, match=r"content part of type text, image or image_url"):
        read_prompt_file(write_rows(tmp_path / "audio.jsonl", unknown), FIELDS)


def test_store_saves_each_image_once_and_checks_hashes_on_load(tmp_path):
    store = ImageStore()
    a, b = decode_image(png(color=1)), decode_image(png(color=2))
    refs = [store.put(a), store.put(b), store.put(decode_image(png(color=1)))]
    assert refs[0] == refs[2] != refs[1] and len(store) == 2
    assert store.save(tmp_path / "images") == 2 and store.save(tmp_path / "images") == 0
    again = ImageStore()
    assert again.load(tmp_path / "images") == 2 and refs[1] in again
    assert again.get(refs[1]).tobytes() == b.tobytes()
    victim = tmp_path / "images" / f"{refs[0].removeprefix('sha256:')}.png"
    victim.write_bytes(png(color=3))
    with pytest.raises(ImageError, match="hashes to sha256:.*not its name"):
        ImageStore().load(tmp_path / "images")
