"""
One driver per mode (language model, robot policy, speech): what the facade delegates to.

driver_for() is the one place that picks a runtime's mode; the facade and the package's
exports reach the modes only through this module.
"""

from .base import Driver
from .lm import LMDriver
from .lm.generation import Generation, GenerationResult, Sampling, TokenEvent
from .policy import ActionChunk, PolicyDriver
from .speech import FedAudio, SpeechDriver, TranscriptEvent

DRIVERS = (PolicyDriver, SpeechDriver, LMDriver)  # the first that serves an adapter runs it


def driver_for(adapter) -> type[Driver]:
    """Return the driver class of `adapter`'s kind of model."""
    return next(driver for driver in DRIVERS if driver.serves(adapter))


__all__ = ['ActionChunk', 'Driver', 'driver_for', 'FedAudio', 'Generation', 'GenerationResult',
           'Sampling', 'TokenEvent', 'TranscriptEvent']
