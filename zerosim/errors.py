"""The error every invalid setting raises: ``ConfigError`` (public as ``zerosim.ConfigError``).

It lives below every other module because both the config reader (``zerosim/config/``) and
the strategies it configures (``zerosim/zero/``, which find some problems only when they build:
an NVMe path a rank cannot write to, too few swap buffers) raise it, and ``zero/`` does not
import ``config/``.
"""

from __future__ import annotations

from typing import Any

_REPR_LIMIT = 120


def short_repr(value: Any) -> str:
    """repr() cut to a readable length, for error messages."""
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."


class ConfigError(ValueError):
    """An invalid config: names the key path, the value received and what is allowed.

    The message reads ``"<path>: got <value>; allowed: <allowed>"``; ``got`` replaces the
    middle part when the problem is not a single value (a file that cannot be read, a
    batch-size product). The parts are kept as attributes ``path``, ``value``, ``allowed``.
    ``ConfigError(message)`` with one argument is also accepted (a complete message that
    already names key, value and what is allowed); its ``value`` and ``allowed`` are None.
    """

    def __init__(
        self, path: str, value: Any = None, allowed: str | None = None, got: str | None = None
    ) -> None:
        self.path = path
        self.value = value
        self.allowed = allowed
        self.got = got
        if allowed is None:
            super().__init__(path)
            return
        got = f"got {short_repr(value)}" if got is None else got
        message = f"{path}: {got}; allowed: {allowed}"
        if isinstance(value, str) and value.lower() == "auto":
            message += " ('auto' is filled in by the HuggingFace integration, not by DeepSpeed)"
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.value, self.allowed, self.got))
