"""``noria.models.load_tokenizer``: the ``TokenizersBackend`` folders of the native families load that
class directly, give what ``AutoTokenizer`` gives, and skip the model-config import chain; other
folders still go through ``AutoTokenizer``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from noria.models import TOKENIZERS_BACKEND_FAMILIES, _tokenizers_backend, load_tokenizer
from noria.models.config import NATIVE_FAMILIES

CHAT = [{"role": "user", "content": "What is 12 + 7? Put the answer in \\boxed{}."}]


def test_the_direct_families_are_native_ones_whose_hub_tokenizer_class_transformers_keeps():
    from transformers.models.auto.tokenization_auto import MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS

    assert set(TOKENIZERS_BACKEND_FAMILIES) <= set(NATIVE_FAMILIES)
    assert not set(TOKENIZERS_BACKEND_FAMILIES) & MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS


def _same_as_auto(folder) -> None:
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(auto)
    assert ours.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == auto.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=False
    )
    text = "12 + 7 = 19, so \\boxed{19}<|im_end|>"
    assert ours(text)["input_ids"] == auto(text)["input_ids"]
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id) == (auto.eos_token_id, auto.pad_token_id, auto.bos_token_id)


def test_the_tiny_model_loads_directly_as_auto_would(tiny_model_dir):
    assert _tokenizers_backend(tiny_model_dir)
    _same_as_auto(tiny_model_dir)


def test_smollm2_loads_directly_as_auto_would(smollm2_dir):
    assert _tokenizers_backend(smollm2_dir)
    _same_as_auto(smollm2_dir)


def test_other_folders_go_through_auto_tokenizer(tiny_model_dir, tmp_path):
    for name, edit in (("class", {"tokenizer_class": "PreTrainedTokenizerFast"}), ("remote", {"auto_map": {"AutoTokenizer": ["x.Y", None]}})):
        folder = tmp_path / name
        shutil.copytree(tiny_model_dir, folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, **edit}))
        assert not _tokenizers_backend(folder), name
    for model_type in ("gpt2", "qwen2"):  # not native; native, but AutoTokenizer makes it a Qwen2Tokenizer
        folder = tmp_path / model_type
        shutil.copytree(tiny_model_dir, folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
        assert not _tokenizers_backend(folder), model_type
    assert load_tokenizer(tmp_path / "class").eos_token == "<|im_end|>"  # through AutoTokenizer, still loaded


def test_loading_the_tokenizer_imports_no_model_config(tiny_model_dir):
    """The import chain ``AutoConfig`` starts (a model config, transformers' kernel hub, weight
    conversions) stays out of a process that only needs the tokenizer."""
    code = (
        "import sys; from noria.models import load_tokenizer; load_tokenizer(sys.argv[1]); "
        "print(sorted(m for m in sys.modules if m.startswith(('transformers.models.llama', 'transformers.integrations.hub_kernels'))))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tiny_model_dir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
