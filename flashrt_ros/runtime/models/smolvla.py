"""
SmolVLA (Shukor et al. 2025) as LeRobot 0.4.4 runs it at inference, its prefix KV in the arena.

Written natively with LeRobot's parameter names, so a LeRobot SmolVLA checkpoint folder loads
with ``load_state_dict(strict=True)``; the VLM's config and tokenizer come from the folder
``vlm_model_name`` names (its weights are in the checkpoint). LeRobot's arithmetic, in its order:

  * images: ``resize_with_pad`` (bilinear, the picture in the bottom-right corner, zero padding
    left and top) to ``resize_imgs_with_padding``, then ``x * 2 - 1``; SmolVLM's vision tower
    (patch conv, position embedding by bucketized fractional coordinates, pre-norm encoder with
    tanh-GELU, post layer norm), the connector (pixel shuffle, a linear projection), times
    ``sqrt(hidden)``;
  * the instruction with a newline appended, tokenized as LeRobot's processor does, embedded
    times ``sqrt(hidden)``; the normalized state padded to ``max_state_dim``, projected;
  * the prefix ``[images, language, state]`` through the first ``num_vlm_layers`` text layers
    (RMSNorm, RoPE of wavelength 10000 on ``cumsum(pad) - 1``, float32 eager attention, SiLU
    MLP); the images and language attend to each other, the state to everything;
  * flow matching: ``num_steps`` Euler steps from t = 1 to 0 of the action expert (a narrower
    Llama stack) over noise; its self-attention layers attend to the prefix KV and to the chunk
    causally, its cross-attention layers to the prefix KV through their own k/v projections.

The arena holds the prefix as the expert reads it (``smolvla.prefix_kv``): for a
self-attention layer the VLM's roped K and V, for a cross-attention layer the expert's
projections of them, which LeRobot recomputes at every step and we compute once per prefix.
Its length P is fixed (image tokens, ``tokenizer_max_length``, the state); the tokens sit first
in LeRobot's order, the rest is zero and masked (``smolvla.prefix_mask``). Sampling reads the
arena in place: its self-attention splits the softmax's keys into the arena's and the chunk's
instead of concatenating them, so the prefix is never copied. A zeroed arena has no prefix and
no instruction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import json
import math
import os
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
import torch
from torch import nn
import torch.nn.functional as F

from .lerobot import _features, _IGNORED_FIELDS, _random_like, ACTION, CONFIG_FILE, Feature
from .lerobot import LeRobotConfig, Normalizer, NORMALIZER_EPS, NormalizerStats, OBS_IMAGES
from .lerobot import OBS_STATE, place, POSTPROCESSOR_FILE, PREPROCESSOR_FILE, read_config
from .lerobot import read_normalizers, read_weights, SMOLVLA_PRE_STEPS, WEIGHTS_FILE
from ..errors import ConfigError, InvalidRequestError
from ..state.arena import StateSpec

PREFIX_KV = 'smolvla.prefix_kv'
PREFIX_MASK = 'smolvla.prefix_mask'
INSTRUCTION = 'smolvla.instruction'
INSTRUCTION_LENGTH = 'smolvla.instruction_length'
VLM_PATH_ENV = 'FLASHRT_VLM_PATH'
EMPTY_CAMERA = f'{OBS_IMAGES}.empty_camera_'  # the padding cameras `empty_cameras` adds


@dataclass(frozen=True)
class SmolVLAConfig(LeRobotConfig):
    """LeRobot's SmolVLAConfig: the fields inference reads, LeRobot's defaults."""

    input_features: dict[str, Feature] = field(default_factory=dict)
    output_features: dict[str, Feature] = field(default_factory=dict)
    n_obs_steps: int = 1
    chunk_size: int = 50
    n_action_steps: int = 50
    normalization_mapping: dict[str, str] = field(default_factory=lambda: {
        'VISUAL': 'IDENTITY', 'STATE': 'MEAN_STD', 'ACTION': 'MEAN_STD'})
    max_state_dim: int = 32
    max_action_dim: int = 32
    resize_imgs_with_padding: tuple[int, int] | None = (512, 512)
    empty_cameras: int = 0
    adapt_to_pi_aloha: bool = False
    use_delta_joint_actions_aloha: bool = False
    tokenizer_max_length: int = 48
    num_steps: int = 10
    use_cache: bool = True
    vlm_model_name: str = 'HuggingFaceTB/SmolVLM2-500M-Video-Instruct'
    load_vlm_weights: bool = False
    add_image_special_tokens: bool = False
    attention_mode: str = 'cross_attn'
    prefix_length: int = -1
    pad_language_to: str = 'longest'
    num_expert_layers: int = -1
    num_vlm_layers: int = 16
    self_attn_every_n_layers: int = 2
    expert_width_multiplier: float = 0.75
    min_period: float = 4e-3
    max_period: float = 4.0
    # training, compilation and real-time chunking: accepted, unused at select_action
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def camera_features(self) -> dict[str, Feature]:
        """Return the images an observation carries (the empty cameras are LeRobot's padding)."""
        return {k: f for k, f in self.image_features.items() if not k.startswith(EMPTY_CAMERA)}

    @property
    def state_dim(self) -> int:
        return self.input_features[OBS_STATE].shape[0]

    @classmethod
    def from_json(cls, d: Any, source: str = CONFIG_FILE) -> 'SmolVLAConfig':
        """Validate a SmolVLA config.json mapping; the ConfigError names the first bad field."""
        def bad(name: str, message: str) -> ConfigError:
            return ConfigError(f'{source}: field {name!r} {message}')

        if not isinstance(d, dict) or d.get('type') != 'smolvla':
            got = d.get('type') if isinstance(d, dict) else d
            raise bad('type', f"must be 'smolvla', got {got!r}")
        values: dict[str, Any] = {'extra': {}}
        for name, value in d.items():
            if name in ('input_features', 'output_features'):
                values[name] = _features(value, name, bad)
            elif name in _FIELD_TYPES:
                kind = _FIELD_TYPES[name]
                if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
                    raise bad(name, f'has the wrong type: {value!r}')
                values[name] = tuple(value) if isinstance(value, list) else value
            elif name != 'type' and name not in _IGNORED_FIELDS:
                values['extra'][name] = value
        config = cls(**values)
        config._check(bad)
        return config

    def _check(self, bad) -> None:
        """Check LeRobot's rules and what is implemented here (the rest is refused by name)."""
        self._check_shared(bad)
        if not self.camera_features:
            raise bad('input_features', 'needs at least one image')
        state = self.input_features.get(OBS_STATE)
        if state is None or state.kind != 'STATE' or len(state.shape) != 1:
            raise bad('input_features', f'needs {OBS_STATE!r} of type STATE and shape [dim]')
        if self.state_dim > self.max_state_dim:
            raise bad('max_state_dim', f'must be >= the state width {self.state_dim}')
        if self.action_dim > self.max_action_dim:
            raise bad('max_action_dim', f'must be >= the action width {self.action_dim}')
        for name in ('num_steps', 'tokenizer_max_length', 'num_vlm_layers'):
            if getattr(self, name) < 1:
                raise bad(name, f'must be >= 1, got {getattr(self, name)}')
        if self.adapt_to_pi_aloha or self.use_delta_joint_actions_aloha:
            raise bad('adapt_to_pi_aloha', 'and use_delta_joint_actions_aloha must be false '
                      '(the Aloha conversions are not implemented here)')
        if self.add_image_special_tokens:
            raise bad('add_image_special_tokens', 'must be false (not implemented here)')
        if self.attention_mode not in ('cross_attn', 'self_attn'):
            raise bad('attention_mode', f"must be 'cross_attn' or 'self_attn', got "
                      f'{self.attention_mode!r}')
        size = self.resize_imgs_with_padding
        if size is not None and (len(size) != 2 or min(size) < 1):
            raise bad('resize_imgs_with_padding', f'must be [width, height], got {size!r}')

    def to_json(self) -> dict[str, Any]:
        """Return the config.json LeRobot 0.4.4 writes for it."""
        d = self._json('smolvla')
        d.update(d.pop('extra'))
        return d


_FIELD_TYPES = {'n_obs_steps': int, 'chunk_size': int, 'n_action_steps': int,
                'normalization_mapping': dict, 'max_state_dim': int, 'max_action_dim': int,
                'resize_imgs_with_padding': (list, tuple, type(None)), 'empty_cameras': int,
                'adapt_to_pi_aloha': bool, 'use_delta_joint_actions_aloha': bool,
                'tokenizer_max_length': int, 'num_steps': int, 'use_cache': bool,
                'vlm_model_name': str, 'load_vlm_weights': bool, 'add_image_special_tokens': bool,
                'attention_mode': str, 'prefix_length': int, 'pad_language_to': str,
                'num_expert_layers': int, 'num_vlm_layers': int, 'self_attn_every_n_layers': int,
                'expert_width_multiplier': (int, float), 'min_period': (int, float),
                'max_period': (int, float)}


def expert_intermediate_size(hidden: int, multiplier: int = 4, multiple_of: int = 256) -> int:
    """Return the expert MLP's width as LeRobot's get_intermediate_size does."""
    hidden = int(multiplier * int(2 * hidden / 3))
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _module(**children: nn.Module) -> nn.Module:
    """Return a container whose only job is to give its children LeRobot's parameter names."""
    m = nn.Module()
    for name, child in children.items():
        m.add_module(name, child)
    return m


class RMSNorm(nn.Module):
    """LlamaRMSNorm: normalized in float32, scaled in the input's dtype."""

    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class DecoderLayer(nn.Module):
    """A Llama decoder layer's parameters (LeRobot runs the attention itself, see forward)."""

    def __init__(self, text, hidden: int, intermediate: int, kv_in: int | None = None):
        super().__init__()
        heads, kv_heads, head_dim = (text.num_attention_heads, text.num_key_value_heads,
                                     text.head_dim)
        bias, mlp_bias = getattr(text, 'attention_bias', False), getattr(text, 'mlp_bias', False)
        if text.hidden_act != 'silu':
            raise ConfigError(f'text_config.hidden_act must be silu, got {text.hidden_act!r}')
        kv_in = hidden if kv_in is None else kv_in  # a cross-attention expert layer reads VLM K/V
        self.input_layernorm = RMSNorm(hidden, text.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, text.rms_norm_eps)
        self.self_attn = _module(q_proj=nn.Linear(hidden, heads * head_dim, bias=bias),
                                 k_proj=nn.Linear(kv_in, kv_heads * head_dim, bias=bias),
                                 v_proj=nn.Linear(kv_in, kv_heads * head_dim, bias=bias),
                                 o_proj=nn.Linear(heads * head_dim, hidden, bias=bias))
        self.mlp = _module(gate_proj=nn.Linear(hidden, intermediate, bias=mlp_bias),
                           up_proj=nn.Linear(hidden, intermediate, bias=mlp_bias),
                           down_proj=nn.Linear(intermediate, hidden, bias=mlp_bias))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return mlp(post_attention_layernorm(x)) + x: LeRobot's second residual."""
        m = self.mlp
        h = self.post_attention_layernorm(x)
        h = m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))
        return h + x


