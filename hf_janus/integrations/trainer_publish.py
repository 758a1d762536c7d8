"""Make ``trainer.save_model()`` and ``trainer.push_to_hub()`` publish the JANUS record with the weights."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Iterator, Optional, Union

from hf_janus.engine.report import RectificationReport
from hf_janus.publish.card import rectified_adapter_subfolder
from hf_janus.publish.files import detect_kind, write_publication_files
from hf_janus.publish.hub import NEVER_PUBLISHED
from hf_janus.publish.provenance import ReplayInfo, RepoRef, describe_model, describe_replay
from hf_janus.publish.record_file import PublishedReport, build_report
from hf_janus.publish.weights_meta import weight_files_present

logger = logging.getLogger(__name__)


def _skipping(kwargs: dict) -> dict:
    return {**kwargs, "ignore_patterns": [*(kwargs.get("ignore_patterns") or []), *NEVER_PUBLISHED]}


class _SkippingApi:
    """An ``HfApi`` whose ``upload_folder`` also ignores :data:`NEVER_PUBLISHED` (everything else passes through)."""

    def __init__(self, api: Any):
        self._api = api

    def __getattr__(self, name: str) -> Any:
        return getattr(self._api, name)

    def upload_folder(self, *args: Any, **kwargs: Any) -> Any:
        return self._api.upload_folder(*args, **_skipping(kwargs))


@contextlib.contextmanager
def _uploads_skip_pickles() -> Iterator[None]:
    """While ``Trainer.push_to_hub`` runs, make its upload skip pickles: it ignores only ``_*`` and ``checkpoint-*``,
    so ``training_args.bin`` would go up, and that pickle holds ``args.hub_token`` in clear.

    ``Trainer`` exposes no ignore list, so the module's ``hf_api`` (transformers >= 5) or ``upload_folder``
    (4.x) is swapped for the call and put back after. The upload's arguments are bound during the call even
    with ``blocking=False``, so the swap covers it.
    """
    import transformers.trainer as trainer_module

    if hasattr(trainer_module, "hf_api"):
        name, real = "hf_api", trainer_module.hf_api
        replacement: Any = lambda: _SkippingApi(real())  # noqa: E731
    elif hasattr(trainer_module, "upload_folder"):  # pragma: no cover - transformers 4.x, not in CI
        name, real = "upload_folder", trainer_module.upload_folder
        replacement = lambda *args, **kwargs: real(*args, **_skipping(kwargs))  # noqa: E731
    else:  # pragma: no cover - a transformers that uploads another way
        logger.warning("JANUS: this transformers version uploads in a way hf-janus does not know; "
                       "trainer.push_to_hub() may upload training_args.bin (a pickle holding hub_token)")
        yield
        return
    setattr(trainer_module, name, replacement)
    try:
        yield
    finally:
        setattr(trainer_module, name, real)


class TrainerPublication:
    """What ``trainer.save_model()`` / ``push_to_hub()`` publish for one trainer: the publication record of the
    current report (built once per report and kind, so repeated saves keep its ``created_at``), and the files it
    adds to a saved folder. :func:`install_trainer_hooks` keeps one per trainer; the callback also writes
    :meth:`record` into ``output_dir`` at train end, so that every ``janus_rectification.json`` it leaves is this
    one document."""

    def __init__(self, trainer: Any, provider: Callable[[], Optional[RectificationReport]], *, replay: Any = None,
                 replay_info: Union[ReplayInfo, dict, None] = None, base_model: Union[str, RepoRef, None] = None,
                 token: Any = None):
        self.trainer = trainer
        self.update(provider, replay=replay, replay_info=replay_info, base_model=base_model, token=token)

    def update(self, provider: Callable[[], Optional[RectificationReport]], *, replay: Any = None,
               replay_info: Union[ReplayInfo, dict, None] = None, base_model: Union[str, RepoRef, None] = None,
               token: Any = None) -> None:
        """Point the publication at another report source (and its descriptions)."""
        self.provider, self.replay, self.replay_info = provider, replay, replay_info
        self.base_model, self.token = base_model, token
        self._built: dict[tuple[int, str], PublishedReport] = {}

    def record(self, kind: str) -> Optional[PublishedReport]:
        """The publication record of the current report for an output of ``kind`` (None: not rectified yet)."""
        rect = self.provider()
        if rect is None:
            return None
        key = (id(rect), kind)
        if key not in self._built:  # one record per report: repeated saves do not change created_at
            base = self.base_model or describe_model(self.trainer.model, token=self.token)
            info = self.replay_info
            if info is None and self.replay is not None:
                info = describe_replay(self.replay, token=self.token)
            self._built = {key: build_report(rect, kind=kind, base_model=base, replay_info=info, token=self.token)}
        return self._built[key]

    def publish(self, output_dir: Optional[str]) -> None:
        """Add the record, the card and the weight metadata to a folder the trainer saved (rank 0, weights
        present, a report to publish; otherwise nothing)."""
        trainer = self.trainer
        folder = output_dir or trainer.args.output_dir
        rect = self.provider()
        # an adapter kept beside the trained one (new_adapter_name) is saved by PEFT in a subfolder of its name
        weights_dir = os.path.join(folder, rectified_adapter_subfolder(rect.output) or "") if rect else folder
        if rect is None or not trainer.is_world_process_zero() or not weight_files_present(weights_dir):
            return
        published = self.record(detect_kind(weights_dir))
        repo_id = getattr(trainer, "hub_model_id", None) or trainer.args.hub_model_id
        write_publication_files(folder, published, repo_id=repo_id or folder, token=self.token)


def install_trainer_hooks(trainer: Any, report: Union[RectificationReport, Callable[[], Optional[RectificationReport]]],
                          *, replay: Any = None, replay_info: Union[ReplayInfo, dict, None] = None,
                          base_model: Union[str, RepoRef, None] = None, token: Any = None) -> TrainerPublication:
    """Make ``trainer.save_model()`` and ``trainer.push_to_hub()`` publish the JANUS record with the weights.

    ``trainer.push_to_hub()`` saves the model again and then rewrites ``output_dir/README.md`` with
    ``create_model_card()`` just before uploading, so files written earlier would lose their metadata and
    card. This wraps the two instance methods (nothing on the ``Trainer`` class changes): after
    ``save_model`` and after ``create_model_card``, :func:`write_publication_files` adds the record, merges
    our section and tags into the card the Trainer wrote, and stamps the weight files, so the upload that
    follows carries them. ``push_to_hub`` is wrapped too, so that its upload skips pickles
    (``training_args.bin``) as :func:`~hf_janus.publish.hub.push_folder` does. ``report`` is the report or a
    callable returning it (``None``: not rectified yet; the hooks then do nothing). Installing twice only replaces
    the report source. Returns the trainer's :class:`TrainerPublication`.
    """
    provider = report if callable(report) else (lambda: report)
    publication = getattr(trainer, "_janus_publication", None)
    if isinstance(publication, TrainerPublication):
        publication.update(provider, replay=replay, replay_info=replay_info, base_model=base_model, token=token)
        return publication
    publication = TrainerPublication(trainer, provider, replay=replay, replay_info=replay_info,
                                     base_model=base_model, token=token)
    original_save, original_card, original_push = trainer.save_model, trainer.create_model_card, trainer.push_to_hub

    def save_model(output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        original_save(output_dir, _internal_call=_internal_call)
        publication.publish(output_dir)

    def create_model_card(*args: Any, **kwargs: Any) -> None:
        original_card(*args, **kwargs)
        publication.publish(None)  # the Trainer writes the card in args.output_dir, right before uploading it

    def push_to_hub(*args: Any, **kwargs: Any) -> Any:
        with _uploads_skip_pickles():
            return original_push(*args, **kwargs)

    trainer.save_model, trainer.create_model_card, trainer.push_to_hub = save_model, create_model_card, push_to_hub
    trainer._janus_publication = publication
    return publication
