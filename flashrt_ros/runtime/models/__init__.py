"""Model adapters that bind a model's execution state to the state arena."""

from .base import CausalLMAdapter, PolicyAdapter, StateAdapter
from .builtin import BUILTINS
from .hf import HFCausalLMAdapter, load_adapter, save_builtin

__all__ = [
    'StateAdapter',
    'CausalLMAdapter',
    'PolicyAdapter',
    'HFCausalLMAdapter',
    'load_adapter',
    'save_builtin',
    'BUILTINS',
]
