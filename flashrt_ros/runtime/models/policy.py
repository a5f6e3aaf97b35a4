"""
Robot policies whose complete execution state lives in the StateArena.

A policy is a stateful sequence model over observation vectors: every control step folds
one observation into its state and yields a chunk of `horizon x action_dim` actions. The
runtime (Runtime.act) keeps that chunk and the queue of its not-yet-executed actions in the
arena as well, so a capsule holds everything the next step depends on: backbone state,
observation step counter (the runtime's position), action queue and RNG.

Built-in module: `SequencePolicy` = observation encoder (MLP) -> transformers hybrid
backbone fed `inputs_embeds` (Qwen3-Next, LFM2, Mamba2, ...; its StaticCache is bound to the
arena by models/binding.CacheBinding, exactly like a language model's) -> action head
(`action_scale * tanh(.)`, optional Gaussian noise drawn from the runtime's RNG).

Loading (`model` of the RuntimeConfig):
  * `builtin:tiny-policy` - seeded random weights (models/builtin.POLICY_BUILTINS);
  * `builtin:act-arm` - a seeded ACT written once in LeRobot's format to the cache folder
    (models/builtin.LEROBOT_BUILTINS) and loaded from there like any LeRobot checkpoint;
  * a LeRobot checkpoint folder (`config.json` with its `type`, `model.safetensors`, the
    normalizer files; models/lerobot.py): ACT (models/act.py) or SmolVLA (models/smolvla.py,
    its VLM's config and tokenizer from a local folder: the checkpoint's `vlm_model_name`
    if that is a folder, else $FLASHRT_VLM_PATH);
  * a directory holding `policy.json` (or `policy.yaml`) and `model.safetensors`:

        {"obs_dim": 4, "action_dim": 2, "horizon": 8,
         "joint_names": ["shoulder", "elbow"],
         "observation_names": ["shoulder/position", "elbow/position",
                               "shoulder/velocity", "elbow/velocity"],
         "action_scale": 2.0, "action_noise_std": 0.0,
         "backbone": {"model_type": "lfm2", "hidden_size": 64, ...}}

    `save_policy()` writes one; `observation_names` tell the ROS node how to build the
    vector from a sensor_msgs/JointState ('<joint>/position|velocity|effort').

Extension point - your own torch policy. Any nn.Module with these methods can be served:

    class MyPolicy(torch.nn.Module):
        def state_specs(self, max_steps):      # -> list[StateSpec]
            # Every tensor carried from one step to the next (GRU hidden state, a buffer of
            # past frames, ...): name, kind, shape, dtype. Kinds 'conv' and 'recurrent' are
            # what the kv_only ablation leaves alone; a 'kv' tensor may give seq_dim (rows
            # >= the position must stay zero, a step writes rows >= its position only) so
            # capsules copy only the used prefix and restores skip rows already live. One
            # of length max_steps (= the runtime's max_seq_len) is a strided view, its rows
            # interleaved with the other sequence tensors': index it, copy_ into it, and
            # reshape() rather than view() it.
        def bind(self, views):                 # views: dict name -> arena tensor
            # Keep these views; read and write state ONLY through them, in place
            # (view.copy_(new)). Never reassign or allocate state afterwards.
        def forward(self, observations, position, generator):
            # observations [T, obs_dim] (steps position .. position+T-1) -> actions
            # [horizon, action_dim] for the last one; draw any noise from `generator`.
            # With the class attribute `dict_observations = True` it gets the observation
            # dict instead ('observation.state' [T, obs_dim], 'observation.images.<camera>'
            # [3, H, W] in [0, 1]; modes/policy.py), as a LeRobot-format policy does.
        # Optional: export_meta() -> dict, import_meta(dict), reset_meta() for state that is
        # not in tensors (JSON-able; it travels in every capsule; import_meta gets a copy it
        # may keep), and check_meta(dict) raising ValueError for a capsule's meta that
        # import_meta could not take (called before a restore writes anything).

    The arena starts zeroed and reset() zeroes it again: zero must mean "no state yet" for
    every declared buffer. Serve it from Python:

        rt = Runtime(cfg, adapter=ModulePolicyAdapter(MyPolicy(), PolicySpec(4, 2, 8),
                                                      max_steps=cfg.max_seq_len))

    or from a checkpoint directory whose policy.json names the class instead of a backbone:
    `"module": "my_package.policies:MyPolicy", "module_kwargs": {...}` (built as
    `MyPolicy(**module_kwargs)`, weights from model.safetensors; the ROS node can load it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import importlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from .base import PolicyAdapter, PolicySpec
from .binding import BindingDelegate, CacheBinding, module_fingerprint, PROBE_TOKENS
from .builtin import LEROBOT_BUILTINS, POLICY_BUILTINS, SEED, TRAINED_DIR
from .kernels import route_kernels
from ..errors import ConfigError, FlashRTError
from ..state.arena import StateSpec

CONFIG_FILES = ('policy.json', 'policy.yaml', 'policy.yml')
WEIGHTS_FILE = 'model.safetensors'
_CONFIG_KEYS = frozenset({'obs_dim', 'action_dim', 'horizon', 'joint_names', 'observation_names',
                          'backbone', 'action_scale', 'action_noise_std', 'module',
                          'module_kwargs', 'images', 'replan'})
REPLANS = ('every_step', 'queue_empty')


@dataclass(frozen=True)
class PolicyConfig:
    """The contents of policy.json: the interface (spec) and how to build the module."""

    spec: PolicySpec
    backbone: dict[str, Any]  # transformers config of the backbone, with its 'model_type'
    action_scale: float = 1.0  # actions = action_scale * tanh(head output + noise)
    action_noise_std: float = 0.0  # std of that noise, drawn from the runtime's RNG
    module: str = ''  # 'package.module:Class' of your own policy module, or ''
    module_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Any, source: str) -> 'PolicyConfig':
        """Validate a policy.json mapping; the ConfigError names the first bad field."""
        def bad(message: str) -> ConfigError:
            return ConfigError(f'policy config {source}: {message}')

        if not isinstance(d, dict):
            raise bad('must be a mapping of field names to values')
        unknown = sorted(set(d) - _CONFIG_KEYS)
        if unknown:
            raise bad(f'unknown keys {unknown}; valid keys are {sorted(_CONFIG_KEYS)}')
        dims = {}
        for key in ('obs_dim', 'action_dim', 'horizon'):
            value = d.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(f'{key} must be an integer >= 1, got {value!r}')
            dims[key] = value
        names = {}
        for key, size in (('joint_names', dims['action_dim']),
                          ('observation_names', dims['obs_dim'])):
            value = d.get(key, [])
            if (not isinstance(value, list) or len(value) not in (0, size)
                    or not all(isinstance(n, str) and n for n in value)):
                raise bad(f'{key} must be a list of {size} non-empty names, or empty')
            names[key] = tuple(value)
        scale, noise = d.get('action_scale', 1.0), d.get('action_noise_std', 0.0)
        if not (_finite(scale) and scale > 0 and _finite(noise) and noise >= 0):
            raise bad('need a finite action_scale > 0 and action_noise_std >= 0')
        module, backbone = d.get('module', ''), d.get('backbone', {})
        kwargs = d.get('module_kwargs', {})
        if not isinstance(module, str) or (module and ':' not in module):
            raise bad("module must be 'package.module:Class' or empty")
        if not module and (not isinstance(backbone, dict) or 'model_type' not in backbone):
            raise bad("backbone must be a transformers config mapping with a 'model_type'")
        if not isinstance(kwargs, dict):
            raise bad('module_kwargs must be a mapping')
        images = d.get('images', [])
        if not isinstance(images, list) or not all(
                isinstance(i, list) and len(i) == 2 and isinstance(i[0], str)
                and i[0].startswith('observation.images.') and isinstance(i[1], list)
                and len(i[1]) == 3 and i[1][0] == 3
                and all(type(n) is int and n > 0 for n in i[1]) for i in images):
            raise bad("images must be a list of ['observation.images.<camera>', [3, H, W]]")
        if images and not module:
            raise bad('images need your own module (the built-in backbone takes vectors)')
        replan = d.get('replan', 'every_step')
        if replan not in REPLANS:
            raise bad(f"replan must be one of {', '.join(REPLANS)}, got {replan!r}")
        spec = PolicySpec(**dims, **names, images=tuple((k, tuple(v)) for k, v in images),
                          replan=replan)
        return cls(spec, dict(backbone), float(scale), float(noise), module, dict(kwargs))

    def to_dict(self) -> dict[str, Any]:
        return {**spec_dict(self.spec), 'backbone': self.backbone,
                'action_scale': self.action_scale,
                'action_noise_std': self.action_noise_std, 'module': self.module,
                'module_kwargs': self.module_kwargs}


def spec_dict(spec: PolicySpec) -> dict[str, Any]:
    """Return the spec as policy.json holds it (JSON-able; part of the fingerprint)."""
    d = dataclasses.asdict(spec)
    d.update(joint_names=list(spec.joint_names), observation_names=list(spec.observation_names),
             images=[[k, list(v)] for k, v in spec.images])
    del d['note']
    for key, default in (('images', []), ('replan', 'every_step')):
        if d[key] == default:  # left out: the fingerprints of earlier checkpoints still hold
            del d[key]
    return d


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class SequencePolicy(BindingDelegate, torch.nn.Module):
    """Observation encoder -> transformers hybrid backbone (inputs_embeds) -> action head."""

    def __init__(self, config: PolicyConfig):
        super().__init__()
        import transformers

        try:
            backbone_config = transformers.AutoConfig.for_model(**config.backbone)
        except (KeyError, ValueError, TypeError) as exc:
            raise ConfigError(f'policy backbone config is not usable: {exc!r}') from exc
        spec, hidden = config.spec, backbone_config.hidden_size
        self.family = str(backbone_config.model_type)
        self.horizon, self.action_dim = spec.horizon, spec.action_dim
        self.action_scale, self.noise_std = config.action_scale, config.action_noise_std
        self.encoder = torch.nn.Sequential(torch.nn.Linear(spec.obs_dim, hidden), torch.nn.SiLU(),
                                           torch.nn.Linear(hidden, hidden))
        self.backbone = transformers.AutoModel.from_config(backbone_config)
        self.head = torch.nn.Linear(hidden, spec.horizon * spec.action_dim)
        self.binding: CacheBinding | None = None  # made by state_specs(), on the final device

    # ---- the state contract, kept by the backbone's cache binding ----------------------

    def state_specs(self, max_steps: int) -> list[StateSpec]:
        if self.binding is None:
            self.binding = CacheBinding(self.backbone.config, max_steps, self.family,
                                        self._probe)
        return list(self.binding.specs)

    @torch.inference_mode()
    def _probe(self, cache) -> None:
        p = next(self.parameters())
        x = torch.zeros(1, PROBE_TOKENS, self.backbone.config.hidden_size, device=p.device,
                        dtype=p.dtype)  # [1, P, hidden]
        self.backbone(inputs_embeds=x, cache=cache, use_cache=True)

    # ---- compute ---------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, observations: torch.Tensor, position: int,
                generator: torch.Generator) -> torch.Tensor:
        self.binding.set_window(position + observations.shape[0])
        x = self.encoder(observations).unsqueeze(0)  # [1, T, hidden]
        out = self.backbone(inputs_embeds=x, cache=self.binding.cache, use_cache=True)
        z = self.head(out.last_hidden_state[0, -1]).float()  # [H * A]
        z = z.view(self.horizon, self.action_dim)  # [H, A]
        if self.noise_std > 0:
            z = z + self.noise_std * torch.randn(z.shape, generator=generator, device=z.device)
        return self.action_scale * torch.tanh(z)


class ModulePolicyAdapter(PolicyAdapter):
    """Serve a torch module that declares its own state buffers (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, spec: PolicySpec, max_steps: int,
                 identity: dict[str, Any] | None = None, model_id: str = ''):
        self.module = module.eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.spec, self.max_steps, self.model_id = spec, max_steps, model_id
        first = next(self.module.parameters(), None)
        self.device = first.device if first is not None else None  # the runtime sets it
        self.dtype = first.dtype if first is not None else torch.float32
        if first is not None:  # before state_specs() probes a transformers backbone
            self.kernels = route_kernels(self.module, self.device)
        self.family = 'policy/' + str(getattr(module, 'family', type(module).__name__))
        self._identity = identity or {'module': type(module).__qualname__,
                                      'spec': spec_dict(spec)}
        self._specs = list(self.module.state_specs(max_steps))

    def state_specs(self) -> list[StateSpec]:
        return list(self._specs)

    def bind(self, views: dict[str, torch.Tensor]) -> None:
        self.module.bind({s.name: views[s.name] for s in self._specs})

    def export_meta(self) -> dict[str, Any]:
        meta = dict(self.module.export_meta()) if hasattr(self.module, 'export_meta') else {}
        meta.setdefault('layers', {})  # the runtime checks every capsule's meta for this key
        return meta

    @property
    def meta_trusted(self) -> bool:
        """Whether the module's meta hooks are the cache binding's own (or absent)."""
        cls = type(self.module)
        return all(getattr(cls, hook, None) in (None, getattr(BindingDelegate, hook))
                   for hook in ('export_meta', 'import_meta', 'check_meta'))

    def import_meta(self, meta: dict[str, Any]) -> None:
        if hasattr(self.module, 'import_meta'):
            self.module.import_meta(meta)

    def check_meta(self, meta: dict[str, Any]) -> None:
        if hasattr(self.module, 'check_meta'):
            self.module.check_meta(meta)

    def reset_meta(self) -> None:
        if hasattr(self.module, 'reset_meta'):
            self.module.reset_meta()

    @torch.no_grad()  # not inference_mode: a module may enable_grad inside (test-time steps)
    def act(self, observation: dict[str, torch.Tensor], position: int,
            generator: torch.Generator) -> torch.Tensor:
        x = {k: v.to(self.device, self.dtype) for k, v in observation.items()}
        if not getattr(self.module, 'dict_observations', False):
            x = x['observation.state']  # [T, obs_dim]: a module of the vector contract
        return self._checked(self.module(x, position, generator))

    def _checked(self, actions: torch.Tensor) -> torch.Tensor:
        if tuple(actions.shape) != (self.spec.horizon, self.spec.action_dim):
            raise FlashRTError(
                f'policy module returned actions of shape {tuple(actions.shape)}; expected '
                f'[horizon, action_dim] = [{self.spec.horizon}, {self.spec.action_dim}]'
            )
        return actions

    @property
    def takes_instruction(self) -> bool:
        """Whether the module keeps an instruction (a VLA's `instruct(text)`)."""
        return callable(getattr(self.module, 'instruct', None))

    @property
    def has_prefix(self) -> bool:
        """Whether the module encodes a prefix once and samples chunks from it."""
        return all(callable(getattr(self.module, m, None)) for m in ('prefix', 'sample'))

    @torch.no_grad()
    def instruct(self, text: str) -> None:
        self.module.instruct(text)

    @torch.no_grad()
    def prefix(self, observation: dict[str, torch.Tensor]) -> None:
        self.module.prefix({k: v.to(self.device, self.dtype) for k, v in observation.items()})

    @torch.no_grad()
    def sample(self, generator: torch.Generator) -> torch.Tensor:
        return self._checked(self.module.sample(generator))

    def fingerprint(self) -> str:
        return module_fingerprint(self._identity, self.module, self.dtype)


