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
)
from .generation import Generation, GenerationResult, TokenEvent
from .modes.policy import ActionChunk
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
]
