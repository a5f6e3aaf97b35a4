"""
ACT (Action Chunking Transformer, Zhao et al. 2023) as LeRobot 0.4 runs it at inference.

Written natively with LeRobot's parameter and buffer names, so a LeRobot checkpoint folder
(models/lerobot.py) loads with ``load_state_dict(strict=True)``, and with LeRobot's
arithmetic in LeRobot's order, so chunks agree to float32 rounding:

  * backbone: torchvision's ResNet-18/34 trunk up to layer4 (IntermediateLayerGetter drops
    avgpool and fc) with FrozenBatchNorm2d, ``x * scale + shift`` where
    ``scale = w * (running_var + 1e-5).rsqrt()`` and ``shift = b - running_mean * scale``;
  * encoder tokens ``[latent, (state), (env state), (camera feature pixels...)]`` with a learnt
    1D position embedding for the first ones and a 2D sine embedding for the pixels; the
    latent is zeros at inference (the VAE encoder's parameters exist only so checkpoints
    load strictly);
  * post-norm (or pre_norm) transformer encoder and decoder; attention is
    nn.MultiheadAttention's eval path (separate q/k/v projections, ``q * sqrt(1/d)``, bmm,
    softmax, bmm, out projection), dropout inactive;
  * decoder queries: zeros plus a learnt embedding per chunk step; a linear action head.

Inputs are normalized and actions unnormalized with the checkpoint's processor stats.
Temporal ensembling (``temporal_ensemble_coeff``) is LeRobot's ACTTemporalEnsembler over
arena state: ``act.ensemble`` [chunk_size, action_dim] holds the running weighted means of
the coming steps (row 0: the next step; the last row is scratch) and ``act.ensemble_count``
[chunk_size] how many chunks each mean holds. A zero count means no estimate yet, so a zeroed
arena is a fresh episode.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

from .lerobot import ACTConfig, Normalizer, NormalizerStats, OBS_ENV_STATE, OBS_STATE
from .lerobot import place, read_act_config, read_normalizers, read_weights, RESNET_LAYERS
from .lerobot import WEIGHTS_FILE
from ..errors import ConfigError, InvalidRequestError
from ..state.arena import StateSpec

ENSEMBLE = 'act.ensemble'
ENSEMBLE_COUNT = 'act.ensemble_count'
# Keys of the normalizer modules LeRobot < 0.4 kept inside model.safetensors.
_LEGACY_PREFIXES = ('normalize_inputs.', 'normalize_targets.', 'unnormalize_outputs.')


class FrozenBatchNorm2d(nn.Module):
    """torchvision's FrozenBatchNorm2d: batch norm with fixed statistics (eps 1e-5)."""

    def __init__(self, n: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.register_buffer('weight', torch.ones(n))
        self.register_buffer('bias', torch.zeros(n))
        self.register_buffer('running_mean', torch.zeros(n))
        self.register_buffer('running_var', torch.ones(n))
        # scale and shift depend on the buffers only: computed once per load, not per call
        self.register_buffer('scale', torch.empty(n, 1, 1), persistent=False)
        self.register_buffer('shift', torch.empty(n, 1, 1), persistent=False)
        self._refresh()

    def _refresh(self) -> None:
        w, b = self.weight.reshape(-1, 1, 1), self.bias.reshape(-1, 1, 1)
        rv, rm = self.running_var.reshape(-1, 1, 1), self.running_mean.reshape(-1, 1, 1)
        scale = w * (rv + self.eps).rsqrt()
        self.scale.copy_(scale)
        self.shift.copy_(b - rm * scale)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        state_dict.pop(prefix + 'num_batches_tracked', None)  # torchvision drops it too
        super()._load_from_state_dict(state_dict, prefix, *args)
        with torch.no_grad():
            self._refresh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(self.scale).add_(self.shift)  # x is a fresh conv output: in place is safe


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock (two 3x3 convs and a skip)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = FrozenBatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = FrozenBatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            FrozenBatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn1(self.conv1(x)).relu_()
        out = self.bn2(self.conv2(out))
        out += x if self.downsample is None else self.downsample(x)
        return out.relu_()


class ResNet(nn.Module):
    """The trunk LeRobot takes from torchvision: stem and layer1..layer4, no pooling or fc."""

    out_channels = 512

    def __init__(self, blocks: tuple[int, int, int, int]):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = FrozenBatchNorm2d(64)
        cin = 64
        for i, (n, cout) in enumerate(zip(blocks, (64, 128, 256, 512))):
            stride = 1 if i == 0 else 2
            layer = [BasicBlock(cin if j == 0 else cout, cout, stride if j == 0 else 1)
                     for j in range(n)]
            self.add_module(f'layer{i + 1}', nn.Sequential(*layer))
            cin = cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn1(self.conv1(x)).relu_()
        if x.device.type == 'cpu':  # a max is exact; torch's channels-last CPU pool is ~2x faster
            x = x.contiguous(memory_format=torch.channels_last)
        x = F.max_pool2d(x, 3, 2, 1).contiguous()  # the convs stay NCHW, as LeRobot's
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))  # [B, 512, H/32, W/32]


