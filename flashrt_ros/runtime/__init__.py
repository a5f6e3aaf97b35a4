"""Execution-state capsules over a static-buffer, graph-bound engine (no ROS)."""

from .config import RuntimeConfig
from .errors import (
    BudgetExceededError,
    BusyError,
    CapsuleNotFoundError,
    ConfigError,
    CorruptCapsuleError,
    FingerprintMismatchError,
    FlashRTError,
    InvalidNameError,
    InvalidRequestError,
    PreemptedError,
)
from .modes import ActionChunk, Generation, GenerationResult, TokenEvent
from .runtime import Runtime
from .state.capsule import CapsuleInfo
from .stats import RuntimeStats

__all__ = [
    'Runtime',
    'RuntimeConfig',
    'CapsuleInfo',
    'GenerationResult',
    'TokenEvent',
    'ActionChunk',
    'RuntimeStats',
    'Generation',
    'FlashRTError',
    'InvalidNameError',
    'CapsuleNotFoundError',
    'FingerprintMismatchError',
    'CorruptCapsuleError',
    'BudgetExceededError',
    'BusyError',
    'ConfigError',
    'InvalidRequestError',
    'PreemptedError',
]
