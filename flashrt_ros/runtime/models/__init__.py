"""Model adapters that bind a model's execution state to the state arena."""

from .base import CausalLMAdapter, PolicyAdapter, PolicySpec, StateAdapter
from .binding import CacheBinding
from .builtin import BUILTINS, POLICY_BUILTINS
from .hf import checkpoint_dtype, HFCausalLMAdapter, load_adapter, resolve_model, save_builtin
from .policy import is_policy_model, load_policy, ModulePolicyAdapter, PolicyConfig
from .policy import save_policy, SequencePolicy
from .speech import is_speech_model, load_speech

__all__ = [
    'StateAdapter',
    'CausalLMAdapter',
    'PolicyAdapter',
    'PolicySpec',
    'HFCausalLMAdapter',
    'CacheBinding',
    'load_adapter',
    'save_builtin',
    'BUILTINS',
    'POLICY_BUILTINS',
    'ModulePolicyAdapter',
    'SequencePolicy',
    'PolicyConfig',
    'is_policy_model',
    'load_policy',
    'save_policy',
    'default_dtype',
    'load_model',
]


def default_dtype(model_id: str) -> str:
    """Return the dtype 'auto' stands for: float32 for a policy, else the checkpoint's."""
    model = resolve_model(model_id)
    return 'float32' if is_policy_model(model) else checkpoint_dtype(model)


def load_model(model_id: str, device, dtype, max_seq_len: int,
               cpu_step: bool = True) -> StateAdapter:
    """Load a model id as the adapter of its kind: a robot policy, a speech model or an LM."""
    model = resolve_model(model_id)
    if is_policy_model(model):
        return load_policy(model_id, device, dtype, max_seq_len)
    if is_speech_model(model):
        return load_speech(model_id, device, dtype, max_seq_len)
    return load_adapter(model_id, device, dtype, max_seq_len, cpu_step=cpu_step)
