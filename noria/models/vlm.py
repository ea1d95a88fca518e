"""The native vision-language family: Idefics3 (SmolVLM), images in front of the native decoder.

Layout (transformers' ``Idefics3ForConditionalGeneration``, same parameter names)::

    pixel_values [N, 3, S, S] -> model.vision_model (SigLIP-style ViT: patches of P pixels, (S/P)^2 tokens)
                              -> model.connector: pixel shuffle (r x r neighbours into one token: (S/P)^2 / r^2
                                 tokens of width r^2 * D_vision) -> modality_projection.proj (no bias)
                              -> image embeddings [N, image_seq_len, H]
    input_ids [B, T] -> model.text_model.embed_tokens, the rows at ``image_token_id`` replaced by the
                        image embeddings in order -> the native decoder's layers and norm -> lm_head

Why Idefics3: its language model is a plain LLaMA (SmolVLM pairs with SmolLM2) with 1-D RoPE over
token positions, so an image is just a run of ``image_seq_len`` placeholder tokens with ordinary
positions: the engine's paged decoder, its positions, the prefix cache and the trainer's packing stay
as they are, and only the embedding rows of the placeholders change. (Qwen2.5-VL's M-RoPE gives
image tokens 3-D positions, which every position path would have to carry.)

The text part is the native decoder (:class:`~noria.models.decoder.DecoderModel`, with its fast and
exact paths); the connector's projection is a native ``Linear`` (so exact numerics switch it too).
The vision tower is transformers' ``Idefics3VisionTransformer``: it runs once per image at prefill
(never per decoded token, never over the paged KV cache), so a native copy would gain no engine
speed and would only re-implement NaViT's bucketed position ids; using transformers' module keeps
its numerics equal to transformers' by construction. In exact mode it runs as it is (one image at a
time, the same shapes in engine and trainer), not through the row-chunked linears.

Images without splitting: one image is one tile of ``vision_config.image_size`` pixels a side
(the image processor's ``do_image_splitting`` off), i.e. ``image_seq_len`` placeholder tokens
framed as ``<fake_token_around_image><global-img><image>*image_seq_len<fake_token_around_image>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from noria.models.config import VISION_FAMILIES, ModelArgs, UnsupportedModel
from noria.models.decoder import DecoderLM, DecoderModel, Linear


@dataclass(frozen=True)
class VisionArgs:
    """The image side of an Idefics3 config (HF ``vision_config``, ``scale_factor``, ``image_token_id``)."""

    image_token_id: int
    """The placeholder token whose embedding rows receive image embeddings."""
    image_size: int
    """Pixels per side of the one tile an image becomes."""
    patch_size: int
    """Pixels per side of one vision patch."""
    scale_factor: int
    """Pixel-shuffle factor: r x r neighbouring patches become one LM token."""

    @property
    def image_seq_len(self) -> int:
        """Placeholder tokens per image: ``(image_size / patch_size)^2 / scale_factor^2``."""
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor**2

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> VisionArgs:
        vision = cfg.get("vision_config") or {}
        args = VisionArgs(
            image_token_id=int(cfg.get("image_token_id", 128257)),
            image_size=int(vision.get("image_size", 224)),
            patch_size=int(vision.get("patch_size", 32)),
            scale_factor=int(cfg.get("scale_factor", 2)),
        )
        side = args.image_size // args.patch_size
        if args.image_size % args.patch_size or side % args.scale_factor:
            raise UnsupportedModel(
                f"config: vision_config.image_size {args.image_size} / patch_size {args.patch_size} must be a whole "
                f"number of patches divisible by scale_factor {args.scale_factor}"
            )
        return args


class _Projection(nn.Module):
    """HF ``Idefics3SimpleMLP``: one linear map, no bias."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.proj = Linear(in_dim, out_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Connector(nn.Module):
    """Pixel shuffle then the modality projection (HF ``Idefics3Connector``)."""

    def __init__(self, vision_dim: int, text_dim: int, scale_factor: int) -> None:
        super().__init__()
        self.scale_factor = scale_factor
        self.modality_projection = _Projection(vision_dim * scale_factor**2, text_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection(pixel_shuffle(x, self.scale_factor))


def pixel_shuffle(x: torch.Tensor, r: int) -> torch.Tensor:
    """[N, s*s, D] -> [N, s*s / r^2, D * r^2]: each r x r block of the s x s patch grid becomes one
    token (transformers' order of the concatenated features)."""
    n, seq, dim = x.shape
    side = int(seq**0.5)
    x = x.view(n, side, side // r, dim * r).permute(0, 2, 1, 3)
    x = x.reshape(n, side // r, side // r, dim * r * r).permute(0, 2, 1, 3)
    return x.reshape(n, seq // (r * r), dim * r * r)


class VisionBody(nn.Module):
    """HF ``Idefics3Model``: ``vision_model``, ``connector`` and ``text_model``. ``embed_tokens``,
    ``layers``, ``norm`` and ``args`` are the text model's, so code written for
    :class:`~noria.models.decoder.DecoderModel` (the engine's fast paths, FP8, quantization) runs it."""

    def __init__(self, args: ModelArgs, hf_config: dict[str, Any], vision: VisionArgs) -> None:
        super().__init__()
        from transformers import Idefics3VisionConfig
        from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer

        vision_config = Idefics3VisionConfig(**(hf_config.get("vision_config") or {}))
        vision_config._attn_implementation = "sdpa"
        self.vision_model = Idefics3VisionTransformer(vision_config)
        self.connector = Connector(vision_config.hidden_size, args.hidden_size, vision.scale_factor)
        self.text_model = DecoderModel(args)

    @property
    def args(self) -> ModelArgs:
        return self.text_model.args

    @property
    def embed_tokens(self) -> nn.Module:
        return self.text_model.embed_tokens

    @property
    def layers(self) -> nn.ModuleList:
        return self.text_model.layers

    @property
    def norm(self) -> nn.Module:
        return self.text_model.norm

    def forward(self, input_ids, positions=None, attn=None, routing=None, inputs_embeds=None) -> torch.Tensor:
        return self.text_model(input_ids, positions, attn, routing, inputs_embeds)


class VisionLM(DecoderLM):
    """Idefics3 with the native decoder; see the module docstring. A :class:`DecoderLM` for every
    text-only use (the engine, the trainer, checkpoints); images enter as ``pixel_values`` (or as
    ready embeddings, ``inputs_embeds``)."""

    exact_dtype: torch.dtype | None = None
    """Exact mode (``set_exact_numerics``, which sets it): the vision tower computes in this dtype from
    casts of its parameters, one image at a time, as the engine runs it (fp32 masters or not)."""

    def __init__(self, args: ModelArgs, hf_config: dict | None = None) -> None:
        nn.Module.__init__(self)
        if not hf_config or hf_config.get("model_type") not in VISION_FAMILIES:
            raise ValueError("VisionLM needs the Idefics3 config.json dict (hf_config) it is built from")
        self.args = args
        self.hf_config = dict(hf_config)
        self.vision = VisionArgs.from_hf_config(hf_config)
        self.model = VisionBody(args, self.hf_config, self.vision)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()

    def image_features(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Image embeddings [N, image_seq_len, H] in the model's dtype for images [N, 3, S, S]
        (``pixel_attention_mask`` [N, S, S]: 1 on real pixels; default all)."""
        s = self.vision.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, s, s):
            raise ValueError(f"pixel_values must be [N, 3, {s}, {s}], got {tuple(pixel_values.shape)}")
        patch_mask = None
        if pixel_attention_mask is not None:
            p = self.vision.patch_size
            grid = pixel_attention_mask.unfold(1, p, p).unfold(2, p, p)
            patch_mask = grid.sum(dim=(-1, -2)) > 0
        if self.exact_dtype is None:
            return self.model.connector(self._tower(pixel_values, patch_mask))
        # Exact mode: one image per call, so an image's bits never depend on what shares the call.
        return torch.cat([
            self.model.connector(self._tower(pixel_values[i : i + 1], None if patch_mask is None else patch_mask[i : i + 1]))
            for i in range(len(pixel_values))
        ])  # fmt: skip

    def _tower(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor | None) -> torch.Tensor:
        tower = self.model.vision_model
        dtype = self.exact_dtype or tower.embeddings.patch_embedding.weight.dtype
        kwargs = {"pixel_values": pixel_values.to(dtype), "patch_attention_mask": patch_mask}
        if all(p.dtype == dtype for p in tower.parameters()):
            return tower(**kwargs).last_hidden_state
        # Differentiable casts of (fp32 master) parameters: the engine's arithmetic, gradients to the masters.
        params = {name: p.to(dtype) for name, p in tower.named_parameters()}
        return torch.func.functional_call(tower, params, args=(), kwargs=kwargs).last_hidden_state

    def embed(
        self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None, pixel_attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Token embeddings [B, T, H] with the image embeddings of ``pixel_values`` (in order) at the
        ``image_token_id`` rows, as transformers' ``inputs_merger`` does."""
        h = self.model.embed_tokens(input_ids)
        if pixel_values is None:
            return h
        features = self.image_features(pixel_values, pixel_attention_mask).reshape(-1, h.shape[-1])
        mask = input_ids == self.vision.image_token_id
        if int(mask.sum()) != features.shape[0]:
            raise ValueError(
                f"the prompt has {int(mask.sum())} image tokens (id {self.vision.image_token_id}) but "
                f"{pixel_values.shape[0]} image(s) give {features.shape[0]} embeddings "
                f"({self.vision.image_seq_len} each)"
            )
        return h.masked_scatter(mask.unsqueeze(-1), features.to(h.dtype))

    def forward(self, input_ids, positions=None, attn=None, routing=None, inputs_embeds=None, pixel_values=None,
                pixel_attention_mask=None) -> torch.Tensor:  # fmt: skip
        """Logits [B, T, V]; ``pixel_values`` [N, 3, S, S] fill the image tokens in order."""
        return self.lm_head(self.hidden_states(input_ids, positions, attn, routing, inputs_embeds, pixel_values, pixel_attention_mask))

    def hidden_states(self, input_ids, positions=None, attn=None, routing=None, inputs_embeds=None, pixel_values=None,
                      pixel_attention_mask=None) -> torch.Tensor:  # fmt: skip
        """Final normed hidden states [B, T, H] (see :meth:`forward`)."""
        if inputs_embeds is None and pixel_values is not None:
            inputs_embeds = self.embed(input_ids, pixel_values, pixel_attention_mask)
        return self.model(input_ids, positions, attn, routing, inputs_embeds)
