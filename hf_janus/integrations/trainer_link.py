"""How a callback reaches the ``Trainer`` that runs it, and hears when its training raises.

The contract (``JanusCallback`` is its one user):

- **Given** (``JanusCallback(trainer=...)`` or ``callback.trainer = trainer``): the Trainer publishes the record
  through its ``save_model``/``push_to_hub``, receives the logs through ``trainer.log`` and is guarded.
- **Found** when none is given: Trainer hands itself to no callback event (their keyword arguments carry its model,
  tokenizer, optimizer and data loaders, never the Trainer), so :meth:`TrainerLink.find` looks a few frames up the
  call stack for the Trainer whose ``__init__`` (``on_init_end``: a callback given as ``Trainer(callbacks=[...])``)
  or ``train`` (``on_train_begin``: one added with ``add_callback``) is running. A found Trainer publishes, receives
  the logs and is guarded, as a given one does; it is held weakly (the Trainer holds the callback, not the
  reverse). Give the Trainer and nothing is looked up.
- **Guarded**: the Trainer's ``train`` (the instance's, not the class's) is wrapped once, whatever the number of
  links, so that when it raises (Ctrl-C included) each link's ``on_failure(trainer)`` runs, then the same exception
  is raised again: Trainer calls no callback when training raises.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Callable, Optional

#: the frames looked up from the callback event for the running Trainer
SEARCH_DEPTH = 16
#: the attribute of a guarded Trainer that lists the failure handlers its ``train`` calls
FAILURE_HANDLERS = "_janus_failure_guards"


class TrainerLink:
    """The Trainer a callback publishes through: given, else found running it; ``on_failure(trainer)`` runs when a
    guarded Trainer's ``train()`` raises."""

    def __init__(self, on_failure: Callable[[Any], None]):
        self.on_failure = on_failure
        self._given: Any = None
        self._found: Optional[weakref.ref] = None
        #: whether some Trainer's ``train()`` will call ``on_failure`` if it raises
        self.guarded = False

    @property
    def given(self) -> Any:
        """The Trainer given (``None``: none)."""
        return self._given

    @given.setter
    def given(self, trainer: Any) -> None:
        self._given = trainer
        if trainer is not None:
            self._guard(trainer)

    @property
    def trainer(self) -> Any:
        """The Trainer to publish through: the one given, else the one found (``None`` when neither is known)."""
        if self._given is not None:
            return self._given
        return self._found() if self._found is not None else None

    def find(self, building: bool) -> Any:
        """Look up the running Trainer unless one is given: ``building`` (``on_init_end``), the one whose
        ``__init__`` runs, which is guarded (a callback passed to a second Trainer follows it); otherwise
        (``on_train_begin``) the one whose ``train`` runs, when none is known yet. The Trainer now known."""
        if self._given is None and (building or self.trainer is None):
            trainer = running_trainer(building)
            if trainer is not None:
                self._found = weakref.ref(trainer)
                if building:
                    self._guard(trainer)
        return self.trainer

    def _guard(self, trainer: Any) -> None:
        handlers = getattr(trainer, FAILURE_HANDLERS, None)
        if handlers is None:
            handlers = []
            original = trainer.train

            @functools.wraps(original)
            def train(*args: Any, **kwargs: Any) -> Any:
                try:
                    return original(*args, **kwargs)
                except BaseException:  # Ctrl-C included: what a handler cleans up must not outlive an interrupt
                    for handler in list(handlers):
                        handler(trainer)
                    raise

            trainer.train = train
            setattr(trainer, FAILURE_HANDLERS, handlers)
        if not any(handler == self.on_failure for handler in handlers):
            handlers.append(self.on_failure)
        self.guarded = True


def running_trainer(building: bool = False) -> Any:
    """The ``Trainer`` whose method called the running callback event (up to :data:`SEARCH_DEPTH` frames up), or
    ``None``; ``building``: only one whose ``__init__`` is running."""
    from transformers import Trainer

    frame = inspect.currentframe()
    try:
        for _ in range(SEARCH_DEPTH):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer) and (not building or frame.f_code.co_name == "__init__"):
                return candidate
        return None
    finally:
        del frame  # a frame reference kept here would keep every local of the caller chain alive
