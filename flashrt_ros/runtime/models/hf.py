"""
transformers causal LMs whose StaticCache tensors are views into the StateArena.

The state binding itself is models/binding.CacheBinding; this module loads a checkpoint
(or builds a built-in model), wraps it as a CausalLMAdapter and fingerprints it, and reads
the checkpoint's own settings: its dtype (config.json) and its generation_config.json (EOS
ids, sampling defaults).
"""

from __future__ import annotations

from dataclasses import dataclass
import json
from pathlib import Path

import torch

from . import cpu_step, pieces, widen
from .base import CausalLMAdapter
from .binding import BindingDelegate, CacheBinding, module_fingerprint, PROBE_TOKENS
from .builtin import TRAINED_DIR
from .fastpath import DecodeFastPath, refusal
from .kernels import route_kernels
from .tokenizer import ByteTokenizer, HFTokenizer
from ..errors import ConfigError
from ..inference import inference
from ..state.arena import StateSpec

DEFAULT_MODEL = 'default'  # the short name of the trained checkpoint installed with the package
DEFAULT_DIR = TRAINED_DIR / 'default'

# Config keys that say where/how a model was saved, not what it computes; left out of the
# fingerprint so a built-in model and its save_pretrained copy are the same model.
_VOLATILE_CONFIG_KEYS = {
    '_name_or_path',
    'architectures',
    'transformers_version',
    'dtype',
    'torch_dtype',
    '_attn_implementation',
    '_attn_implementation_autoset',
    'attn_implementation',
    'use_cache',
    'output_attentions',
    'output_hidden_states',
    'return_dict',
    '_commit_hash',
    'auto_map',
}


_SAVED_DTYPES = ('float32', 'bfloat16', 'float16')


@dataclass(frozen=True)
class GenerationDefaults:
    """A checkpoint's generation_config.json: what a turn uses when the caller says nothing."""

    eos_ids: tuple[int, ...] = ()
    temperature: float = 0.0  # 0: greedy (the checkpoint does not sample: do_sample false)
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off


def _json_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # missing or unreadable: the load itself says what is wrong with the folder
    return data if isinstance(data, dict) else {}


def _id_list(value) -> tuple[int, ...]:
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return () if value is None else (int(value),)


def checkpoint_dtype(model_id: str) -> str:
    """Return the dtype a checkpoint was saved in (float32 for built-ins or when unsaid)."""
    if model_id.startswith('builtin:'):
        return 'float32'
    config = _json_file(Path(model_id).expanduser() / 'config.json')
    text = config.get('text_config') if isinstance(config.get('text_config'), dict) else {}
    name = config.get('dtype') or config.get('torch_dtype') or text.get('dtype') or text.get(
        'torch_dtype')
    name = str(name).removeprefix('torch.')
    return name if name in _SAVED_DTYPES else 'float32'


def generation_defaults(path: Path) -> GenerationDefaults:
    """Read generation_config.json (transformers' defaults where a sampling value is unsaid)."""
    config = _json_file(path / 'generation_config.json')
    try:
        eos = _id_list(config.get('eos_token_id'))
        if not config.get('do_sample'):
            return GenerationDefaults(eos)
        return GenerationDefaults(eos, float(config.get('temperature', 1.0)),
                                  int(config.get('top_k', 50) or 0),
                                  float(config.get('top_p', 1.0)))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f'{str(path / "generation_config.json")!r} has a bad value ({exc}); '
                          'fix or delete it') from exc