# ---- loading and saving ---------------------------------------------------------------


def is_policy_model(model_id: str) -> bool:
    """Whether `model` names a built-in policy, a policy.json folder or a LeRobot checkpoint."""
    from .lerobot import is_lerobot_checkpoint

    if model_id.startswith('builtin:'):
        name = model_id.split(':', 1)[1]
        return name in POLICY_BUILTINS or name in LEROBOT_BUILTINS
    path = Path(model_id).expanduser()
    return (any((path / name).is_file() for name in CONFIG_FILES)
            or is_lerobot_checkpoint(path))


def read_config(path: Path) -> PolicyConfig:
    """Parse policy.json / policy.yaml of a checkpoint directory."""
    import yaml

    for name in CONFIG_FILES:
        if (path / name).is_file():
            file = path / name
            break
    else:
        raise ConfigError(f'{str(path)!r} holds no policy config ({", ".join(CONFIG_FILES)})')
    try:
        text = file.read_text()
        values = json.loads(text) if file.suffix == '.json' else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f'cannot read policy config {str(file)!r}: {exc}') from exc
    return PolicyConfig.from_dict(values, repr(str(file)))


def build_module(config: PolicyConfig) -> torch.nn.Module:
    """Build the SequencePolicy of the config, or the user module it names."""
    if not config.module:
        return SequencePolicy(config)
    module_name, _, class_name = config.module.partition(':')
    try:
        return getattr(importlib.import_module(module_name), class_name)(**config.module_kwargs)
    except Exception as exc:  # import errors, a missing class, the user's own constructor
        raise ConfigError(f'cannot build policy module {config.module!r}: {exc!r}') from exc


