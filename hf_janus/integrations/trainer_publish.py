"""Make ``trainer.save_model()`` and ``trainer.push_to_hub()`` publish the JANUS record with the weights."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from hf_janus.engine.report import RectificationReport
from hf_janus.publish.files import detect_kind, write_publication_files
from hf_janus.publish.provenance import ReplayInfo, RepoRef, describe_model, describe_replay
from hf_janus.publish.record import build_report
from hf_janus.publish.weights_meta import weight_files_present


def install_trainer_hooks(trainer: Any, report: Union[RectificationReport, Callable[[], Optional[RectificationReport]]],
                          *, replay: Any = None, replay_info: Union[ReplayInfo, dict, None] = None,
                          base_model: Union[str, RepoRef, None] = None, token: Any = None) -> None:
    """Make ``trainer.save_model()`` and ``trainer.push_to_hub()`` publish the JANUS record with the weights.

    ``trainer.push_to_hub()`` saves the model again and then rewrites ``output_dir/README.md`` with
    ``create_model_card()`` just before uploading, so files written earlier would lose their metadata and
    card. This wraps the two instance methods (nothing on the ``Trainer`` class changes): after
    ``save_model`` and after ``create_model_card``, :func:`write_publication_files` adds the record, merges
    our section and tags into the card the Trainer wrote, and stamps the weight files, so the upload that
    follows carries them. ``report`` is the report or a callable returning it (``None``: not rectified yet;
    the hooks then do nothing). Installing twice only replaces the report source.
    """
    provider = report if callable(report) else (lambda: report)
    state = getattr(trainer, "_janus_publication", None)
    if state is not None:
        state.update(provider=provider, replay=replay, replay_info=replay_info, base_model=base_model, token=token)
        return
    state = {"provider": provider, "replay": replay, "replay_info": replay_info, "base_model": base_model,
             "token": token, "built": {}}
    original_save, original_card = trainer.save_model, trainer.create_model_card

    def publish(output_dir: Optional[str]) -> None:
        rect = state["provider"]()
        folder = output_dir or trainer.args.output_dir
        if rect is None or not trainer.is_world_process_zero() or not weight_files_present(folder):
            return
        kind = detect_kind(folder)
        key = (id(rect), kind)
        if key not in state["built"]:  # one record per report: repeated saves do not change created_at
            base = state["base_model"] or describe_model(trainer.model, token=state["token"])
            info = state["replay_info"]
            if info is None and state["replay"] is not None:
                info = describe_replay(state["replay"], token=state["token"])
            state["built"] = {key: build_report(rect, kind=kind, base_model=base, replay_info=info,
                                                token=state["token"])}
        repo_id = getattr(trainer, "hub_model_id", None) or trainer.args.hub_model_id
        write_publication_files(folder, state["built"][key], repo_id=repo_id or folder, token=state["token"])

    def save_model(output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        original_save(output_dir, _internal_call=_internal_call)
        publish(output_dir)

    def create_model_card(*args: Any, **kwargs: Any) -> None:
        original_card(*args, **kwargs)
        publish(None)  # the Trainer writes the card in args.output_dir, right before uploading it

    trainer.save_model, trainer.create_model_card = save_model, create_model_card
    trainer._janus_publication = state

