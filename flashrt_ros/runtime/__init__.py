"""Execution-state capsules over a static-buffer, graph-bound engine (no ROS)."""

from .capsule import CapsuleInfo
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
from .runtime import ActionChunk, Generation, GenerationResult, Runtime, TokenEvent

__all__ = [
    'Runtime',
    'RuntimeConfig',
    'CapsuleInfo',
    'GenerationResult',
    'TokenEvent',
    'ActionChunk',
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