def load_policy(model_id: str, device: torch.device, dtype: torch.dtype,
                max_steps: int) -> ModulePolicyAdapter:
    """`builtin:<policy>` or a local policy checkpoint directory (never downloads)."""
    from .lerobot import is_lerobot_checkpoint

    name = model_id.split(':', 1)[1] if model_id.startswith('builtin:') else ''
    if name in LEROBOT_BUILTINS:
        return load_lerobot(str(builtin_checkpoint(name)), device, dtype, max_steps, model_id)
    if not name and is_lerobot_checkpoint(Path(model_id).expanduser()):
        return load_lerobot(model_id, device, dtype, max_steps)
    if model_id.startswith('builtin:'):
        config = PolicyConfig.from_dict(POLICY_BUILTINS[model_id.split(':', 1)[1]], model_id)
        # Weights come from a private RNG so building never disturbs the caller's seed.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            module = build_module(config)
    else:
        from safetensors.torch import load_file

        path = Path(model_id).expanduser()
        config = read_config(path)
        module = build_module(config)
        try:
            module.load_state_dict(load_file(str(path / WEIGHTS_FILE)), strict=True)
        except Exception as exc:  # missing file, bad header, missing or unexpected keys
            raise ConfigError(
                f'cannot load policy weights {str(path / WEIGHTS_FILE)!r}: {exc}'
            ) from exc
    module = module.to(device=device, dtype=dtype)
    return ModulePolicyAdapter(module, config.spec, max_steps, config.to_dict(), model_id)


