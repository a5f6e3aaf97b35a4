"""
LeRobot's checkpoint folder (release line 0.4.x), read and written as LeRobot does.

A policy saved by LeRobot's training script is a folder holding:

  * ``config.json``        the policy config, its ``type`` first ('act', 'smolvla', ...),
                           ``input_features`` / ``output_features`` as ``{key: {"type":
                           "VISUAL" | "STATE" | "ENV" | "ACTION", "shape": [...]}}``
                           and ``normalization_mapping`` as ``{"VISUAL": "MEAN_STD", ...}``;
  * ``model.safetensors``  the policy's state dict (ACT's keys all start with ``model.``);
  * ``policy_preprocessor.json`` and ``policy_postprocessor.json``, the processor pipelines
    (steps by registry name); the stateful steps keep their tensors beside them, named
    ``<pipeline>_step_<index>_<registry name>.safetensors``. For ACT the normalizer is step 3
    of the preprocessor (rename, to-batch, device, normalizer) and the unnormalizer step 0
    of the postprocessor; each file holds the dataset stats as flat ``'<feature>.<stat>'``
    float32 tensors ('observation.state.mean', 'action.std', image stats shaped [C, 1, 1]).

Normalization is LeRobot's NormalizerProcessorStep arithmetic, operation for operation
(eps 1e-8): MEAN_STD ``(x - mean) / (std + eps)`` and back ``x * std + mean``; MIN_MAX
``2 * (x - min) / d - 1`` and back ``(x + 1) / 2 * d + min`` with ``d = max - min`` (eps where
zero); QUANTILES / QUANTILE10 the same with q01/q99 or q10/q90, back ``(x + 1) * d / 2 + lo``.
A feature without stats, or whose type the mapping leaves out, passes unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import load_file, save_file
import torch

from ..errors import ConfigError

CONFIG_FILE = 'config.json'
WEIGHTS_FILE = 'model.safetensors'
PREPROCESSOR_FILE = 'policy_preprocessor.json'
POSTPROCESSOR_FILE = 'policy_postprocessor.json'
# The policy types LeRobot registers (0.4.x and later releases).
POLICY_TYPES = frozenset({
    'act', 'diffusion', 'groot', 'pi0', 'pi05', 'pi0_fast', 'sac', 'reward_classifier',
    'sarm', 'smolvla', 'tdmpc', 'vqbet', 'wall_x', 'xvla'})
FEATURE_TYPES = ('STATE', 'VISUAL', 'ENV', 'ACTION', 'REWARD', 'LANGUAGE')
NORM_MODES = ('MIN_MAX', 'MEAN_STD', 'IDENTITY', 'QUANTILES', 'QUANTILE10')
NORMALIZER_EPS = 1e-8
OBS_STATE = 'observation.state'
OBS_ENV_STATE = 'observation.environment_state'
OBS_IMAGES = 'observation.images'
ACTION = 'action'
# Stats (low, high) of each range mode; MEAN_STD uses mean and std.
_RANGE_STATS = {'MIN_MAX': ('min', 'max'), 'QUANTILES': ('q01', 'q99'),
                'QUANTILE10': ('q10', 'q90')}
# LeRobot's PreTrainedConfig fields, first in config.json after 'type'; besides n_obs_steps and
# the features only training or the hub read them: accepted, unused.
_BASE_FIELDS = {'n_obs_steps': 1, 'input_features': {}, 'output_features': {}, 'device': 'cpu',
                'use_amp': False, 'use_peft': False, 'push_to_hub': True, 'repo_id': None,
                'private': None, 'tags': None, 'license': None, 'pretrained_path': None}
_IGNORED_FIELDS = (frozenset(_BASE_FIELDS) - {'n_obs_steps', 'input_features', 'output_features'}
                   | {'pretrained_revision'})
# Step registry names the ACT pipelines consist of; anything else would change the data.
_PRE_STEPS = ('rename_observations_processor', 'to_batch_processor', 'device_processor',
              'normalizer_processor')
_POST_STEPS = ('unnormalizer_processor', 'device_processor')
# SmolVLA's preprocessor adds the newline and tokenizer steps (they do not touch the stats).
SMOLVLA_PRE_STEPS = ('rename_observations_processor', 'to_batch_processor',
                     'smolvla_new_line_processor', 'tokenizer_processor', 'device_processor',
                     'normalizer_processor')


@dataclass(frozen=True)
class Feature:
    """One entry of input_features / output_features."""

    kind: str  # its 'type': 'STATE' | 'VISUAL' | 'ENV' | 'ACTION' | ...
    shape: tuple[int, ...]


class LeRobotConfig:
    """What LeRobot's policy configs share: features, the chunk, normalization, the json."""

    @property
    def image_features(self) -> dict[str, Feature]:
        return {k: f for k, f in self.input_features.items() if f.kind == 'VISUAL'}

    @property
    def action_dim(self) -> int:
        return self.output_features[ACTION].shape[0]

    def _check_shared(self, bad) -> None:
        """Check the rules every LeRobot policy config has (images, action, chunk, norms)."""
        for key, f in self.image_features.items():
            if len(f.shape) != 3 or f.shape[0] != 3:
                raise bad('input_features', f'{key}: an image is [3, H, W], got {list(f.shape)}')
        action = self.output_features.get(ACTION)
        if action is None or action.kind != 'ACTION' or len(action.shape) != 1:
            raise bad('output_features', "needs 'action' of type ACTION and shape [dim]")
        if self.n_obs_steps != 1:
            raise bad('n_obs_steps', f'must be 1, got {self.n_obs_steps}')
        if not 1 <= self.n_action_steps <= self.chunk_size:
            raise bad('n_action_steps', f'must be in 1..chunk_size ({self.chunk_size}), got '
                      f'{self.n_action_steps}')
        for ft, mode in self.normalization_mapping.items():
            if ft not in FEATURE_TYPES:
                raise bad('normalization_mapping', f'has unknown feature type {ft!r}')
            if mode not in NORM_MODES:
                raise bad('normalization_mapping', f'{ft}: unknown mode {mode!r}; one of '
                          f'{list(NORM_MODES)}')

    def _json(self, kind: str) -> dict[str, Any]:
        """Return the config.json LeRobot 0.4 writes: its base fields, then the policy's."""
        d = {'type': kind, **_BASE_FIELDS}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if name.endswith('_features'):
                value = {k: {'type': f.kind, 'shape': list(f.shape)} for k, f in value.items()}
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, dict):
                value = dict(value)
            d[name] = value
        return d