class HFCausalLMAdapter(BindingDelegate, CausalLMAdapter):
    """A transformers causal LM running over a StaticCache bound to arena views."""

    def __init__(self, model, tokenizer, max_seq_len: int, model_id: str,
                 generation: GenerationDefaults = GenerationDefaults(), use_cpu_step=True):
        self.model = model.eval()
        self.generation = generation
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.config = model.config.get_text_config(decoder=True)
        self.family = str(getattr(self.config, 'model_type', 'unknown'))
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_seq_len = max_seq_len
        first = next(self.model.parameters())
        self.device, self.dtype = first.device, first.dtype
        self.kernels = route_kernels(self.model, self.device)  # before the probe runs them
        pieces.install(self.model)
        if widen.install(self.model):
            self.kernels = tuple(sorted(self.kernels + (widen.KERNEL,)))
        self.binding = CacheBinding(self.model.config, max_seq_len, self.family, self._probe)
        self.cache = self.binding.cache
        self.fastpath: DecodeFastPath | None = None  # built in bind(), when the model allows
        self.fastpath_note = refusal(self.model, self.config)  # why not (None: it is used)
        # The compiled CPU step (models/cpu_step.py) runs decode steps nothing observes.
        self.cpu_step: cpu_step.CpuDecode | None = None
        self.cpu_step_note = ('off (cpu_step: false)' if not use_cpu_step else
                              None if self.fastpath_note is None else
                              f'no decode fast path: {self.fastpath_note}')

    @torch.inference_mode()
    def _probe(self, cache) -> None:
        ids = torch.arange(PROBE_TOKENS, device=self.device).unsqueeze(0)  # [1, P]
        self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)

    # ---- the state contract, kept by the cache binding ---------------------------------

    def bind(self, views: dict[str, torch.Tensor]) -> None:
        super().bind(views)
        if self.fastpath_note is None:
            self.fastpath = DecodeFastPath(self.model, self.config, views, self.max_seq_len)
        if self.cpu_step_note is None:
            self.cpu_step_note = cpu_step.refusal(self.model, self.config, views)
        if self.cpu_step_note is None:
            self.cpu_step = cpu_step.CpuDecode(self.model, self.fastpath.layers,
                                               self.max_seq_len)

    @property
    def has_sliding_layers(self) -> bool:
        return self.binding.has_sliding_layers

    def state_specs(self) -> list[StateSpec]:
        return list(self.binding.specs)

    def prepare_capture(self) -> None:
        self.binding.prepare_capture()

    def decode_ready(self) -> bool:
        return self.binding.decode_ready()

    # ---- compute ---------------------------------------------------------------------

    @inference
    def forward(self, input_ids: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
        if (self.fastpath is not None and kv_len is not None and input_ids.shape[1] == 1
                and self.binding.decode_ready()):
            if self.cpu_step is not None and not self.cpu_step.observed():
                return self.cpu_step.step(int(input_ids), kv_len)
            return self.fastpath.step(input_ids, kv_len)
        self.binding.set_window(kv_len)
        out = self.model(input_ids=input_ids, cache=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]  # [1, V]

    def fingerprint(self) -> str:
        """Hash config (minus save-location keys), dtype, parameter shapes, weight sample."""
        cfg = {
            k: v for k, v in self.model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS
        }
        return module_fingerprint(cfg, self.model, self.dtype)


def load_adapter(
    model_id: str, device: torch.device, dtype: torch.dtype, max_seq_len: int,
    cpu_step: bool = True
) -> HFCausalLMAdapter:
    """Load `default`, `builtin:<id>` or a local checkpoint directory (never downloads)."""
    if model_id.startswith('builtin:'):
        from .builtin import build_builtin

        model = build_builtin(model_id.split(':', 1)[1], dtype)
        tokenizer, generation = ByteTokenizer(), GenerationDefaults()
    else:
        path = Path(resolve_model(model_id)).expanduser()
        model, tokenizer, generation = _load_local(path, dtype)
    return HFCausalLMAdapter(model.to(device), tokenizer, max_seq_len, model_id, generation,
                             use_cpu_step=cpu_step)


def resolve_model(model_id: str) -> str:
    """Return the folder a short model name stands for; any other model id as given."""
    return str(DEFAULT_DIR) if model_id == DEFAULT_MODEL else model_id


def _load_local(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    if not path.is_dir():
        raise ConfigError(
            f"model {str(path)!r} is neither 'default', 'builtin:<id>' nor an existing "
            'checkpoint directory')
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
    except Exception as exc:  # transformers raises many types for a bad checkpoint
        raise ConfigError(f'cannot load a causal LM from {str(path)!r}: {exc}') from exc
    generation = generation_defaults(path)
    eos_ids = _id_list(model.config.get_text_config(decoder=True).eos_token_id) + (
        generation.eos_ids)
    return model, checkpoint_tokenizer(path, eos_ids), generation


def checkpoint_tokenizer(path: Path, eos_ids=()):
    """Return the tokenizer saved next to a checkpoint's weights (ConfigError if none)."""
    if ByteTokenizer.saved_in(path):
        return ByteTokenizer()
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise ConfigError(
            f'checkpoint {str(path)!r} has no usable tokenizer ({exc}); '
            'save one with tokenizer.save_pretrained() next to the weights'
        ) from exc
    return HFTokenizer(tok, tuple(eos_ids))


def save_builtin(model_id: str, directory: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write a built-in model (weights + byte tokenizer marker) as a normal checkpoint dir."""
    from .builtin import build_builtin

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    build_builtin(model_id.removeprefix('builtin:'), dtype).save_pretrained(str(out))
    ByteTokenizer().save(out)
    return out