def builtin_checkpoint(name: str) -> Path:
    """
    Return the folder of LeRobot-format built-in `name`, writing it first if need be.

    A trained built-in's weights are its seeded ones with its folder's trained.safetensors
    laid over them, its normalizer stats those of its training.json.

    It lives in the user's cache under a digest of its recipe, so a changed recipe is a new
    folder; it is written to a temporary folder and renamed, so a reader never sees half.
    """
    import hashlib
    import os
    import shutil
    import tempfile

    from .lerobot import save_act_checkpoint

    recipe = LEROBOT_BUILTINS[name]
    trained = TRAINED_DIR / recipe['trained'] if 'trained' in recipe else None
    overlay_bytes = (trained / 'trained.safetensors').read_bytes() if trained else b''
    stats = (json.loads((trained / 'training.json').read_text())['stats'] if trained
             else recipe['stats'])
    digest = hashlib.sha256(json.dumps([recipe, SEED, stats], sort_keys=True).encode()
                            + overlay_bytes).hexdigest()
    cache = Path(os.environ.get('XDG_CACHE_HOME') or Path.home() / '.cache')
    folder = cache / 'flashrt_ros' / 'builtin' / f'{name}-{digest[:12]}'
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f'.{name}-', dir=folder.parent))
    try:
        from safetensors.torch import load as load_tensors

        stats = {k: {s: torch.tensor(v) for s, v in d.items()} for k, d in stats.items()}
        overlay = load_tensors(overlay_bytes) if trained else None
        save_act_checkpoint(scratch, seed=SEED, stats=stats, overlay=overlay, **recipe['config'])
        os.rename(scratch, folder)
    except OSError:
        if not folder.is_dir():  # not another process's rename that won: a real failure
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