class Attention(nn.Module):
    """nn.MultiheadAttention's parameters and its eval-mode arithmetic (sequence first)."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * dim))
        self.out_proj = nn.Linear(dim, dim)
        nn.init.xavier_uniform_(self.in_proj_weight)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                ) -> torch.Tensor:
        L, B, D = query.shape
        S, h = key.shape[0], self.n_heads
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        # ACT never passes query is key is value, so torch projects q, k and v separately
        q = F.linear(query, w_q, b_q).view(L, B * h, D // h).transpose(0, 1)  # [B*h, L, d]
        k = F.linear(key, w_k, b_k).view(S, B * h, D // h).transpose(0, 1)  # [B*h, S, d]
        v = F.linear(value, w_v, b_v).view(S, B * h, D // h).transpose(0, 1)  # [B*h, S, d]
        scores = torch.bmm(q * math.sqrt(1.0 / (D // h)), k.transpose(-2, -1))  # [B*h, L, S]
        out = torch.bmm(scores.softmax(dim=-1), v)  # [B*h, L, d]
        out = self.out_proj(out.transpose(0, 1).reshape(L * B, D))  # [L*B, D]
        return out.view(L, B, D)


class EncoderLayer(nn.Module):
    """LeRobot's ACTEncoderLayer."""

    def __init__(self, c: ACTConfig):
        super().__init__()
        self.self_attn = Attention(c.dim_model, c.n_heads)
        self.linear1 = nn.Linear(c.dim_model, c.dim_feedforward)
        self.linear2 = nn.Linear(c.dim_feedforward, c.dim_model)
        self.norm1 = nn.LayerNorm(c.dim_model)
        self.norm2 = nn.LayerNorm(c.dim_model)
        self.activation = F.gelu if c.feedforward_activation == 'gelu' else F.relu
        self.pre_norm = c.pre_norm

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        skip = x
        if self.pre_norm:
            x = self.norm1(x)
        qk = x + pos
        x = skip + self.self_attn(qk, qk, x)
        if self.pre_norm:
            skip, x = x, self.norm2(x)
        else:
            x = skip = self.norm1(x)
        x = skip + self.linear2(self.activation(self.linear1(x)))
        return x if self.pre_norm else self.norm2(x)


class Encoder(nn.Module):
    """LeRobot's ACTEncoder (a final LayerNorm only with pre_norm)."""

    def __init__(self, c: ACTConfig, n_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(c) for _ in range(n_layers))
        self.norm = nn.LayerNorm(c.dim_model) if c.pre_norm else nn.Identity()

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, pos)
        return self.norm(x)


