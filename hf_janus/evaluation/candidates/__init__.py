"""The frontier's candidates: one small object per kind behind one interface (:class:`Candidate`), a registry
of the kinds, a spec syntax (:func:`parse_candidates`) and what :func:`hf_janus.frontier` scores by default
(:func:`default_candidates`).

Kinds, by spec name: ``wise``, ``janus``, ``damped-janus``, ``janus-to-reference``, ``janus-to-finetuned``,
``wise-then-janus``, ``intruder`` and ``intruder-then-janus`` (LoRA adapters), the post-hoc peers ``replay-sft``,
``input-null``, ``regmean``, ``fisher``, ``lines`` and ``dg-hard`` (full fine-tuning), and ``janus-repair`` (JANUS
with the repair after it, ``JanusConfig.distill_steps``: the engine's own stage).
"""

from hf_janus.evaluation.candidates.anchor import FINETUNED, REFERENCE, Anchor
from hf_janus.evaluation.candidates.base import (WISE_CURVE_SPEC, BuildContext, Candidate, CandidateDiverged, Cost,
                                                 Curve, Option, PlotStyle, SpecContext)
from hf_janus.evaluation.candidates.registry import kind_named, kinds, parse_candidates, register

# Each kind registers itself when its module is imported: these imports are in the order of the plot's legend and of
# the docs (registration order), the JANUS kinds after WiSE-FT and intruder reduction, the post-hoc peers last.
from hf_janus.evaluation.candidates.wise import Wise
from hf_janus.evaluation.candidates.intruder import INTRUDER_CURVE_SPEC, Intruder
from hf_janus.evaluation.candidates.janus import Janus, JanusBased
from hf_janus.evaluation.candidates.damped_janus import DampedJanus
from hf_janus.evaluation.candidates.janus_to_reference import JanusToReference
from hf_janus.evaluation.candidates.janus_to_finetuned import JanusToFinetuned
from hf_janus.evaluation.candidates.wise_then_janus import WiseThenJanus
from hf_janus.evaluation.candidates.intruder_then_janus import IntruderThenJanus
from hf_janus.evaluation.candidates.replay_sft import ReplaySft
from hf_janus.evaluation.candidates.input_null import InputNull
from hf_janus.evaluation.candidates.regmean import RegMean
from hf_janus.evaluation.candidates.fisher import Fisher
from hf_janus.evaluation.candidates.lines import Lines
from hf_janus.evaluation.candidates.dg_hard import DgHard
from hf_janus.evaluation.candidates.janus_repair import JanusRepair
from hf_janus.evaluation.candidates.defaults import (DEFAULT_GRID, DEFAULT_PEERS, NEW_TASK_PEERS,
                                                     default_candidates, default_peers)

__all__ = [
    "DEFAULT_GRID", "DEFAULT_PEERS", "FINETUNED", "INTRUDER_CURVE_SPEC",
    "REFERENCE", "WISE_CURVE_SPEC", "Anchor", "BuildContext", "Candidate", "CandidateDiverged", "Cost", "Curve",
    "DampedJanus", "DgHard",
    "Fisher", "InputNull", "Intruder", "IntruderThenJanus", "Janus", "JanusBased", "JanusRepair",
    "JanusToFinetuned",
    "JanusToReference", "Lines", "NEW_TASK_PEERS", "Option", "PlotStyle", "RegMean", "ReplaySft", "SpecContext",
    "Wise", "WiseThenJanus", "default_candidates", "default_peers", "kind_named", "kinds",
    "parse_candidates", "register",
]