def load_lerobot(path: str, device: torch.device, dtype: torch.dtype, max_steps: int,
                 model_id: str = '') -> ModulePolicyAdapter:
    """Load a LeRobot checkpoint folder (config.json, model.safetensors, normalizer files)."""
    from .act import load_act
    from .lerobot import read_config
    from .smolvla import load_smolvla

    folder = Path(path).expanduser()
    kind = read_config(folder).get('type')
    loaders = {'act': load_act, 'smolvla': load_smolvla}
    if kind not in loaders:
        raise ConfigError(f'{str(folder)!r} is a LeRobot {kind!r} policy; the policies served '
                          f'are {", ".join(loaders)}')
    module, fields = loaders[kind](folder, device, dtype)
    spec = PolicySpec(fields['obs_dim'], fields['action_dim'], fields['horizon'],
                      images=tuple((k, tuple(v)) for k, v in fields['images']),
                      replan=fields['replan'], note=fields['normalization'])
    identity = {'lerobot': fields['config'], 'spec': spec_dict(spec)}
    return ModulePolicyAdapter(module, spec, max_steps, identity, model_id or path)


def save_policy(model_id: str, directory: str | Path) -> Path:
    """Write a policy (built-in or a checkpoint) as policy.json + model.safetensors."""
    from safetensors.torch import save_file

    adapter = load_policy(model_id, torch.device('cpu'), torch.float32, max_steps=8)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / 'policy.json').write_text(json.dumps(adapter._identity, indent=2) + '\n')
    state = {k: v.contiguous() for k, v in adapter.module.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE))
    return out