@dataclass(frozen=True)
class ACTConfig(LeRobotConfig):
    """LeRobot's ACTConfig: the fields that decide the model, LeRobot's defaults."""

    input_features: dict[str, Feature] = field(default_factory=dict)
    output_features: dict[str, Feature] = field(default_factory=dict)
    n_obs_steps: int = 1
    chunk_size: int = 100
    n_action_steps: int = 100
    normalization_mapping: dict[str, str] = field(default_factory=lambda: {
        'VISUAL': 'MEAN_STD', 'STATE': 'MEAN_STD', 'ACTION': 'MEAN_STD'})
    vision_backbone: str = 'resnet18'
    pretrained_backbone_weights: str | None = 'ResNet18_Weights.IMAGENET1K_V1'
    replace_final_stride_with_dilation: bool = False
    pre_norm: bool = False
    dim_model: int = 512
    n_heads: int = 8
    dim_feedforward: int = 3200
    feedforward_activation: str = 'relu'
    n_encoder_layers: int = 4
    n_decoder_layers: int = 1
    use_vae: bool = True
    latent_dim: int = 32
    n_vae_encoder_layers: int = 4
    temporal_ensemble_coeff: float | None = None
    dropout: float = 0.1
    kl_weight: float = 10.0
    optimizer_lr: float = 1e-5
    optimizer_weight_decay: float = 1e-4
    optimizer_lr_backbone: float = 1e-5

    @property
    def state_dim(self) -> int:
        """Width of the robot state LeRobot's ACT reads ('observation.state'), 0 without."""
        f = self.input_features.get(OBS_STATE)
        return f.shape[0] if f is not None and f.kind == 'STATE' else 0

    @property
    def env_dim(self) -> int:
        f = self.input_features.get(OBS_ENV_STATE)
        return f.shape[0] if f is not None and f.kind == 'ENV' else 0

    @classmethod
    def from_json(cls, d: Any, source: str = CONFIG_FILE) -> 'ACTConfig':
        """Validate an ACT config.json mapping; the ConfigError names the first bad field."""
        def bad(name: str, message: str) -> ConfigError:
            return ConfigError(f'{source}: field {name!r} {message}')

        if not isinstance(d, dict):
            raise ConfigError(f'{source}: must be a JSON object')
        if d.get('type') != 'act':
            raise bad('type', f"must be 'act' for an ACT policy, got {d.get('type')!r}")
        known = set(cls.__dataclass_fields__) | _IGNORED_FIELDS | {'type'}
        for name in d:
            if name not in known:
                raise bad(name, 'is not an ACT config field of LeRobot 0.4 (newer release?)')
        values = {}
        for name in ('input_features', 'output_features'):
            values[name] = _features(d.get(name), name, bad)
        for name in cls.__dataclass_fields__:
            if name in values or name not in d:
                continue
            values[name] = _checked(name, d[name], bad)
        config = cls(**values)
        config._check(bad)
        return config

    def _check(self, bad) -> None:
        """Check the cross-field rules of LeRobot's ACTConfig and what this model supports."""
        self._check_shared(bad)
        for key, f in self.input_features.items():
            if f.kind in ('STATE', 'ENV') and len(f.shape) != 1:
                raise bad('input_features', f'{key}: a state is [dim], got {list(f.shape)}')
            if f.kind == 'ENV' and key != OBS_ENV_STATE:
                raise bad('input_features', f'{key}: ACT reads its environment state from '
                          f'{OBS_ENV_STATE!r} only')
        if not self.image_features and not self.env_dim:
            raise bad('input_features', 'needs at least one image or the environment state')
        if self.temporal_ensemble_coeff is not None and self.n_action_steps != 1:
            raise bad('n_action_steps', 'must be 1 with temporal_ensemble_coeff')
        if self.vision_backbone not in RESNET_LAYERS:
            raise bad('vision_backbone', f'must be one of {sorted(RESNET_LAYERS)}, got '
                      f'{self.vision_backbone!r}')
        if self.replace_final_stride_with_dilation:
            raise bad('replace_final_stride_with_dilation', "must be false (torchvision's "
                      'BasicBlock has no dilation)')
        if self.feedforward_activation not in ('relu', 'gelu'):
            raise bad('feedforward_activation', "must be 'relu' or 'gelu', got "
                      f'{self.feedforward_activation!r}')
        if self.dim_model % self.n_heads:
            raise bad('n_heads', f'must divide dim_model ({self.dim_model})')
        if self.dim_model % 4:
            raise bad('dim_model', 'must be a multiple of 4 (the 2D sine embedding)')

    def to_json(self) -> dict[str, Any]:
        """Return the config.json LeRobot 0.4 writes for it (base fields, then ACT's)."""
        return self._json('act')


