"""Errors a user can cause. The CLI prints them as one line and exits non-zero; the server maps them to 4xx."""


class KestrelError(Exception):
    """Base of every user-facing error."""


class ConfigError(KestrelError):
    """A config.json or CLI value is missing, unknown or inconsistent."""


class CheckpointError(KestrelError):
    """A checkpoint folder or file is missing, malformed, or does not match the model."""


class TrainingDiverged(KestrelError):
    """A training step's loss or the weights became NaN or infinite: the run stops, its last checkpoint kept."""


class ChatTemplateError(KestrelError, ValueError):
    """A checkpoint's chat template refused the messages (raise_exception, or a template error): the CLI's one
    line, the server's 400 (a ValueError, as the request's other faults)."""
