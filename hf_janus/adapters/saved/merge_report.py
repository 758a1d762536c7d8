"""``MergeReport``: what :class:`~hf_janus.JanusMerger` did, inputs to per-layer re-factorization statistics."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from hf_janus.engine.report import RectificationReport
from hf_janus.errors import JanusError
from hf_janus.io_utils import atomic_write_text
from hf_janus.publish.record_file import PublishedReport
from hf_janus.serialization import known_fields

MERGE_SCHEMA_VERSION = 1
# MergeReport fields that janus_rectification.json stores outside its "merge" section.
_MERGE_FIELDS_ELSEWHERE = ("base_model", "adapter", "rectification", "base_revision", "adapter_revision", "replay",
                           "output_format", "adapter_kind", "peft_type")



@dataclass
class MergeReport:
    """What :class:`JanusMerger` did: inputs, layers, the engine's report and, after ``save_adapter``, the
    per-layer re-factorization statistics (kept energy, residuals with and without refinement)."""

    base_model: str
    adapter: str
    adapter_kind: str
    peft_type: str
    rectification: RectificationReport
    rectified_layers: list[str]
    unrectified_layers: list[str] = field(default_factory=list)  # adapted, kept at their fine-tuned value
    modules_to_save: list[str] = field(default_factory=list)
    base_revision: Optional[str] = None
    adapter_revision: Optional[str] = None
    replay: Optional[str] = None
    # the base's quantization when the adapter was rectified against a quantized base (QLoRA), in words
    base_quantization: Optional[str] = None
    output_format: Optional[str] = None  # "adapter" or "full" once saved
    # {"adapter_rank", "adapter_energy", "refine", "layers": [RefactorStats]}
    refactorization: Optional[dict[str, Any]] = None
    schema_version: int = MERGE_SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["rectification"] = self.rectification.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MergeReport":
        """Read :meth:`to_dict` output, or a published ``janus_rectification.json`` (see
        :mod:`hf_janus.publish.record_file`)."""
        if "hf_janus_version" in data:
            return cls.from_published(PublishedReport.from_dict(data))
        data = dict(data)
        data["rectification"] = RectificationReport.from_dict(data["rectification"])
        return cls(**data)

    def merge_section(self) -> dict[str, Any]:
        """The ``merge`` field of ``janus_rectification.json``: what the rest of the document does not hold."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in _MERGE_FIELDS_ELSEWHERE}
        return json.loads(json.dumps(out))  # a detached copy: later saves must not rewrite a built record

    @classmethod
    def from_published(cls, published: PublishedReport) -> "MergeReport":
        """The :class:`MergeReport` inside a :class:`~hf_janus.publish.record_file.PublishedReport` written by the
        merger."""
        if published.merge is None or published.adapter is None or published.base_model is None:
            raise JanusError(
                f"this janus_rectification.json{f' ({published.source})' if published.source else ''} was not "
                "written by JanusMerger (no merge section); read it with hf_janus.load_report"
            )
        extras = {k: v for k, v in known_fields(cls, published.merge).items() if k not in _MERGE_FIELDS_ELSEWHERE}
        return cls(
            base_model=published.base_model.id, adapter=published.adapter.id,
            adapter_kind=published.adapter.kind or "", peft_type=published.adapter.peft_type or "",
            rectification=published.rectification, base_revision=published.base_model.revision,
            adapter_revision=published.adapter.revision,
            replay=published.replay.source if published.replay is not None else None,
            output_format=published.kind, **extras,
        )

    def save(self, path: Union[str, os.PathLike]) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "MergeReport":
        with open(path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))

    def summary(self) -> str:
        lines = [
            f"adapter {self.adapter!r} ({self.adapter_kind}) on base {self.base_model!r}: "
            f"{len(self.rectified_layers)} layer(s) rectified"
            + (f", {len(self.unrectified_layers)} adapted layer(s) kept as fine-tuned"
               if self.unrectified_layers else ""),
            self.rectification.summary(),
        ]
        if self.refactorization:
            layers = self.refactorization["layers"]
            ranks = [s["rank"] for s in layers]
            kept = [s["kept_energy"] for s in layers]
            lines.append(
                f"LoRA re-factorization (adapter_rank={self.refactorization['adapter_rank']!r}): ranks "
                f"{min(ranks)}..{max(ranks)}, "
                f"kept energy min {min(kept):.4f}"
            )
            for key, label in (("residual", "residual ||J0 ΔW_k||/||J0 ΔW||"),
                               ("leak", "repair given back ||J0 (ΔW_k − ΔW_rect)||/||J0 ΔW||")):
                trunc = [s[f"{key}_truncated"] for s in layers if s[f"{key}_truncated"] is not None]
                if trunc:
                    line = f"  {label}: max {max(trunc):.3g} truncated"
                    refined = [s[f"{key}_refined"] for s in layers if s[f"{key}_refined"] is not None]
                    if refined:
                        line += f", {max(refined):.3g} refined"
                    lines.append(line)
        return "\n".join(lines)