# Blocks per stage of the torchvision ResNets built from BasicBlock.
RESNET_LAYERS = {'resnet18': (2, 2, 2, 2), 'resnet34': (3, 4, 6, 3)}
_FIELD_TYPES = {'n_obs_steps': int, 'chunk_size': int, 'n_action_steps': int,
                'normalization_mapping': dict, 'vision_backbone': str,
                'pretrained_backbone_weights': (str, type(None)),
                'replace_final_stride_with_dilation': (bool, int), 'pre_norm': bool,
                'dim_model': int, 'n_heads': int, 'dim_feedforward': int,
                'feedforward_activation': str, 'n_encoder_layers': int,
                'n_decoder_layers': int, 'use_vae': bool, 'latent_dim': int,
                'n_vae_encoder_layers': int, 'temporal_ensemble_coeff': (int, float, type(None)),
                'dropout': (int, float), 'kl_weight': (int, float), 'optimizer_lr': (int, float),
                'optimizer_weight_decay': (int, float), 'optimizer_lr_backbone': (int, float)}
_POSITIVE = ('chunk_size', 'n_action_steps', 'dim_model', 'n_heads', 'dim_feedforward',
             'n_decoder_layers', 'latent_dim', 'n_obs_steps')


def _checked(name: str, value: Any, bad) -> Any:
    kind = _FIELD_TYPES[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in kinds):
        raise bad(name, f'has the wrong type: {value!r}')
    least = 1 if name in _POSITIVE else 0 if kind is int else None
    if least is not None and value < least:
        raise bad(name, f'must be >= {least}, got {value}')
    if name == 'temporal_ensemble_coeff' and value is not None:
        if not math.isfinite(value):
            raise bad(name, f'must be finite, got {value}')
        return float(value)
    if name == 'replace_final_stride_with_dilation':
        return bool(value)
    if name == 'normalization_mapping':
        return dict(value)
    return value