class DecoderLayer(nn.Module):
    """LeRobot's ACTDecoderLayer: self-attention, cross-attention, feed-forward."""

    def __init__(self, c: ACTConfig):
        super().__init__()
        self.self_attn = Attention(c.dim_model, c.n_heads)
        self.multihead_attn = Attention(c.dim_model, c.n_heads)
        self.linear1 = nn.Linear(c.dim_model, c.dim_feedforward)
        self.linear2 = nn.Linear(c.dim_feedforward, c.dim_model)
        self.norm1 = nn.LayerNorm(c.dim_model)
        self.norm2 = nn.LayerNorm(c.dim_model)
        self.norm3 = nn.LayerNorm(c.dim_model)
        self.activation = F.gelu if c.feedforward_activation == 'gelu' else F.relu
        self.pre_norm = c.pre_norm

    def forward(self, x: torch.Tensor, memory: torch.Tensor, pos: torch.Tensor,
                memory_pos: torch.Tensor) -> torch.Tensor:
        skip = x
        if self.pre_norm:
            x = self.norm1(x)
        qk = x + pos
        x = skip + self.self_attn(qk, qk, x)
        if self.pre_norm:
            skip, x = x, self.norm2(x)
        else:
            x = skip = self.norm1(x)
        x = skip + self.multihead_attn(x + pos, memory + memory_pos, memory)
        if self.pre_norm:
            skip, x = x, self.norm3(x)
        else:
            x = skip = self.norm2(x)
        x = skip + self.linear2(self.activation(self.linear1(x)))
        return x if self.pre_norm else self.norm3(x)


class Decoder(nn.Module):
    """LeRobot's ACTDecoder (always a final LayerNorm)."""

    def __init__(self, c: ACTConfig):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.n_decoder_layers))
        self.norm = nn.LayerNorm(c.dim_model)

    def forward(self, x, memory, pos, memory_pos):
        for layer in self.layers:
            x = layer(x, memory, pos, memory_pos)
        return self.norm(x)


