"""Turn the user's replay data into padded batches with explicit loss targets."""

from __future__ import annotations

import numbers

import sys
from collections.abc import Mapping, Sequence
from typing import Any, Iterable, Optional

import torch
from torch import Tensor

from hf_janus.errors import JanusError

IGNORE_INDEX = -100

_NEEDS_TOKENS = (
    "tokenize the replay text first, e.g. dataset.map(lambda b: tokenizer(b['text']), batched=True), "
    "and keep the 'input_ids' and 'attention_mask' columns"
)


def _as_list(value: Any) -> list:
    if isinstance(value, Tensor):
        return value.tolist()
    return list(value)


def _collate(samples: list[Mapping[str, Any]], indices: list[int]) -> dict[str, Tensor]:
    """Right-pad a list of samples; positions that are padding get mask 0 and label -100.

    ``indices`` are the samples' positions in the user's replay, for error messages.
    """
    rows = []
    for idx, sample in zip(indices, samples):
        if not isinstance(sample, Mapping) or "input_ids" not in sample:
            keys = sorted(sample) if isinstance(sample, Mapping) else type(sample).__name__
            raise JanusError(f"replay sample {idx} has no 'input_ids' (found {keys}); {_NEEDS_TOKENS}")
        ids = _as_list(sample["input_ids"])
        if ids and isinstance(ids[0], list):
            raise JanusError(
                f"replay sample {idx} has nested input_ids (a batch inside a sample); pass one sequence per "
                "sample or a DataLoader that yields batches"
            )
        if len(ids) == 0:
            raise JanusError(f"replay sample {idx} has empty input_ids")
        bad = next((t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)), None)
        if bad is not None:
            raise JanusError(
                f"replay sample {idx} has a token id {bad!r} that is not an integer; input_ids must be the integer "
                "ids a tokenizer returns (tokenize the text again)"
            )
        mask = _as_list(sample.get("attention_mask", [1] * len(ids)))
        labels = sample.get("labels")
        labels = _as_list(labels) if labels is not None else None
        for key, seq in (("attention_mask", mask), ("labels", labels)):
            if seq is not None and len(seq) != len(ids):
                raise JanusError(
                    f"replay sample {idx}: {key} has length {len(seq)} but input_ids has length {len(ids)}"
                )
        rows.append((ids, mask, labels))
    width = max(len(r[0]) for r in rows)
    has_labels = any(r[2] is not None for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    labels_t = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, (ids, mask, labels) in enumerate(rows):
        n = len(ids)
        input_ids[i, :n] = torch.tensor(ids, dtype=torch.long)
        attention[i, :n] = torch.tensor(mask, dtype=torch.long)
        if labels is not None:
            labels_t[i, :n] = torch.tensor(labels, dtype=torch.long)
    batch = {"input_ids": input_ids, "attention_mask": attention}
    if has_labels:
        batch["labels"] = labels_t
    return batch


def _normalize_batch(batch: Any, index: int) -> dict[str, Tensor]:
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        found = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise JanusError(f"replay batch {index} has no 'input_ids' (found {found}); {_NEEDS_TOKENS}")
    out = {}
    for key in ("input_ids", "attention_mask", "labels"):
        if key in batch and batch[key] is not None:
            value = batch[key]
            out[key] = value if isinstance(value, Tensor) else torch.as_tensor(value)
    ids = out["input_ids"]
    if ids.dim() != 2:
        raise JanusError(f"replay batch {index}: input_ids must be 2-D (batch, seq), got shape {tuple(ids.shape)}")
    out.setdefault("attention_mask", torch.ones_like(ids))
    for key in ("attention_mask", "labels"):
        if key in out and out[key].shape != ids.shape:
            raise JanusError(
                f"replay batch {index}: {key} has shape {tuple(out[key].shape)} but input_ids has {tuple(ids.shape)}"
            )
    return out


def prepare_replay(replay: Any, batch_size: int, *, group_by_length: bool = True) -> list[dict[str, Tensor]]:
    """Normalize ``replay`` into a list of batches ``{input_ids, attention_mask[, labels]}`` on the CPU.

    ``replay`` may be a ``datasets.Dataset`` or a list of dicts (one sample each, grouped by length, or with
    ``group_by_length=False`` batched in the order given, and padded here), a list of pre-collated batch dicts
    (2-D ``input_ids``), or a ``torch.utils.data.DataLoader`` (or any iterable of batch dicts), used as given.
    """
    if replay is None:
        raise JanusError("replay is None: pass the past-task samples to replay "
                         "(a Dataset, list of dicts or DataLoader)")
    if isinstance(replay, torch.utils.data.DataLoader):
        batches = [_normalize_batch(b, i) for i, b in enumerate(replay)]
    elif isinstance(replay, Mapping):
        raise JanusError(
            "replay is a single dict; pass a list of samples, a datasets.Dataset or a DataLoader of batches"
        )
    elif _is_sample_sequence(replay) and len(replay) > 0 and _is_batch(replay[0]):
        batches = [_normalize_batch(b, i) for i, b in enumerate(replay)]
    elif _is_sample_sequence(replay):
        samples = [replay[j] for j in range(len(replay))]
        order = _length_grouped_order(samples) if group_by_length else list(range(len(samples)))
        batches = []
        for i in range(0, len(order), batch_size):
            chunk = order[i: i + batch_size]
            batches.append(_collate([samples[j] for j in chunk], chunk))
    elif isinstance(replay, Iterable):
        batches = [_normalize_batch(b, i) for i, b in enumerate(replay)]
    else:
        raise JanusError(f"unsupported replay type {type(replay).__name__}; pass a Dataset, list of dicts or "
                         "DataLoader (a file, dataset id or SelfReplay is read or generated by "
                         "hf_janus.replay.resolve.resolve_replay, which rectify and the entry points call)")
    if not batches or sum(int(b["input_ids"].shape[0]) for b in batches) == 0:
        raise JanusError("replay is empty: JANUS needs samples of the past task (typically ~256) to build the Jacobian")
    for index, batch in enumerate(batches):
        _check_values(batch, index)
    return batches


def rebatch(batches: list[Mapping[str, Tensor]], batch_size: int) -> list[dict[str, Tensor]]:
    """The rows of ``batches``, in their order, cut into batches of ``batch_size`` rows (the last may be shorter),
    right-padded to their longest row. Each row keeps its tokens, their positions, its mask and the tokens that carry
    loss (:func:`loss_targets`): a batch without labels gives its rows labels that count what counted, so that batches
    with and without them can share one. Trailing columns no row attends to are dropped."""
    rows, widths = [], []
    for batch in batches:
        labels = batch.get("labels")
        if labels is None:
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        # a row needs its columns up to its last attended token, or up to the last target it predicts
        needed = batch["attention_mask"].bool().clone()
        needed[:, 1:] |= loss_targets(batch) != IGNORE_INDEX
        columns = torch.arange(needed.shape[1]).expand_as(needed)
        widths += (torch.where(needed, columns, 0).max(-1).values + 1).tolist()
        rows += zip(batch["input_ids"], batch["attention_mask"], labels)
    out = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start: start + batch_size]
        width = max(widths[start: start + batch_size])
        merged = {"input_ids": torch.zeros(len(chunk), width, dtype=torch.long),
                  "attention_mask": torch.zeros(len(chunk), width, dtype=torch.long),
                  "labels": torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)}
        for i, row in enumerate(chunk):
            for key, values in zip(merged, row):
                n = min(width, len(values))
                merged[key][i, :n] = values[:n]
        out.append(merged)
    return out


