"""Typed errors. Every user-facing failure is one of these, with a message that names the problem.

The HTTP layer maps them to statuses in one table (serve/errors.py); the CLI prints the message.
"""


class OsdError(Exception):
    """Base class for all osd errors."""


class InvalidArgument(OsdError, ValueError):
    """A request or config value is out of range or malformed (HTTP 400/422)."""


class ContextTooLong(InvalidArgument):
    """Prompt plus max_new_tokens does not fit the model's context window (HTTP 413/400)."""


class DraftNotFound(OsdError, KeyError):
    """A request or call names a draft that does not exist (or was retired) (HTTP 404)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class TokenizerMismatch(OsdError):
    """Draft and target tokenizers differ: speculative decoding would be wrong."""


class ModelNotFound(OsdError, FileNotFoundError):
    """A model path, hub id or bundled model cannot be found (with what to install)."""


class ModelIntegrityError(OsdError):
    """Assembled model bytes have the wrong size or checksum."""


class DatasetNotFound(OsdError, FileNotFoundError):
    """The prompt datasets folder or a dataset file cannot be found."""


class CheckpointMismatch(OsdError):
    """A checkpoint holds only the trained part of a draft and was made on another base draft than the one given."""


class OptimizerStateError(OsdError):
    """A checkpoint's optimizer state cannot be read or does not fit the parameters being trained (names the file
    and why); resuming would otherwise restart the optimizer silently."""


class BackendUnavailable(OsdError):
    """A model backend was asked for that is not installed here (with how to install it)."""


class KernelUnavailable(OsdError):
    """osd's compiled CPU kernels cannot be built or loaded here and no fallback was allowed (with the build error and the fix)."""
