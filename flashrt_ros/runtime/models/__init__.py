"""Model adapters that bind a model's execution state to the state arena."""

from .base import CausalLMAdapter, PolicyAdapter, PolicySpec, StateAdapter
from .binding import CacheBinding
from .builtin import BUILTINS, POLICY_BUILTINS
from .hf import HFCausalLMAdapter, load_adapter, save_builtin
from .policy import is_policy_model, load_policy, ModulePolicyAdapter, PolicyConfig
from .policy import save_policy, SequencePolicy

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
]