def _check_values(batch: Mapping[str, Tensor], index: int) -> None:
    """Token ids are non-negative integers and the attention mask is 0/1, where it counts."""
    for key, value in batch.items():
        if value.is_meta:
            raise JanusError(f"replay batch {index}: {key} is on the meta device (it holds no data); load the replay "
                             "data onto the CPU")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise JanusError(f"replay batch {index}: input_ids have dtype {ids.dtype}; token ids must be integers "
                         "(tokenize the text again, or cast with .long() if they are whole numbers)")
    if not ((mask == 0) | (mask == 1)).all():
        found = sorted({int(v) for v in mask.flatten().tolist() if v not in (0, 1)})[:5]
        raise JanusError(f"replay batch {index}: attention_mask holds values other than 0 and 1 ({found}); it marks "
                         "real tokens with 1 and padding with 0")
    negative = (ids < 0) & mask.bool()
    if negative.any():
        row = int(negative.any(dim=1).nonzero()[0])
        raise JanusError(f"replay batch {index}, row {row}: negative token id {int(ids[negative][0])} at a "
                         "non-padding position; token ids are non-negative (mask padding with attention_mask=0)")


#: offending samples named in a vocabulary error; the count says how many more there are
_SHOWN = 5


def vocabulary_sizes(model: Any) -> tuple[Optional[int], Optional[int]]:
    """How many token ids ``model`` embeds and how many it predicts (its logits); ``None`` where it does not say.
    The two differ where the output head was resized apart from the embeddings."""
    def call(name: str) -> Any:
        method = getattr(model, name, None)
        try:
            return method() if callable(method) else None
        except (NotImplementedError, AttributeError):
            return None

    embedded = getattr(call("get_input_embeddings"), "num_embeddings", None)
    head = call("get_output_embeddings")
    predicted = getattr(head, "out_features", None)
    weight = getattr(head, "weight", None)
    if predicted is None and isinstance(weight, Tensor) and weight.dim() == 2:
        predicted = int(weight.shape[0])
    return embedded, predicted if predicted is not None else embedded


def _first_outside(values: Tensor, counted: Tensor, size: Optional[int]) -> list[Optional[int]]:
    """For each row, the first counted value outside ``[0, size)``, or ``None``."""
    if size is None:
        return [None] * values.shape[0]
    outside = counted & ((values < 0) | (values >= size))
    return [int(row[hit][0]) if hit.any() else None for row, hit in zip(values, outside)]