def _features(value: Any, name: str, bad) -> dict[str, Feature]:
    if not isinstance(value, dict):
        raise bad(name, 'must map feature keys to {"type": ..., "shape": [...]}')
    out = {}
    for key, f in value.items():
        if isinstance(f, Feature):
            f = {'type': f.kind, 'shape': f.shape}
        if not isinstance(f, dict) or f.get('type') not in FEATURE_TYPES:
            raise bad(name, f'{key}: type must be one of {list(FEATURE_TYPES)}, got {f!r}')
        shape = f.get('shape')
        if (not isinstance(shape, (list, tuple)) or not shape
                or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                           for n in shape)):
            raise bad(name, f'{key}: shape must be a list of positive integers, got {shape!r}')
        out[key] = Feature(f['type'], tuple(shape))
    return out


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint folder as a mapping (ConfigError when unreadable)."""
    file = Path(path) / CONFIG_FILE
    try:
        d = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f'cannot read {file}: {exc}') from exc
    if not isinstance(d, dict):
        raise ConfigError(f'{file}: must be a JSON object')
    return d


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Return model.safetensors of a checkpoint folder (ConfigError when unreadable)."""
    try:
        return load_file(str(folder / WEIGHTS_FILE))
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f'cannot read {folder / WEIGHTS_FILE}: {exc}') from exc


def place(policy: torch.nn.Module, weights: dict[str, torch.Tensor], folder: Path,
          device, dtype, against: str = 'its config.json') -> None:
    """Load `weights` strictly, then put the policy on `device` and its model in `dtype`."""
    try:
        policy.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise ConfigError(f'{folder / WEIGHTS_FILE} does not match {against}: '
                          f'{exc}'[:2000]) from exc
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    policy.to(device)
    policy.model.to(dtype)  # the normalizer stats (and ACT's ensemble) stay float32
    policy.eval()