def rope_tables(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return apply_rope's angles (wavelength 10000) for positions [L]: cos, sin [L, 1, D/2]."""
    half = head_dim // 2
    exponents = (2.0 / head_dim) * torch.arange(half, dtype=torch.float32,
                                                device=positions.device)
    radians = positions[:, None].to(torch.float32) / (10_000 ** exponents)[None, :]  # [L, D/2]
    radians = radians[:, None, :]
    return radians.cos(), radians.sin()


def rope(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate the halves of x [L, H, D] in float32 (LeRobot's apply_rope)."""
    cos, sin = tables
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
           mask: torch.Tensor, head_dim: int) -> torch.Tensor:
    """
    Attend as LeRobot's eager attention: q [L, H, D], key/value blocks [KVH, S_i, D].

    mask [L, sum S_i]. The query heads sharing a key head are stacked (h = kv_head * groups
    + g, as LeRobot's expand), so no key is repeated; each block is used where it lies, so
    the arena's prefix is never copied. Returns [L, H * D].
    """
    L, H, D = q.shape
    kvh = keys[0].shape[0]
    q = q.float().transpose(0, 1).reshape(kvh, H // kvh * L, D)  # [KVH, G*L, D]
    scores = torch.cat([torch.bmm(q, k.float().transpose(1, 2)) for k in keys], -1)
    scores *= head_dim ** -0.5  # [KVH, G*L, S]
    scores.masked_fill_(~mask.repeat(H // kvh, 1), torch.finfo(scores.dtype).min)
    probs = scores.softmax(-1).to(values[0].dtype)
    out = None
    for p, v in zip(probs.split([v.shape[1] for v in values], -1), values):
        out = torch.bmm(p, v) if out is None else out + torch.bmm(p, v)  # [KVH, G*L, D]
    return out.view(H, L, D).transpose(0, 1).reshape(L, H * D)


class VisionTower(nn.Module):
    """SmolVLM's vision transformer (SigLIP with NaViT position buckets), LeRobot's names."""

    def __init__(self, v):
        super().__init__()
        d = v.hidden_size
        self.patch_size, self.heads, eps = v.patch_size, v.num_attention_heads, v.layer_norm_eps
        self.per_side = v.image_size // v.patch_size
        if v.hidden_act != 'gelu_pytorch_tanh':
            raise ConfigError(f'vision_config.hidden_act must be gelu_pytorch_tanh, got '
                              f'{v.hidden_act!r}')
        self.embeddings = _module(
            patch_embedding=nn.Conv2d(v.num_channels, d, v.patch_size, v.patch_size),
            position_embedding=nn.Embedding(self.per_side ** 2, d))
        layers = [_module(layer_norm1=nn.LayerNorm(d, eps=eps),
                          self_attn=_module(**{n: nn.Linear(d, d) for n in
                                               ('k_proj', 'v_proj', 'q_proj', 'out_proj')}),
                          layer_norm2=nn.LayerNorm(d, eps=eps),
                          mlp=_module(fc1=nn.Linear(d, v.intermediate_size),
                                      fc2=nn.Linear(v.intermediate_size, d)))
                  for _ in range(v.num_hidden_layers)]
        self.encoder = _module(layers=nn.ModuleList(layers))
        self.post_layernorm = nn.LayerNorm(d, eps=eps)

    def position_ids(self, h: int, w: int, device: torch.device) -> torch.Tensor:
        """Bucketized fractional patch coordinates (the identity at the trained size)."""
        boundaries = torch.arange(1 / self.per_side, 1.0, 1 / self.per_side, device=device)
        rows = torch.arange(h, device=device, dtype=torch.float32) / h * (1 - 1e-6)
        cols = torch.arange(w, device=device, dtype=torch.float32) / w * (1 - 1e-6)
        rows = torch.bucketize(rows, boundaries, right=True)
        cols = torch.bucketize(cols, boundaries, right=True)
        return (rows[:, None] * self.per_side + cols).flatten()  # [h*w]

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[1, 3, H, W] in [-1, 1] -> [1, patches, d]."""
        e = self.embeddings
        x = e.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [1, N, d]
        h, w = pixels.shape[2] // self.patch_size, pixels.shape[3] // self.patch_size
        x = x + e.position_embedding(self.position_ids(h, w, x.device))
        # transformers passes a zero additive mask (all patches valid); adding 0 changes nothing
        mask = torch.zeros(1, 1, x.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
        B, N, d = x.shape
        for layer in self.encoder.layers:
            a = layer.self_attn
            y = layer.layer_norm1(x)
            q, k, v = (p(y).view(B, N, self.heads, -1).transpose(1, 2)
                       for p in (a.q_proj, a.k_proj, a.v_proj))  # [1, heads, N, d/heads]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                               scale=(d // self.heads) ** -0.5)
            x = x + a.out_proj(y.transpose(1, 2).reshape(B, N, d))
            y = layer.mlp.fc2(F.gelu(layer.mlp.fc1(layer.layer_norm2(x)), approximate='tanh'))
            x = x + y
        return self.post_layernorm(x)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """Shuffle as SmolVLM's connector: [B, N, d] -> [B, N / scale^2, d * scale^2]."""
    B, N, d = x.shape
    side = int(N ** 0.5)
    x = x.view(B, side, side // scale, d * scale).permute(0, 2, 1, 3)
    x = x.reshape(B, side // scale, side // scale, d * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(B, N // (scale * scale), d * scale * scale)


def resize_with_pad(img: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """Resize keeping the aspect ratio, then pad with 0 on the left and the top (LeRobot's)."""
    h, w = img.shape[2:]
    ratio = max(w / width, h / height)
    rh, rw = int(h / ratio), int(w / ratio)
    img = F.interpolate(img, size=(rh, rw), mode='bilinear', align_corners=False)
    return F.pad(img, (max(0, int(width - rw)), 0, max(0, int(height - rh)), 0), value=0)


def sinusoidal_time(t: float, dim: int, min_period: float, max_period: float) -> torch.Tensor:
    """Return create_sinusoidal_pos_embedding of one time (float64 on CPU) as [dim]."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64)
    period = min_period * (max_period / min_period) ** fraction
    x = (1.0 / period * 2 * math.pi)[None, :] * torch.tensor([t], dtype=torch.float32)[:, None]
    return torch.cat([x.sin(), x.cos()], dim=1)[0]


class VLAFlowMatching(nn.Module):
    """LeRobot's VLAFlowMatching: the SmolVLM prefix, the action expert, the flow head."""

    def __init__(self, c: SmolVLAConfig, vlm_config):
        super().__init__()
        text, vision = vlm_config.text_config, vlm_config.vision_config
        n_vlm = min(c.num_vlm_layers, text.num_hidden_layers)
        d, e = text.hidden_size, int(text.hidden_size * c.expert_width_multiplier)
        n_expert = c.num_expert_layers if c.num_expert_layers > 0 else n_vlm
        if n_vlm % n_expert:
            raise ConfigError(f'num_expert_layers ({n_expert}) must divide num_vlm_layers '
                              f'({n_vlm})')
        self.every = n_vlm // n_expert  # VLM layer i has expert layer i / every when it divides
        cross = 'cross' in c.attention_mode
        self.self_attn = [not cross or (c.self_attn_every_n_layers > 0
                                        and i % c.self_attn_every_n_layers == 0)
                          for i in range(n_vlm)]
        for i in range(n_vlm):
            if self.self_attn[i] and i % self.every:  # LeRobot fails there (nothing to attend)
                raise ConfigError(f'VLM layer {i} is a self-attention layer without an expert '
                                  'layer: LeRobot cannot run this num_expert_layers / '
                                  'self_attn_every_n_layers pair')
        # LeRobot gives expert layer j cross k/v projections by j, runs VLM layer j * every by
        # its own index: they must agree
        cross_params = [cross and not (c.self_attn_every_n_layers > 0
                                       and j % c.self_attn_every_n_layers == 0)
                        for j in range(n_expert)]
        for j in range(n_expert):
            if cross_params[j] == self.self_attn[j * self.every]:
                raise ConfigError(f'expert layer {j} has {"cross" if cross_params[j] else "self"}'
                                  f'-attention projections but runs VLM layer {j * self.every}: '
                                  'LeRobot cannot run this num_expert_layers / '
                                  'self_attn_every_n_layers pair')
        kv = text.num_key_value_heads * text.head_dim
        text_layers = [DecoderLayer(text, d, text.intermediate_size) for _ in range(n_vlm)]
        expert_layers = [DecoderLayer(text, e, expert_intermediate_size(e),
                                      kv if cross_params[j] else None)
                         for j in range(n_expert)]
        text_model = _module(embed_tokens=nn.Embedding(text.vocab_size, d),
                             layers=nn.ModuleList(text_layers), norm=RMSNorm(d, text.rms_norm_eps))
        connector = _module(modality_projection=_module(proj=nn.Linear(
            vision.hidden_size * vlm_config.scale_factor ** 2, d, bias=False)))
        vlm = _module(model=_module(vision_model=VisionTower(vision), connector=connector,
                                    text_model=text_model),
                      lm_head=nn.Linear(d, text.vocab_size, bias=False))
        self.vlm_with_expert = _module(vlm=vlm, lm_expert=_module(
            layers=nn.ModuleList(expert_layers), norm=RMSNorm(e, text.rms_norm_eps)))
        self.state_proj = nn.Linear(c.max_state_dim, d)
        self.action_in_proj = nn.Linear(c.max_action_dim, e)
        self.action_out_proj = nn.Linear(e, c.max_action_dim)
        self.action_time_mlp_in = nn.Linear(2 * e, e)
        self.action_time_mlp_out = nn.Linear(e, e)
        self.scale_factor, self.head_dim = vlm_config.scale_factor, text.head_dim
        self.heads, self.kv_heads = text.num_attention_heads, text.num_key_value_heads
        # the layers whose prefix the expert reads: those with an expert layer
        self.read = [i for i in range(n_vlm) if i % self.every == 0]
        self.image_tokens = (vision.image_size // vision.patch_size) ** 2 // (
            vlm_config.scale_factor ** 2)
        self.dt = -1.0 / c.num_steps
        times = [sinusoidal_time(1.0 + s * self.dt, e, c.min_period, c.max_period)
                 for s in range(c.num_steps)]
        self.register_buffer('time_emb', torch.stack(times).float(), persistent=False)

    def embed_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """[1, 3, H, W] in [-1, 1] -> image tokens [n, hidden] scaled by sqrt(hidden)."""
        vision = self.vlm_with_expert.vlm.model.vision_model
        x = vision(pixels.to(self.state_proj.weight.dtype))
        x = pixel_shuffle(x, self.scale_factor)
        x = self.vlm_with_expert.vlm.model.connector.modality_projection.proj(x)[0]
        return x * torch.tensor(x.shape[-1] ** 0.5, dtype=x.dtype, device=x.device)

    def fill(self, embs: torch.Tensor, pad: torch.Tensor, att: torch.Tensor,
             kv: torch.Tensor) -> None:
        """Run the prefix [L, hidden] through the VLM; write what the expert reads to kv rows."""
        L = embs.shape[0]
        cum = att.long().cumsum(0)
        mask = (cum[None, :] <= cum[:, None]) & pad[None, :] & pad[:, None]  # [L, L]
        tables = rope_tables(pad.long().cumsum(0) - 1, self.head_dim)
        text = self.vlm_with_expert.vlm.model.text_model
        x = embs
        for i, layer in enumerate(text.layers[:self.read[-1] + 1]):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = rope(a.q_proj(h).view(L, self.heads, -1), tables)
            k = rope(a.k_proj(h).view(L, self.kv_heads, -1), tables)  # [L, KVH, D]
            v = a.v_proj(h).view(L, self.kv_heads, -1)
            if i in self.read:
                read_k, read_v = k, v
                if not self.self_attn[i]:  # the expert's projections, computed once
                    ea = self.vlm_with_expert.lm_expert.layers[i // self.every].self_attn
                    read_k = ea.k_proj(k.reshape(L, -1)).view(L, self.kv_heads, -1)
                    read_v = ea.v_proj(v.reshape(L, -1)).view(L, self.kv_heads, -1)
                slot = kv[self.read.index(i)]  # [2, KVH, P, D]
                slot[0, :, :L].copy_(read_k.transpose(0, 1))
                slot[1, :, :L].copy_(read_v.transpose(0, 1))
                if i == self.read[-1]:
                    break  # later layers' outputs are read by nobody
            out = attend(q, [k.transpose(0, 1)], [v.transpose(0, 1)], mask, self.head_dim)
            x = layer.feed_forward(a.o_proj(out) + x)

    def velocity(self, x: torch.Tensor, step: int, kv: torch.Tensor, masks, tables
                 ) -> torch.Tensor:
        """One denoise_step: noisy actions [C, A] at step -> the velocity [C, A] (float32)."""
        w = self.action_in_proj.weight
        a = self.action_in_proj(x.to(w.dtype))  # [C, E]
        t = self.time_emb[step].to(w.dtype).expand_as(a)
        h = self.action_time_mlp_in(torch.cat([a, t], dim=1))
        h = self.action_time_mlp_out(F.silu(h))
        C = h.shape[0]
        expert = self.vlm_with_expert.lm_expert
        for j, layer in enumerate(expert.layers):
            i = j * self.every
            a_ = layer.self_attn
            r = layer.input_layernorm(h)
            pk, pv = kv[j, 0], kv[j, 1]  # [KVH, P, D] arena views, never copied
            if self.self_attn[i]:
                q = rope(a_.q_proj(r).view(C, self.heads, -1), tables[0])
                k = rope(a_.k_proj(r).view(C, self.kv_heads, -1), tables[0])
                v = a_.v_proj(r).view(C, self.kv_heads, -1)
                out = attend(q, [pk, k.transpose(0, 1)], [pv, v.transpose(0, 1)], masks[0],
                             self.head_dim)
            else:
                q = rope(a_.q_proj(r).view(C, self.heads, -1), tables[1])
                out = attend(q, [pk], [pv], masks[1], self.head_dim)
            h = layer.feed_forward(a_.o_proj(out.to(a_.o_proj.weight.dtype)) + h)
        h = expert.norm(h).float()
        return self.action_out_proj(h.to(self.action_out_proj.weight.dtype)).float()


class SmolVLAPolicy(nn.Module):
    """
    A LeRobot SmolVLA checkpoint as a runtime policy with an instruction and a prefix.

    `vlm_config` is the VLM's transformers SmolVLMConfig; `tokenizer` its tokenizer (a
    transformers tokenizer, called as LeRobot's TokenizerProcessorStep calls it). `stats`
    and `output_stats` as ACTPolicy's.
    """

    family = 'smolvla'
    dict_observations = True

    def __init__(self, config: SmolVLAConfig, vlm_config, tokenizer,
                 stats: dict | NormalizerStats | None = None, *,
                 output_stats: dict | NormalizerStats | None = None):
        super().__init__()
        self.config = config
        self.model = VLAFlowMatching(config, vlm_config)
        self.tokenizer = tokenizer
        pre = _norm_stats(stats, config)
        post = pre if output_stats is None else _norm_stats(output_stats, config)
        self.normalize = Normalizer({**config.input_features, **config.output_features}, pre,
                                    inverse=False)
        self.unnormalize = Normalizer(config.output_features, post, inverse=True)
        m = self.model
        self.prefix_tokens = (m.image_tokens * len(config.image_features)
                              + config.tokenizer_max_length + 1)
        self._views: dict[str, torch.Tensor] = {}

    def state_specs(self, max_steps: int) -> list[StateSpec]:
        """Declare the prefix as the expert reads it, its mask, the instruction (zero: none)."""
        c, m = self.config, self.model
        dtype = m.state_proj.weight.dtype
        kv = (len(m.read), 2, m.kv_heads, self.prefix_tokens, m.head_dim)
        return [StateSpec(PREFIX_KV, 'kv', kv, dtype),
                StateSpec(PREFIX_MASK, 'kv', (self.prefix_tokens,), torch.bool),
                StateSpec(INSTRUCTION, 'instruction', (c.tokenizer_max_length,), torch.int64),
                StateSpec(INSTRUCTION_LENGTH, 'instruction', (1,), torch.int64)]

    def bind(self, views: dict[str, torch.Tensor]) -> None:
        """Keep the arena views the prefix and the instruction live in."""
        for spec in self.state_specs(0):
            view = views.get(spec.name)
            if view is None or tuple(view.shape) != spec.shape or view.dtype != spec.dtype:
                raise ConfigError(f'SmolVLA needs the arena view {spec.name} {spec.shape} '
                                  f'{spec.dtype}')
        self._views = {s.name: views[s.name] for s in self.state_specs(0)}

    def _view(self, name: str) -> torch.Tensor:
        view = self._views.get(name)
        if view is None:
            raise ConfigError('SmolVLA is not bound to the arena')
        return view

    def tokenize(self, text: str) -> list[int]:
        """Return LeRobot's token ids of an instruction (a newline appended when missing)."""
        if not text.endswith('\n'):
            text = f'{text}\n'
        ids = self.tokenizer(text, padding=False, truncation=False)['input_ids']
        n = self.config.tokenizer_max_length
        if len(ids) > n:
            raise ValueError(f'the instruction is {len(ids)} tokens; it holds {n} '
                             '(tokenizer_max_length)')
        return list(ids)

    def instruct(self, text: str) -> None:
        """Store the instruction's token ids in the arena (ValueError when too long)."""
        ids = self.tokenize(text)
        tokens, length = self._view(INSTRUCTION), self._view(INSTRUCTION_LENGTH)
        tokens.zero_()
        tokens[:len(ids)] = torch.tensor(ids, dtype=torch.int64)
        length.fill_(len(ids))

    def prefix(self, observation: dict[str, torch.Tensor]) -> None:
        """Images, the stored instruction and the state -> the prefix in the arena."""
        c, m = self.config, self.model
        kv, pad_view = self._view(PREFIX_KV), self._view(PREFIX_MASK)
        text = m.vlm_with_expert.vlm.model.text_model
        w = m.state_proj.weight
        embs, pads = [], []
        for key, f in c.image_features.items():
            x = observation.get(key)
            if x is None and key in c.camera_features:
                raise InvalidRequestError(f'the SmolVLA observation needs {key!r} '
                                          f'{list(f.shape)}')
            valid = x is not None
            if valid:
                x = self._input(x, key, f.shape).unsqueeze(0)  # [1, 3, H, W]
            else:  # LeRobot's empty camera: a -1 picture, masked out
                x = torch.zeros(1, *f.shape, device=w.device)
            if c.resize_imgs_with_padding is not None:
                x = resize_with_pad(x, *c.resize_imgs_with_padding)
            x = x * 2.0 - 1.0 if valid else torch.ones_like(x) * -1
            tokens = m.embed_image(x)  # [n, hidden]
            embs.append(tokens)
            pads.append(torch.full((len(tokens),), valid, device=w.device))
        n = int(self._view(INSTRUCTION_LENGTH)[0])
        ids = self._view(INSTRUCTION)[:n].to(w.device)
        lang = text.embed_tokens(ids)
        embs.append(lang * math.sqrt(lang.shape[-1]))
        pads.append(torch.ones(n, dtype=torch.bool, device=w.device))
        state = self._input(observation.get(OBS_STATE), OBS_STATE, (c.state_dim,))
        state = F.pad(state, (0, c.max_state_dim - c.state_dim)).to(w.dtype)
        embs.append(m.state_proj(state)[None])
        pads.append(torch.ones(1, dtype=torch.bool, device=w.device))
        embs, pad = torch.cat(embs), torch.cat(pads)  # [L, hidden], [L]
        L = len(pad)
        att = torch.zeros(L, dtype=torch.bool, device=w.device)
        att[-1] = True  # images and language do not attend to the state
        m.fill(embs, pad, att, kv)
        kv[:, :, :, L:].zero_()
        pad_view[:L].copy_(pad)
        pad_view[L:].zero_()

    def _input(self, x, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """One normalized float32 observation entry of `shape` (the last step of a [T, ...])."""
        if x is None:
            raise InvalidRequestError(f'the SmolVLA observation needs {key!r} {list(shape)}')
        x = torch.as_tensor(x).to(device=self.model.state_proj.weight.device, dtype=torch.float32)
        if x.dim() < len(shape) or tuple(x.shape[-len(shape):]) != tuple(shape):
            raise InvalidRequestError(f'{key!r} must be {list(shape)}, got {list(x.shape)}')
        return self.normalize(key, x.reshape(-1, *shape)[-1])

    def sample(self, generator: torch.Generator, noise: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Denoise over the arena's prefix: unnormalized actions [n_action_steps, action_dim]."""
        c = self.config
        x = self._denoise(generator, noise)  # [chunk_size, max_action_dim]
        return self.unnormalize(ACTION, x[:c.n_action_steps, :c.action_dim])

    @torch.inference_mode()
    def predict_chunk(self, observation: dict[str, torch.Tensor],
                      noise: torch.Tensor | None = None) -> torch.Tensor:
        """Encode the prefix and return the whole unnormalized chunk [chunk_size, action_dim]."""
        self.prefix(observation)
        return self.unnormalize(ACTION, self._denoise(None, noise)[:, :self.config.action_dim])

    def _denoise(self, generator: torch.Generator | None, noise: torch.Tensor | None
                 ) -> torch.Tensor:
        """Run the Euler steps from the noise over the arena: [chunk_size, max_action_dim]."""
        c, m = self.config, self.model
        kv, pad = self._view(PREFIX_KV), self._view(PREFIX_MASK)
        device = kv.device
        if noise is None:
            noise = torch.randn((c.chunk_size, c.max_action_dim), generator=generator,
                                device=device if generator is None else generator.device)
        x = noise.reshape(c.chunk_size, c.max_action_dim).to(device, torch.float32)
        C = c.chunk_size
        offset = pad.sum()  # the prefix's valid tokens: the chunk's positions follow them
        steps = torch.arange(C, device=device)
        tables = (rope_tables(offset + steps, m.head_dim), rope_tables(steps, m.head_dim))
        causal = steps[None, :] <= steps[:, None]  # [C, C]: the chunk attends causally
        prefix = pad[None, :].expand(C, -1)  # [C, P]
        masks = (torch.cat([prefix, causal], dim=1), prefix)
        if not bool(pad.any()):
            raise InvalidRequestError('SmolVLA has no prefix yet: encode an observation first')
        for step in range(c.num_steps):
            x = x + m.dt * m.velocity(x, step, kv, masks, tables)
        return x

    @torch.inference_mode()
    def forward(self, observation: dict[str, torch.Tensor], position: int = 0,
                generator: torch.Generator | None = None) -> torch.Tensor:
        """Encode the prefix, then sample a chunk: what select_action returns over its calls."""
        self.prefix(observation)
        return self.sample(generator)


def _norm_stats(stats, config: SmolVLAConfig) -> NormalizerStats | None:
    if stats is None or isinstance(stats, NormalizerStats):
        return stats
    tensors = {key: {name: torch.as_tensor(value, dtype=torch.float32)
                     for name, value in entries.items()} for key, entries in stats.items()}
    return NormalizerStats(tensors, dict(config.normalization_mapping), source='stats')


def read_smolvla_config(path: str | Path) -> SmolVLAConfig:
    """Read the SmolVLAConfig of a LeRobot SmolVLA checkpoint folder."""
    return SmolVLAConfig.from_json(read_config(path), str(Path(path) / CONFIG_FILE))


def find_vlm(config: SmolVLAConfig, vlm_path: str | Path | None = None) -> Path:
    """Return the folder with the VLM's config.json and tokenizer (never downloads)."""
    candidates = [vlm_path] if vlm_path is not None else [
        config.vlm_model_name, os.environ.get(VLM_PATH_ENV)]
    for candidate in candidates:
        if candidate and (Path(candidate) / CONFIG_FILE).is_file():
            return Path(candidate)
    tried = ', '.join(str(c) for c in candidates if c)
    raise ConfigError(f'SmolVLA needs the VLM {config.vlm_model_name!r} (its config.json and '
                      f'tokenizer files) in a local folder; tried: {tried or "nothing"}. Pass '
                      f'vlm_path or set {VLM_PATH_ENV} to the folder (e.g. a snapshot of '
                      f'{config.vlm_model_name} downloaded beforehand)')


def load_vlm(folder: str | Path):
    """(SmolVLMConfig, tokenizer) of a VLM folder, offline."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        vlm_config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers raises many types for a bad folder
        raise ConfigError(f'cannot read the VLM config and tokenizer in {folder}: {exc}') from exc
    if getattr(vlm_config, 'model_type', None) != 'smolvlm':
        raise ConfigError(f'{folder}: the VLM must be a SmolVLM (model_type smolvlm), got '
                          f'{getattr(vlm_config, "model_type", None)!r}')
    return vlm_config, tokenizer


def load_smolvla(path: str | Path, device: str | torch.device = 'cpu',
                 dtype: torch.dtype | str = torch.float32,
                 vlm_path: str | Path | None = None) -> tuple[SmolVLAPolicy, dict]:
    """Load a LeRobot SmolVLA checkpoint folder: (SmolVLAPolicy, the runtime's policy spec)."""
    folder = Path(path)
    config = read_smolvla_config(folder)
    vlm_config, tokenizer = load_vlm(find_vlm(config, vlm_path))
    pre, post, normalization = read_normalizers(folder, config, pre_steps=SMOLVLA_PRE_STEPS,
                                                family='SmolVLA')
    weights = read_weights(folder)
    policy = SmolVLAPolicy(config, vlm_config, tokenizer, pre, output_stats=post)
    head = 'model.vlm_with_expert.vlm.lm_head.weight'
    if head not in weights and getattr(vlm_config, 'tie_word_embeddings', False):
        weights[head] = weights['model.vlm_with_expert.vlm.model.text_model.embed_tokens.weight']
    place(policy, weights, folder, device, dtype, against='its config.json and the VLM config')
    spec = {'obs_dim': config.state_dim, 'action_dim': config.action_dim,
            'horizon': config.n_action_steps,
            'images': tuple((k, f.shape) for k, f in config.camera_features.items()),
            'replan': 'queue_empty', 'normalization': normalization,
            'config': config.to_json(), 'prefix_tokens': policy.prefix_tokens}
    return policy, spec


# The tiny VLM save_tiny_vlm writes: 64x64 pictures in 8x8 patches, 16 tokens per picture.
TINY_VLM = {
    'architectures': ['SmolVLMForConditionalGeneration'], 'model_type': 'smolvlm',
    'scale_factor': 2, 'tie_word_embeddings': False,
    'vision_config': {'model_type': 'smolvlm_vision', 'hidden_size': 32, 'intermediate_size': 64,
                      'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_channels': 3,
                      'image_size': 64, 'patch_size': 8, 'hidden_act': 'gelu_pytorch_tanh',
                      'layer_norm_eps': 1e-6},
    'text_config': {'model_type': 'llama', 'hidden_size': 64, 'intermediate_size': 128,
                    'num_hidden_layers': 4, 'num_attention_heads': 4, 'num_key_value_heads': 2,
                    'head_dim': 16, 'rms_norm_eps': 1e-5, 'hidden_act': 'silu',
                    'max_position_embeddings': 512, 'tie_word_embeddings': False},
}
# The specials SmolVLM's processor looks up (LeRobot builds it even without image tokens).
_VLM_SPECIALS = ('<|endoftext|>', '<|im_end|>', '<fake_token_around_image>', '<image>',
                 '<global-img>', '<end_of_utterance>')


def save_tiny_vlm(directory: str | Path, **overrides: Any) -> Path:
    """
    Write a tiny SmolVLM folder: config.json, a byte-level BPE tokenizer, processor files.

    What LeRobot's SmolVLA reads of `vlm_model_name` when it builds a policy without the VLM
    weights (AutoConfig, AutoProcessor); no weights. `overrides` update TINY_VLM (a dict
    value updates that sub-config: text_config={'num_hidden_layers': 8}).
    """
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, Tokenizer

    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in _VLM_SPECIALS])
    tok.save(str(folder / 'tokenizer.json'))
    ids = {s: len(alphabet) + i for i, s in enumerate(_VLM_SPECIALS)}
    (folder / 'tokenizer_config.json').write_text(json.dumps({
        'tokenizer_class': 'GPT2Tokenizer', 'model_max_length': 8192,
        'bos_token': '<|endoftext|>', 'eos_token': '<end_of_utterance>',
        'pad_token': '<|im_end|>', 'unk_token': '<|endoftext|>', 'add_prefix_space': False,
        'clean_up_tokenization_spaces': False,
        'extra_special_tokens': {'fake_image_token': '<fake_token_around_image>',
                                 'image_token': '<image>', 'global_image_token': '<global-img>',
                                 'end_of_utterance_token': '<end_of_utterance>'}}, indent=1))
    config = json.loads(json.dumps(TINY_VLM))
    for key, value in overrides.items():
        if isinstance(value, dict):
            config[key].update(value)
        else:
            config[key] = value
    config['image_token_id'] = ids['<image>']
    config['text_config'].update(vocab_size=len(alphabet) + len(ids),
                                 pad_token_id=ids['<|im_end|>'])
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    vision = config['vision_config']
    (folder / 'preprocessor_config.json').write_text(json.dumps({
        'image_processor_type': 'SmolVLMImageProcessor', 'processor_class': 'SmolVLMProcessor',
        'size': {'longest_edge': vision['image_size']},
        'max_image_size': {'longest_edge': vision['image_size']}}, indent=1))
    seq = (vision['image_size'] // vision['patch_size']) ** 2 // config['scale_factor'] ** 2
    (folder / 'processor_config.json').write_text(json.dumps({
        'processor_class': 'SmolVLMProcessor', 'image_seq_len': seq}, indent=1))
    return folder


# The config save_smolvla_checkpoint starts from: one 3x48x64 camera, a 6-joint arm.
TINY_SMOLVLA = {
    'input_features': {OBS_STATE: {'type': 'STATE', 'shape': [6]},
                       f'{OBS_IMAGES}.top': {'type': 'VISUAL', 'shape': [3, 48, 64]}},
    'output_features': {ACTION: {'type': 'ACTION', 'shape': [6]}},
    'chunk_size': 10, 'n_action_steps': 5, 'max_state_dim': 8, 'max_action_dim': 8,
    'resize_imgs_with_padding': [64, 64], 'tokenizer_max_length': 24, 'num_steps': 3,
    'num_vlm_layers': 4,
}


def save_smolvla_checkpoint(directory: str | Path, *, vlm_folder: str | Path, seed: int = 0,
                            stats: dict[str, dict[str, Any]] | None = None,
                            **overrides: Any) -> Path:
    """
    Write a random-weight SmolVLA as LeRobot saves one over the VLM in `vlm_folder`.

    The config is TINY_SMOLVLA updated with `overrides`, `vlm_model_name` the folder; with
    `stats` ({feature: {stat: tensor}}) the processor pipelines and normalizer files too.
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    config = SmolVLAConfig.from_json({'type': 'smolvla', **TINY_SMOLVLA,
                                      'vlm_model_name': str(vlm_folder), **overrides},
                                     'save_smolvla_checkpoint')
    vlm_config, tokenizer = load_vlm(vlm_folder)
    policy = SmolVLAPolicy(config, vlm_config, tokenizer)
    g = torch.Generator().manual_seed(seed)
    weights = {k: _random_like(k, v, g).contiguous() for k, v in policy.state_dict().items()}
    (folder / CONFIG_FILE).write_text(json.dumps(config.to_json(), indent=4))
    save_file(weights, str(folder / WEIGHTS_FILE))
    _save_processors(folder, config, stats or {})
    return folder


def _save_processors(folder: Path, config: SmolVLAConfig, stats: dict) -> None:
    """Write SmolVLA's pre/post-processor pipelines of LeRobot 0.4.4, their stats beside them."""
    features = {**config.input_features, **config.output_features}
    flat = {}
    for key, entries in stats.items():
        for stat, value in entries.items():
            t = torch.as_tensor(value, dtype=torch.float32)
            if features[key].kind == 'VISUAL' and t.dim() == 1:  # per channel: [C, 1, 1]
                t = t.reshape(-1, 1, 1)
            flat[f'{key}.{stat}'] = t.contiguous()

    def normalizer(registry_name, feats, state_file):
        step = {'registry_name': registry_name,
                'config': {'eps': NORMALIZER_EPS, 'norm_map': dict(config.normalization_mapping),
                           'features': {k: {'type': f.kind, 'shape': list(f.shape)}
                                        for k, f in feats.items()}}}
        if flat:  # LeRobot writes no state file for a normalizer without stats
            save_file(flat, str(folder / state_file))
            step['state_file'] = state_file
        return step

    device = {'registry_name': 'device_processor',
              'config': {'device': 'cpu', 'float_dtype': None}}
    tokenizer = {'registry_name': 'tokenizer_processor', 'config': {
        'max_length': config.tokenizer_max_length, 'task_key': 'task', 'padding_side': 'right',
        'padding': config.pad_language_to, 'truncation': True,
        'tokenizer_name': config.vlm_model_name}}
    pre = [{'registry_name': 'rename_observations_processor', 'config': {'rename_map': {}}},
           {'registry_name': 'to_batch_processor', 'config': {}},
           {'registry_name': 'smolvla_new_line_processor', 'config': {}}, tokenizer, device,
           normalizer('normalizer_processor', features,
                      'policy_preprocessor_step_5_normalizer_processor.safetensors')]
    post = [normalizer('unnormalizer_processor', config.output_features,
                       'policy_postprocessor_step_0_unnormalizer_processor.safetensors'), device]
    for file, name, steps in ((PREPROCESSOR_FILE, 'policy_preprocessor', pre),
                              (POSTPROCESSOR_FILE, 'policy_postprocessor', post)):
        (folder / file).write_text(json.dumps({'name': name, 'steps': steps}, indent=2))
