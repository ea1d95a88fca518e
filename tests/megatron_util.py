"""Helpers of the Megatron tests (tests/train/test_megatron.py, also imported in its child process):
small HF configs of each layout (dense, MoE, biased) and a random native model of one."""

from __future__ import annotations

import torch

from noria.models.config import ModelArgs
from noria.models.decoder import DecoderLM

DENSE = {"model_type": "qwen2", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}  # fmt: skip
MOE = {"model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
       "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
       "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [1], "tie_word_embeddings": False}  # fmt: skip
BIASED = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True}  # fmt: skip


def random_native(config: dict, seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    lm = DecoderLM(ModelArgs.from_hf_config(config), hf_config=config)
    with torch.no_grad():
        for p in lm.parameters():
            p.normal_()
    return lm