def is_lerobot_checkpoint(path: str | Path) -> bool:
    """Whether path is a folder whose config.json names a LeRobot policy type."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        return False
    try:
        d = json.loads(file.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and d.get('type') in POLICY_TYPES


def read_act_config(path: str | Path) -> ACTConfig:
    """Read the ACTConfig of a LeRobot ACT checkpoint folder."""
    return ACTConfig.from_json(read_config(path), str(Path(path) / CONFIG_FILE))


@dataclass(frozen=True)
class NormalizerStats:
    """What one (un)normalizer step of a processor pipeline applies."""

    stats: dict[str, dict[str, torch.Tensor]]  # feature -> stat name -> float32 tensor
    norm_map: dict[str, str]  # feature type -> mode
    eps: float = NORMALIZER_EPS
    source: str = ''  # the safetensors file the stats came from


def read_normalizers(path: str | Path, config: ACTConfig, *,
                     pre_steps: tuple[str, ...] = _PRE_STEPS, family: str = 'ACT'
                     ) -> tuple[NormalizerStats | None, NormalizerStats | None, str]:
    """(input normalizer, output unnormalizer, a sentence on what was found) of a folder."""
    folder = Path(path)
    found = []
    steps = []
    for file, allowed, wanted, features in (
            (PREPROCESSOR_FILE, pre_steps, 'normalizer_processor', config.input_features),
            (POSTPROCESSOR_FILE, _POST_STEPS, 'unnormalizer_processor', config.output_features)):
        step = _pipeline_step(folder / file, allowed, wanted, family)
        if step is not None:
            step = _load_step(folder, file, step, config)
            modes = [f'{k} {step.norm_map.get(f.kind, "IDENTITY").lower()}'
                     for k, f in features.items() if k in step.stats]
            found.append(f'{step.source} ({", ".join(modes) or "no stats of its features"})')
        steps.append(step)
    if not found:
        present = [f for f in (PREPROCESSOR_FILE, POSTPROCESSOR_FILE) if (folder / f).is_file()]
        why = f'{" and ".join(present)} hold no stats' if present else 'no normalizer files'
        return None, None, f'identity ({why})'
    return steps[0], steps[1], 'from ' + '; '.join(found)


def _pipeline_step(file: Path, allowed: tuple[str, ...], wanted: str,
                   family: str = 'ACT') -> dict | None:
    """Return the `wanted` step entry of a pipeline json (None: no file or no stats)."""
    if not file.is_file():
        return None
    try:
        pipeline = json.loads(file.read_text())
        steps = pipeline['steps']
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f'cannot read the processor pipeline {file}: {exc}') from exc
    chosen = None
    for index, step in enumerate(steps):
        name = step.get('registry_name') if isinstance(step, dict) else None
        if name not in allowed:
            raise ConfigError(f'{file}: step {index} ({name or step!r}) is not supported; '
                              f'{family} pipelines have the steps {list(allowed)}')
        if name == 'rename_observations_processor' and step.get('config', {}).get('rename_map'):
            raise ConfigError(f'{file}: step {index} field "rename_map" must be empty (give '
                              'the observation under the names the policy was trained with)')
        if name == wanted and step.get('state_file'):
            chosen = step
    return chosen


def _load_step(folder: Path, file: str, step: dict, config: ACTConfig) -> NormalizerStats:
    cfg = step.get('config', {})
    norm_map = cfg.get('norm_map', config.normalization_mapping)
    if norm_map != config.normalization_mapping:
        raise ConfigError(f'{file}: field "norm_map" {norm_map} differs from config.json\'s '
                          f'normalization_mapping {config.normalization_mapping}')
    eps = cfg.get('eps', NORMALIZER_EPS)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ConfigError(f'{file}: field "eps" must be a number >= 0, got {eps!r}')
    state_file = folder / step['state_file']
    try:
        flat = load_file(str(state_file))
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f'cannot read the normalizer stats {state_file}: {exc}') from exc
    stats: dict[str, dict[str, torch.Tensor]] = {}
    for flat_key, tensor in flat.items():
        key, stat = flat_key.rsplit('.', 1)
        stats.setdefault(key, {})[stat] = tensor.to(torch.float32)
    return NormalizerStats(stats, dict(norm_map), float(eps), state_file.name)


class Normalizer(torch.nn.Module):
    """LeRobot's (un)normalizer for a fixed set of features (see the module docstring)."""

    def __init__(self, features: dict[str, Feature], norms: NormalizerStats | None,
                 inverse: bool):
        super().__init__()
        self.inverse = inverse
        self.modes: dict[str, tuple[str, str, str]] = {}  # key -> mode, buffer names
        if norms is None:
            return
        for i, (key, f) in enumerate(features.items()):
            mode = norms.norm_map.get(f.kind, 'IDENTITY')
            stats = norms.stats.get(key)
            if mode == 'IDENTITY' or stats is None:
                continue
            low, high = _RANGE_STATS.get(mode, ('mean', 'std'))
            if low not in stats or high not in stats:
                raise ConfigError(f'{norms.source}: {mode} of {key!r} needs the stats '
                                  f"'{key}.{low}' and '{key}.{high}'")
            lo, hi = stats[low], stats[high]
            if f.kind == 'VISUAL' and lo.dim() == 1:  # per-channel stats broadcast over H, W
                lo, hi = lo.reshape(-1, 1, 1), hi.reshape(-1, 1, 1)
            if mode == 'MEAN_STD':
                scale = hi if inverse else hi + norms.eps
            else:
                scale = hi - lo
                scale = torch.where(scale == 0, torch.tensor(norms.eps), scale)
            self.register_buffer(f'lo{i}', lo.clone(), persistent=False)
            self.register_buffer(f'scale{i}', scale.clone(), persistent=False)
            self.modes[key] = (mode, f'lo{i}', f'scale{i}')

    def forward(self, key: str, x: torch.Tensor) -> torch.Tensor:
        entry = self.modes.get(key)
        if entry is None:
            return x
        mode, lo, scale = entry
        lo, scale = getattr(self, lo), getattr(self, scale)
        if mode == 'MEAN_STD':
            return x * scale + lo if self.inverse else (x - lo) / scale
        if not self.inverse:
            return 2 * (x - lo) / scale - 1
        if mode == 'MIN_MAX':
            return (x + 1) / 2 * scale + lo
        return (x + 1.0) * scale / 2.0 + lo


# The config save_act_checkpoint starts from: a tiny ACT on one 3x48x64 camera.
TINY_ACT = {
    'input_features': {OBS_STATE: {'type': 'STATE', 'shape': [6]},
                       f'{OBS_IMAGES}.top': {'type': 'VISUAL', 'shape': [3, 48, 64]}},
    'output_features': {ACTION: {'type': 'ACTION', 'shape': [6]}},
    'chunk_size': 10, 'n_action_steps': 10, 'pretrained_backbone_weights': None,
    'dim_model': 32, 'n_heads': 4, 'dim_feedforward': 64, 'n_encoder_layers': 2,
    'n_decoder_layers': 1, 'latent_dim': 8, 'n_vae_encoder_layers': 1,
}