def sine_table(n: int, dim: int) -> torch.Tensor:
    """Return the 1D sine table of 'Attention is all you need' [n, dim] as LeRobot does."""
    angle = np.array([[p / np.power(10000, 2 * (j // 2) / dim) for j in range(dim)]
                      for p in range(n)])
    angle[:, 0::2] = np.sin(angle[:, 0::2])
    angle[:, 1::2] = np.cos(angle[:, 1::2])
    return torch.from_numpy(angle).float()


def sine_embedding_2d(h: int, w: int, dim: int, device: torch.device) -> torch.Tensor:
    """Return ACTSinusoidalPositionEmbedding2d's table as tokens: [h*w, 1, dim] float32."""
    half = dim // 2
    ones = torch.ones(1, h, w, device=device)
    y = ones.cumsum(1, dtype=torch.float32)  # 1..h down the rows, as the original code
    x = ones.cumsum(2, dtype=torch.float32)
    y = y / (y[:, -1:, :] + 1e-6) * (2 * math.pi)
    x = x / (x[:, :, -1:] + 1e-6) * (2 * math.pi)
    frequency = 10000 ** (2 * (torch.arange(half, dtype=torch.float32, device=device) // 2)
                          / half)
    x = x.unsqueeze(-1) / frequency  # [1, h, w, half]
    y = y.unsqueeze(-1) / frequency
    pos_x = torch.stack((x[..., 0::2].sin(), x[..., 1::2].cos()), dim=-1).flatten(3)
    pos_y = torch.stack((y[..., 0::2].sin(), y[..., 1::2].cos()), dim=-1).flatten(3)
    pos = torch.cat((pos_y, pos_x), dim=3)  # [1, h, w, dim]: y's sines and cosines first
    return pos.reshape(h * w, 1, dim)


class ACT(nn.Module):
    """LeRobot's ACT network: images and states in, a normalized action chunk out."""

    def __init__(self, c: ACTConfig):
        super().__init__()
        self.config = c
        d, state_dim = c.dim_model, c.state_dim
        if c.use_vae:  # training only; present so that checkpoints load strictly
            self.vae_encoder = Encoder(c, c.n_vae_encoder_layers)
            self.vae_encoder_cls_embed = nn.Embedding(1, d)
            if state_dim:
                self.vae_encoder_robot_state_input_proj = nn.Linear(state_dim, d)
            self.vae_encoder_action_input_proj = nn.Linear(c.action_dim, d)
            self.vae_encoder_latent_output_proj = nn.Linear(d, c.latent_dim * 2)
            n_vae_tokens = 1 + c.chunk_size + (1 if state_dim else 0)
            self.register_buffer('vae_encoder_pos_enc', sine_table(n_vae_tokens, d).unsqueeze(0))
        if c.image_features:
            self.backbone = ResNet(RESNET_LAYERS[c.vision_backbone])
        self.encoder = Encoder(c, c.n_encoder_layers)
        self.decoder = Decoder(c)
        if state_dim:
            self.encoder_robot_state_input_proj = nn.Linear(state_dim, d)
        if c.env_dim:
            self.encoder_env_state_input_proj = nn.Linear(c.env_dim, d)
        self.encoder_latent_input_proj = nn.Linear(c.latent_dim, d)
        if c.image_features:
            self.encoder_img_feat_input_proj = nn.Conv2d(ResNet.out_channels, d, kernel_size=1)
        self.encoder_1d_feature_pos_embed = nn.Embedding(
            1 + (1 if state_dim else 0) + (1 if c.env_dim else 0), d)
        self.decoder_pos_embed = nn.Embedding(c.chunk_size, d)
        self.action_head = nn.Linear(d, c.action_dim)
        self._pixel_pos: dict[tuple, torch.Tensor] = {}  # (h, w, device, dtype) -> tokens

    def pixel_pos(self, h: int, w: int, ref: torch.Tensor) -> torch.Tensor:
        """Return the 2D sine embedding of an h x w feature map, computed once per shape."""
        key = (h, w, ref.device, ref.dtype)
        if key not in self._pixel_pos:
            pos = sine_embedding_2d(h, w, self.config.dim_model, ref.device)
            self._pixel_pos[key] = pos.to(ref.dtype)
        return self._pixel_pos[key]

    def forward(self, state: torch.Tensor | None, env: torch.Tensor | None,
                images: list[torch.Tensor]) -> torch.Tensor:
        """Map normalized [B, dim] states and [B, 3, H, W] images to [B, chunk, action_dim]."""
        c = self.config
        weight = self.encoder_latent_input_proj.weight
        batch = (state if state is not None else env if env is not None else images[0]).shape[0]
        latent = torch.zeros(batch, c.latent_dim, dtype=weight.dtype, device=weight.device)
        tokens = [self.encoder_latent_input_proj(latent)]  # each [B, D]
        if state is not None:
            tokens.append(self.encoder_robot_state_input_proj(state))
        if env is not None:
            tokens.append(self.encoder_env_state_input_proj(env))
        tokens = [torch.stack(tokens)]  # [n, B, D]
        pos = [self.encoder_1d_feature_pos_embed.weight.unsqueeze(1)]  # [n, 1, D]
        for image in images:
            features = self.backbone(image)  # [B, 512, h, w]
            pos.append(self.pixel_pos(*features.shape[-2:], features))  # [h*w, 1, D]
            features = self.encoder_img_feat_input_proj(features)  # [B, D, h, w]
            tokens.append(features.flatten(2).permute(2, 0, 1))  # [h*w, B, D]
        tokens, pos = torch.cat(tokens), torch.cat(pos)  # [S, B, D], [S, 1, D]
        memory = self.encoder(tokens, pos)
        queries = torch.zeros(c.chunk_size, batch, c.dim_model, dtype=pos.dtype,
                              device=pos.device)
        out = self.decoder(queries, memory, self.decoder_pos_embed.weight.unsqueeze(1), pos)
        return self.action_head(out.transpose(0, 1))  # [B, chunk_size, action_dim]


class ACTPolicy(nn.Module):
    """
    A LeRobot ACT checkpoint as a runtime policy: observation dict in, actions out.

    `stats` are the input normalizer's (LeRobot's dataset stats {feature: {stat: tensor}}
    under the config's normalization_mapping, or a NormalizerStats); `output_stats` the
    action unnormalizer's, the same stats when not given; None: identity.
    """

    family = 'act'
    dict_observations = True

    def __init__(self, config: ACTConfig, stats: dict | NormalizerStats | None = None, *,
                 output_stats: dict | NormalizerStats | None = None):
        super().__init__()
        self.config = config
        self.model = ACT(config)
        pre = _norm_stats(stats, config)
        post = pre if output_stats is None else _norm_stats(output_stats, config)
        self.normalize = Normalizer({**config.input_features, **config.output_features}, pre,
                                    inverse=False)
        self.unnormalize = Normalizer(config.output_features, post, inverse=True)
        self.ensembling = config.temporal_ensemble_coeff is not None
        if self.ensembling:
            # LeRobot's ACTTemporalEnsembler weights: w_i = exp(-coeff * i), w_0 the oldest
            weights = torch.exp(-config.temporal_ensemble_coeff * torch.arange(config.chunk_size))
            self.register_buffer('ensemble_weights', weights, persistent=False)
            self.register_buffer('ensemble_cumsum', weights.cumsum(0), persistent=False)
        self._views: dict[str, torch.Tensor] = {}

    def state_specs(self, max_steps: int) -> list[StateSpec]:
        """Declare the temporal ensemble's buffers; none without it (chunks are stateless)."""
        if not self.ensembling:
            return []
        c = self.config
        return [StateSpec(ENSEMBLE, 'actions', (c.chunk_size, c.action_dim), torch.float32),
                StateSpec(ENSEMBLE_COUNT, 'actions', (c.chunk_size,), torch.int64)]

    def bind(self, views: dict[str, torch.Tensor]) -> None:
        """Keep the arena views the ensemble lives in."""
        wanted = {s.name: s for s in self.state_specs(0)}
        for name, spec in wanted.items():
            view = views.get(name)
            if view is None or tuple(view.shape) != spec.shape or view.dtype != spec.dtype:
                raise ConfigError(f'ACT needs the arena view {name} {spec.shape} {spec.dtype}')
        self._views = {name: views[name] for name in wanted}

    @torch.inference_mode()
    def forward(self, observation: dict[str, torch.Tensor], position: int = 0,
                generator: torch.Generator | None = None) -> torch.Tensor:
        """
        Return the actions LeRobot's select_action gives over its next calls, unnormalized.

        [n_action_steps, action_dim]; with temporal ensembling [1, action_dim], the ensemble
        advanced by one step. ACT draws no noise: position and generator are unused.
        """
        chunk = self.model(*self._inputs(observation))[0].float()  # [chunk_size, A], normalized
        if not self.ensembling:
            return self.unnormalize('action', chunk[:self.config.n_action_steps])
        return self.unnormalize('action', self._ensemble(chunk))

    @torch.inference_mode()
    def predict_chunk(self, observation: dict[str, torch.Tensor]) -> torch.Tensor:
        """Return the whole unnormalized chunk [chunk_size, action_dim]; no state changes."""
        return self.unnormalize('action', self.model(*self._inputs(observation))[0].float())

    def _inputs(self, observation: dict[str, torch.Tensor]):
        c = self.config
        state = self._input(observation, OBS_STATE, (c.state_dim,)) if c.state_dim else None
        env = self._input(observation, OBS_ENV_STATE, (c.env_dim,)) if c.env_dim else None
        images = [self._input(observation, key, f.shape)
                  for key, f in c.image_features.items()]
        return state, env, images

    def _input(self, observation: dict, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """One normalized observation entry, [1, *shape] (the last step of a [T, ...] one)."""
        x = observation.get(key)
        if x is None:
            raise InvalidRequestError(f'the ACT observation needs {key!r} {list(shape)}')
        weight = self.model.encoder_latent_input_proj.weight
        x = torch.as_tensor(x).to(device=weight.device, dtype=torch.float32)
        if x.dim() < len(shape) or tuple(x.shape[-len(shape):]) != tuple(shape):
            raise InvalidRequestError(f'{key!r} must be {list(shape)}, got {list(x.shape)}')
        x = x.reshape(-1, *shape)[-1:]  # [1, *shape]
        return self.normalize(key, x).to(weight.dtype)

    def _ensemble(self, actions: torch.Tensor) -> torch.Tensor:
        """Run ACTTemporalEnsembler.update over the arena: [C, A] in, [1, A] out."""
        ens, count = self._views.get(ENSEMBLE), self._views.get(ENSEMBLE_COUNT)
        if ens is None:
            raise ConfigError('ACT with temporal ensembling is not bound to the arena')
        C = self.config.chunk_size
        live, n = ens[:-1], count[:-1]  # [C-1, A], [C-1]: the means of the next steps
        started = (n > 0).unsqueeze(-1)  # [C-1, 1]
        w, cum = self.ensemble_weights, self.ensemble_cumsum
        # LeRobot's online weighted mean in its operation order (n = 0 rows are discarded)
        mean = live * cum[n - 1].unsqueeze(-1)
        mean += actions[:-1] * w[n].unsqueeze(-1)
        mean /= cum[n].unsqueeze(-1)
        live.copy_(torch.where(started, mean, actions[:-1]))
        n.copy_(torch.where(started.squeeze(-1), (n + 1).clamp(max=C), 1))
        ens[-1].copy_(actions[-1])
        count[-1].fill_(1)
        action = ens[:1].clone()  # [1, A]: this step's ensembled action
        ens.copy_(ens.roll(-1, 0))  # consume it: the next step's mean moves to row 0
        count.copy_(count.roll(-1, 0))
        ens[-1].zero_()
        count[-1].zero_()
        return action


def _norm_stats(stats, config: ACTConfig) -> NormalizerStats | None:
    if stats is None or isinstance(stats, NormalizerStats):
        return stats
    tensors = {key: {name: torch.as_tensor(value, dtype=torch.float32)
                     for name, value in entries.items()} for key, entries in stats.items()}
    return NormalizerStats(tensors, dict(config.normalization_mapping), source='stats')


def load_act(path: str | Path, device: str | torch.device = 'cpu',
             dtype: torch.dtype | str = torch.float32) -> tuple[ACTPolicy, dict]:
    """Load a LeRobot ACT checkpoint folder: (ACTPolicy, the runtime's policy spec fields)."""
    folder = Path(path)
    config = read_act_config(folder)
    pre, post, normalization = read_normalizers(folder, config)
    weights = read_weights(folder)
    if any(k.startswith(_LEGACY_PREFIXES) for k in weights):
        raise ConfigError(f'{folder} was saved by LeRobot < 0.4 (its normalizer is inside '
                          f'{WEIGHTS_FILE}); convert it with the script '
                          'lerobot/processor/migrate_policy_normalization.py of LeRobot 0.4')
    policy = ACTPolicy(config, pre, output_stats=post)
    place(policy, weights, folder, device, dtype)
    spec = {'obs_dim': config.state_dim, 'action_dim': config.action_dim,
            'horizon': 1 if policy.ensembling else config.n_action_steps,
            'images': tuple((k, f.shape) for k, f in config.image_features.items()),
            'replan': 'queue_empty', 'normalization': normalization,
            'config': config.to_json()}
    return policy, spec
