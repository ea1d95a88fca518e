"""The transformers wrapper on architectures with no native implementation (GPT-2, GPT-NeoX)."""

from __future__ import annotations

import pytest
import torch

from noria.models import HFCausalLM, PackedContext, PaddedContext, load_model, save_model

VOCAB = 96


def _tiny(arch: str):
    from transformers import GPT2Config, GPTNeoXConfig

    if arch == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=128,
            bos_token_id=1,
            eos_token_id=2,
        )
    return GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
    )


@pytest.fixture(scope="module", params=["gpt2", "gpt_neox"])
def pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_tiny(request.param))
    hf.save_pretrained(folder)
    return folder, hf.eval(), load_model(folder)


def _ids(batch: int, seq_len: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_load_model_falls_back_to_wrapper(pair):
    _, hf, model = pair
    assert isinstance(model, HFCausalLM)
    ids = _ids(2, 12)
    assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-5
    assert model.lm_head(model.hidden_states(ids)).allclose(model(ids), atol=1e-5)


def test_state_dict_names_are_transformers_names(pair):
    _, hf, model = pair
    assert list(model.state_dict()) == list(hf.state_dict())


@torch.no_grad()
def test_padded_and_packed_contexts(pair):
    _, _, model = pair
    rows = [_ids(1, n, seed=5 + n)[0] for n in (4, 9)]
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, 9 - len(row) :], mask[i, 9 - len(row) :] = row, 1
    padded = model(ids, attn=PaddedContext(mask))
    packed = model(torch.cat(rows)[None], attn=PackedContext([4, 9]))
    for i, row in enumerate(rows):
        alone = model(row[None])[0]
        assert (padded[i, 9 - len(row) :] - alone).abs().max().item() <= 1e-5
        start = 0 if i == 0 else 4
        assert (packed[0, start : start + len(row)] - alone).abs().max().item() <= 1e-5


def test_custom_context_is_refused(pair):
    _, _, model = pair

    class PagedLike:
        def positions(self, batch, seq_len, device):
            return torch.zeros(batch, seq_len, dtype=torch.long)

        def attend(self, layer_idx, q, k, v):
            return q

    with pytest.raises(NotImplementedError, match="PagedLike"):
        model(_ids(1, 3), attn=PagedLike())


@torch.no_grad()
def test_sharded_save_round_trip(pair, tmp_path):
    _, _, model = pair
    out = save_model(model, tmp_path / "ckpt", max_shard_bytes=50_000)
    assert (out / "model.safetensors.index.json").is_file()
    again = load_model(out)
    ids = _ids(1, 7)
    assert torch.equal(again(ids), model(ids))