def save_act_checkpoint(directory: str | Path, *, seed: int = 0,
                        stats: dict[str, dict[str, Any]] | None = None,
                        overlay: dict[str, torch.Tensor] | None = None,
                        **config_overrides: Any) -> Path:
    """
    Write a random-weight ACT as LeRobot saves one; return the folder.

    The config is TINY_ACT updated with `config_overrides` (any ACTConfig field;
    features in config.json's form). With `stats` ({feature: {stat: tensor}}) the two
    processor pipelines and their normalizer files are written too, as LeRobot's
    training script does; image stats of shape [C] are stored as [C, 1, 1]. `overlay`
    (LeRobot weight names) replaces those seeded weights: a trained part.
    """
    from .act import ACTPolicy  # act.py reads its config through this module

    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    config = ACTConfig.from_json({'type': 'act', **TINY_ACT, **config_overrides},
                                 'save_act_checkpoint')
    weights = seeded_weights(ACTPolicy(config), seed)
    weights.update(overlay or {})
    (folder / CONFIG_FILE).write_text(json.dumps(config.to_json(), indent=4))
    save_file(weights, str(folder / WEIGHTS_FILE))
    if stats is not None:
        _save_processors(folder, config, stats)
    return folder


def seeded_weights(policy: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights of a plausible scale for every entry of an ACT's state dict."""
    from .act import sine_table

    g = torch.Generator().manual_seed(seed)
    state = policy.model.state_dict()
    weights = {f'model.{k}': _random_like(k, v, g) for k, v in state.items()
               if k != 'vae_encoder_pos_enc'}
    if 'vae_encoder_pos_enc' in state:  # a fixed table, not a weight
        shape = state['vae_encoder_pos_enc'].shape  # [1, tokens, dim_model]
        weights['model.vae_encoder_pos_enc'] = sine_table(shape[1], shape[2]).unsqueeze(0)
    return weights


def _random_like(name: str, t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Seeded values of a plausible scale for one state dict entry."""
    def normal(std):
        return torch.randn(t.shape, generator=g) * std

    leaf = name.rsplit('.', 1)[-1]
    if leaf == 'running_var':
        return torch.rand(t.shape, generator=g) + 0.5
    if leaf == 'running_mean' or leaf == 'bias':
        return normal(0.1)
    is_norm = 'bn' in name or 'norm' in name or 'downsample.1' in name
    if is_norm:  # batch or layer norm weight
        return 1 + normal(0.1)
    if 'embed' in name:
        return normal(1.0)
    return normal(1 / math.sqrt(max(1, t[0].numel())))


def _save_processors(folder: Path, config: ACTConfig, stats: dict) -> None:
    """Write the ACT pre/post-processor pipelines of LeRobot 0.4, their stats beside them."""
    flat = {}
    for key, entries in stats.items():
        f = config.input_features.get(key)
        for stat, value in entries.items():
            t = torch.as_tensor(np.asarray(value) if isinstance(value, (list, tuple)) else value,
                                dtype=torch.float32)  # LeRobot keeps every stat as float32
            if f is not None and f.kind == 'VISUAL' and t.dim() == 1:
                t = t.reshape(-1, 1, 1)
            flat[f'{key}.{stat}'] = t.contiguous()

    def normalizer(features):
        return {'eps': NORMALIZER_EPS,
                'features': {k: {'type': f.kind, 'shape': list(f.shape)}
                             for k, f in features.items()},
                'norm_map': dict(config.normalization_mapping)}

    device = {'registry_name': 'device_processor',
              'config': {'device': 'cpu', 'float_dtype': None}}
    pre_state = 'policy_preprocessor_step_3_normalizer_processor.safetensors'
    post_state = 'policy_postprocessor_step_0_unnormalizer_processor.safetensors'
    pre = {'name': 'policy_preprocessor', 'steps': [
        {'registry_name': 'rename_observations_processor', 'config': {'rename_map': {}}},
        {'registry_name': 'to_batch_processor', 'config': {}},
        device,
        {'registry_name': 'normalizer_processor',
         'config': normalizer({**config.input_features, **config.output_features}),
         'state_file': pre_state}]}
    post = {'name': 'policy_postprocessor', 'steps': [
        {'registry_name': 'unnormalizer_processor',
         'config': normalizer(config.output_features), 'state_file': post_state},
        device]}
    for name, pipeline, state in ((PREPROCESSOR_FILE, pre, pre_state),
                                  (POSTPROCESSOR_FILE, post, post_state)):
        if flat:
            save_file(flat, str(folder / state))
        else:  # LeRobot writes no state file for a normalizer without stats
            del pipeline['steps'][0 if state == post_state else 3]['state_file']
        (folder / name).write_text(json.dumps(pipeline, indent=2))