def check_vocabulary(batches: list[dict[str, Tensor]], model: Any, what: str = "replay",
                     in_given_order: bool = True) -> None:
    """Refuse samples whose input ids (where the attention mask counts them) or labels (other than -100) are not
    token ids of ``model`` (an embedding lookup or the loss would fail or, on some devices, read garbage), before
    any work. ``what`` names the samples in the error ("replay", "new-task"); with ``in_given_order`` the batches
    keep the user's order and a sample is named by its position in it, else by its batch and row."""
    embedded, predicted = vocabulary_sizes(model)
    if embedded is None and predicted is None:
        return
    found: list[tuple[str, str, int]] = []  # (where, "token id" or "label", the value)
    seen = 0
    for index, batch in enumerate(batches):
        ids = _first_outside(batch["input_ids"], batch["attention_mask"].bool(), embedded)
        labels = batch.get("labels")
        targets = [None] * len(ids) if labels is None else _first_outside(labels, labels != IGNORE_INDEX, predicted)
        for row, (bad_id, bad_label) in enumerate(zip(ids, targets)):
            where = f"sample {seen + row}" if in_given_order else f"batch {index}, row {row}"
            if bad_id is not None:
                found.append((where, "token id", bad_id))
            elif bad_label is not None:
                found.append((where, "label", bad_label))
        seen += len(ids)
    if not found:
        return
    where, key, value = found[0]
    size = embedded if key == "token id" else predicted
    field = "input_ids" if key == "token id" else "labels (token ids, or -100 where no loss counts)"
    shown = "; ".join(w for w, _, _ in found[:_SHOWN]) + ("; ..." if len(found) > _SHOWN else "")
    order = ", counting from 0 in the order given" if in_given_order else ""
    raise JanusError(f"{what} {where} holds {key} {value} in its {field}, but the model has {size} tokens (ids 0 to "
                     f"{size - 1}); {len(found)} {what} sample(s) are outside the vocabulary ({shown}{order}): they "
                     f"were tokenized for another model; tokenize the {what} samples with this model's tokenizer, "
                     "or drop them")


def _sample_length(sample: Any) -> int:
    """Token count of one sample, 0 when it is malformed (``_collate`` reports that with the sample's index)."""
    try:
        return len(sample["input_ids"])
    except (TypeError, KeyError, IndexError):
        return 0


def _length_grouped_order(samples: list[Any]) -> list[int]:
    """Sample indices sorted by length (stable), so that each batch pads to about its own samples' length.

    Padding costs forward/backward time, and a batch padded beyond the compression rank r goes through the
    QR + SVD compression even when most of its samples have at most r tokens (their rank-r factors are
    exact without it). The order of the Jacobian's rows does not change any result.
    """
    return sorted(range(len(samples)), key=lambda j: _sample_length(samples[j]))


def _is_batch(item: Any) -> bool:
    """A dict whose input_ids are already 2-D (batch, seq): a pre-collated batch, not one sample."""
    if not isinstance(item, Mapping) or "input_ids" not in item:
        return False
    ids = item["input_ids"]
    if isinstance(ids, Tensor):
        return ids.dim() == 2
    return isinstance(ids, (list, tuple)) and len(ids) > 0 and isinstance(ids[0], (list, tuple, Tensor))


def _is_sample_sequence(replay: Any) -> bool:
    datasets = sys.modules.get("datasets")  # a Dataset can only exist if the library is already imported
    if datasets is not None and isinstance(replay, datasets.Dataset):
        return True
    return isinstance(replay, Sequence) and not isinstance(replay, (str, bytes))


def loss_targets(batch: Mapping[str, Tensor]) -> Tensor:
    """Next-token targets aligned with ``logits[:, :-1]``: labels if given, else every non-pad token.

    A token predicted from a padding position (the first real token after left padding) never counts.
    """
    mask = batch["attention_mask"]
    labels: Optional[Tensor] = batch.get("labels")
    if labels is None:
        labels = batch["input_ids"].masked_fill(mask == 0, IGNORE_INDEX)
    return labels[:, 1:].masked_fill(mask[:, :-1] == 0, IGNORE_INDEX)


def counted_tokens(batches: list[Mapping[str, Tensor]]) -> int:
    """How many tokens of ``batches`` carry loss (:func:`loss_targets`)."""
    return sum(int((loss_targets(batch) != IGNORE_INDEX).sum()) for batch in batches)


def samples_without_loss(batches: list[Mapping[str, Tensor]]) -> list[int]:
    """Positions of the samples none of whose tokens carries loss (:func:`loss_targets`), counting rows across
    ``batches`` in their order: with batches made in the order given, each sample's index in that order."""
    out, seen = [], 0
    for batch in batches:
        counted = (loss_targets(batch) != IGNORE_INDEX).any(-1)
        out += [seen + int(i) for i in (~counted).nonzero()[:, 0]]
        seen += len(counted)
    return out
