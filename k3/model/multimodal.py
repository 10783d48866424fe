"""K3ForConditionalGeneration: the vision encoder beside the text model, images spliced into the
token stream (DESIGN §7; docs/VISION.md).

Legend: B batch, T tokens, D text width, L packed patches, M merged image rows, P patch size.
The module tree is the published checkpoint's (`vision_tower.*`, `mm_projector.*`,
`language_model.*` of moonshotai/Kimi-K3's `KimiK3ForConditionalGeneration`), so the official
names are our state-dict names (k3/checkpoint/multimodal.py reads and writes them).

Placeholders: every image or video contributes `placeholder_count` rows, and the prompt carries that
many `media_placeholder_token_id` tokens for it, consecutively, images in order (the form vLLM's
and transformers' Kimi ports feed the model: the processor expands each image's placeholder). The
image rows replace those tokens' embeddings one for one, so positions, packing (`cu_seqlens`),
padding and the cache work exactly as for text.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from k3.config import ConfigError, K3Config
from k3.model.pretrained import Pretrained
from k3.model.transformer import K3ForCausalLM
from k3.model.vision.config import VisionConfig
from k3.model.vision.projector import PatchMergerMLPV2
from k3.model.vision.tower import MoonViT

# The official KimiK3Config's default for an absent `media_placeholder_token_id` (K3's tokenizer id).
MEDIA_PLACEHOLDER_TOKEN_ID = 163605


def placeholder_count(grid_thw, merge_kernel_size=(2, 2)) -> int:
    """Placeholder tokens (= merged rows) of one image or video clip with patch grid (t, h, w):
    `sd2_tpool` mean-pools the t frames, then each kh x kw window is one row: (h/kh) * (w/kw)."""
    t, h, w = (int(v) for v in grid_thw)
    kh, kw = merge_kernel_size
    if t < 1 or h % kh or w % kw:
        raise ValueError(f"patch grid {(t, h, w)} does not tile into {kh} x {kw} merge windows")
    return (h // kh) * (w // kw)


@dataclass
class K3MultimodalConfig:
    """The text config (K3Config, as the text loader reads it), the vision config (VisionConfig) and
    the placeholder id, from one published `kimi_k3` config.json dict, written back losslessly."""
    text_config: K3Config
    vision_config: VisionConfig
    media_placeholder_token_id: int = MEDIA_PLACEHOLDER_TOKEN_ID
    # the top-level keys read, in order (written back in that order)
    _read_keys: tuple[str, ...] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.text_config.wrapper_model_type != "kimi_k3":
            raise ConfigError("K3MultimodalConfig.text_config: the text config must be a kimi_k3 one "
                              f"(checkpoint prefix 'language_model.'), got model_type {self.text_config.wrapper_model_type!r}")
        if self.vision_config.text_hidden_size != self.text_config.hidden_size:
            raise ConfigError(f"VisionConfig.text_hidden_size: the projector must output the text width "
                              f"{self.text_config.hidden_size}, got {self.vision_config.text_hidden_size}")
        token = self.media_placeholder_token_id
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ConfigError(f"K3MultimodalConfig.media_placeholder_token_id: must be an integer >= 0, got {token!r}")

    @classmethod
    def from_dict(cls, d: dict) -> K3MultimodalConfig:
        """From a published config.json dict (`model_type` kimi_k3, `text_config`, `vision_config`)."""
        if not isinstance(d.get("vision_config"), dict):
            raise ConfigError("K3MultimodalConfig.vision_config: the config has no vision_config object "
                              "(a text-only config: build K3ForCausalLM)")
        return cls(K3Config.from_dict(d), VisionConfig.from_dict(d["vision_config"]),
                   d.get("media_placeholder_token_id", MEDIA_PLACEHOLDER_TOKEN_ID), _read_keys=tuple(d))

    @classmethod
    def from_text_config(cls, text_config: K3Config) -> K3MultimodalConfig:
        """From a K3Config read from a multimodal config.json (its wrapper keys carry the rest)."""
        d = text_config.to_dict()
        if not isinstance(d.get("vision_config"), dict):
            raise ConfigError("K3MultimodalConfig.vision_config: the config has no vision_config object "
                              "(a text-only config: build K3ForCausalLM)")
        return cls(text_config, VisionConfig.from_dict(d["vision_config"]),
                   d.get("media_placeholder_token_id", MEDIA_PLACEHOLDER_TOKEN_ID))

    def to_dict(self) -> dict:
        """The config.json dict: the text config's (wrapper keys in their published order) with this
        vision_config and placeholder id; an absent placeholder id stays absent while it is the default."""
        out = self.text_config.to_dict()
        out["vision_config"] = self.vision_config.to_dict()
        if "media_placeholder_token_id" in out or self.media_placeholder_token_id != MEDIA_PLACEHOLDER_TOKEN_ID:
            out["media_placeholder_token_id"] = self.media_placeholder_token_id
        order = [k for k in self._read_keys or () if k in out]
        return copy.deepcopy({k: out[k] for k in order + [k for k in out if k not in order]})


def vision_config_of(text_config: K3Config) -> VisionConfig | None:
    """The vision_config a (multimodal) config.json carried beside its text config, or None."""
    d = text_config.to_dict()
    return VisionConfig.from_dict(d["vision_config"]) if isinstance(d.get("vision_config"), dict) else None


class K3ForConditionalGeneration(Pretrained, nn.Module):
    """vision_tower (MoonViT) + mm_projector (patchmergerv2) + language_model (K3ForCausalLM);
    `from_pretrained` / `save_pretrained` on the official three-prefix layout (k3/checkpoint/multimodal.py)."""

    def __init__(self, config: K3MultimodalConfig):
        super().__init__()
        self.config = config
        self.vision_tower = MoonViT(config.vision_config)
        self.mm_projector = PatchMergerMLPV2(config.vision_config)
        self.language_model = K3ForCausalLM(config.text_config)

    def placeholder_counts(self, grid_thws: torch.Tensor) -> list[int]:
        """Placeholder tokens each image or clip of `grid_thws` [N, 3] needs, in order."""
        if grid_thws.dim() != 2 or grid_thws.shape[1] != 3:
            raise ValueError(f"grid_thws must be [N, 3] (t, h, w), got {tuple(grid_thws.shape)}")
        return [placeholder_count(g, self.config.vision_config.merge_kernel_size) for g in grid_thws.tolist()]

    def image_features(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        """pixel_values [L, 3, P, P], grid_thws [N, 3] -> [M, D], images in order."""
        # the official model casts pixels to the tower's dtype before the patch convolution
        pixel_values = pixel_values.to(self.vision_tower.patch_embed.proj.weight.dtype)
        return self.mm_projector(self.vision_tower(pixel_values, grid_thws))

    def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
              grid_thws: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> inputs_embeds [B, T, D]: the LM's token embeddings, with the image
        rows written over the placeholder positions in order (row-major over [B, T]). `positions`:
        those positions along the flattened [B * T], found and checked by the caller on the host
        (a captured step: the rows are then copied by index, since masked_scatter's backward reads
        the device, and the placeholder count is not read back)."""
        token = self.config.media_placeholder_token_id
        mask = self._placeholders(input_ids, pixel_values, grid_thws) if positions is None else input_ids == token
        embed_tokens = self.language_model.model.embed_tokens
        if pixel_values is None:
            return embed_tokens(input_ids)
        features = self.image_features(pixel_values, grid_thws)
        # the placeholder id need not be a row of the table (tiny vocabularies): embed id 0 there, overwritten
        embeds = embed_tokens(input_ids.masked_fill(mask, 0))
        if positions is not None:
            flat = embeds.flatten(0, 1).index_copy(0, positions, features.to(embeds.dtype))
            return flat.view_as(embeds)
        return embeds.masked_scatter(mask.unsqueeze(-1), features.to(embeds.dtype))

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                grid_thws: torch.Tensor | None = None, **text_kwargs) -> torch.Tensor:
        """input_ids [B, T] (+ packed images) -> logits [B, T, V] in fp32. `text_kwargs` are
        K3ForCausalLM.forward's (cu_seqlens, cache, attention_mask, logits_to_keep, hidden_out).
        Without pixel_values the tower never runs and the call is the text model's own."""
        if pixel_values is None:
            self._placeholders(input_ids, pixel_values, grid_thws)
            return self.language_model(input_ids, **text_kwargs)
        return self.language_model(inputs_embeds=self.embed(input_ids, pixel_values, grid_thws), **text_kwargs)

    def _placeholders(self, input_ids, pixel_values, grid_thws) -> torch.Tensor:
        """The placeholder mask [B, T], after checking it against the images (before the tower runs)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        if (pixel_values is None) != (grid_thws is None):
            raise ValueError("pass pixel_values and grid_thws together (patches and their grids), or neither")
        token = self.config.media_placeholder_token_id
        mask = input_ids == token
        n = int(mask.sum())
        counts = [] if grid_thws is None else self.placeholder_counts(grid_thws)
        if n != sum(counts):
            raise ValueError(f"input_ids has {n} image placeholder tokens (id {token}), the {len(counts)} images "
                             f"give {sum(counts)} rows ({counts} per image): each image needs as many placeholders "
                             f"as it has merged rows")
        return mask
