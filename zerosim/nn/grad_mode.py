"""Whether forward passes save activations for a backward: ``no_grad()`` and ``enable_grad()``.

zerosim has no autograd graph; "grad mode" only decides whether each layer pushes
what its backward needs onto its saved stack. Under ``no_grad()`` nothing is saved
(evaluation, and the first forward of an activation-checkpointed module). The flag is
thread-local because ``LocalWorld`` runs its ranks as threads of one process.
"""

from __future__ import annotations

import threading
from types import TracebackType

_state = threading.local()


def is_grad_enabled() -> bool:
    """True when forward passes save activations for backward (the default)."""
    return getattr(_state, "enabled", True)


class _GradMode:
    """Context manager that sets grad mode on entry and restores the previous mode on exit."""

    enabled = True

    def __enter__(self) -> None:
        self._previous = is_grad_enabled()
        _state.enabled = self.enabled

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,  # noqa: V107 (the context-manager protocol's signature)
        tb: TracebackType | None,
    ) -> None:
        _state.enabled = self._previous


class no_grad(_GradMode):  # noqa: N801  (named like torch.no_grad, used the same way)
    """``with no_grad(): model(x)`` runs forward without saving anything for backward."""

    enabled = False


class enable_grad(_GradMode):  # noqa: N801
    """``with enable_grad(): ...`` saves activations even inside a ``no_grad`` block."""

    enabled = True
