"""Typed errors of the runtime; each message says what to do next."""


class FlashRTError(Exception):
    """Base class of every error the runtime raises on purpose."""


class ConfigError(FlashRTError):
    """The configuration (or model id / checkpoint) cannot be used."""


class InvalidNameError(FlashRTError):
    """A capsule name is not allowed (path separators, '..', bad characters, too long)."""


class CapsuleNotFoundError(FlashRTError):
    """No capsule of that name exists in any tier."""


class FingerprintMismatchError(FlashRTError):
    """The capsule was taken from a different model, dtype or state layout."""


class CorruptCapsuleError(FlashRTError):
    """The capsule bytes do not match their checksum, or the file cannot be parsed."""


class BudgetExceededError(FlashRTError):
    """A capsule tier has no room left under its byte budget and its eviction policy."""


class BusyError(FlashRTError):
    """The live state is owned by a running generation."""


class InvalidRequestError(FlashRTError):
    """A request's arguments cannot be served (empty prompt, too long, bad sampling values)."""


class PreemptedError(FlashRTError):
    """A control step was abandoned: a restore or rollback replaced the state while it ran."""
