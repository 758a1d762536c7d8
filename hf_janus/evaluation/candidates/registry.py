"""The candidate kinds by name, and the spec syntax that builds candidates from strings.

A spec is whitespace-separated items ``NAME[:OPTIONS]``; ``OPTIONS`` are ``:``-separated ``KEY=V1,V2,...`` (a grid:
every combination of the options' values is a candidate), and a bare ``V1,V2,...`` sets the kind's first option.
An option left out takes its default grid. For example::

    "wise:0.25,0.5,0.7 janus:tau=0.95 damped-janus:damping=0.01,0.1 replay-sft:passes=4,8:loss=kl"

Adding a kind is one module with one :class:`~hf_janus.evaluation.candidates.base.Candidate` subclass decorated with
:func:`register` (see docs/guides/add-a-kind.md).
"""

from __future__ import annotations

from typing import Any, Sequence, Union

from hf_janus.errors import JanusError
from hf_janus.evaluation.candidates.base import Candidate, SpecContext
from hf_janus.kinds import KindRegistry

#: the kinds by spec name (their points' JSON ``kind``), in the order the plot's legend and the docs list them
_KINDS: KindRegistry[type[Candidate]] = KindRegistry(
    "candidate kind", Candidate, "a candidate spec", "hf_janus.evaluation.candidates.registry")

SpecLike = Union[str, Candidate]

#: Make a kind available to specs under its ``name``; usable as a decorator.
register = _KINDS.register
#: The registered kinds, in registration order.
kinds = _KINDS.kinds


def kind_named(name: str) -> type[Candidate]:
    """The kind a spec names (``damped-janus``)."""
    if name == "anchor":
        raise JanusError("θ0 and θ̂ are always scored first; leave 'anchor' out of the candidates")
    return _KINDS.named(name)


def _values(kind: type[Candidate], key: str, text: str) -> list[Any]:
    option = next((o for o in kind.options if o.name == key), None)
    if option is None:
        names = ", ".join(o.name for o in kind.options) or "none"
        raise JanusError(f"{kind.name} has no option {key!r} (its options: {names})")
    out = []
    for item in text.split(","):
        if not item.strip():
            continue
        try:
            out.append(option.parse(item.strip()))
        except ValueError as err:
            raise JanusError(f"{kind.name}: {key}={item.strip()!r} is not a valid value ({option.help})") from err
    if not out:
        raise JanusError(f"{kind.name}: {key}= has no value; give {key}=V1[,V2...] or leave the option out")
    return out


def parse_item(item: str, context: SpecContext = SpecContext()) -> list[Candidate]:
    """The candidates of one spec item ``NAME[:OPTIONS]``."""
    name, _, rest = item.strip().partition(":")
    kind = kind_named(name.strip())
    values: dict[str, list[Any]] = {}
    for segment in rest.split(":") if rest else []:
        if "=" in segment:
            key, _, text = segment.partition("=")
            key = key.strip()
        elif kind.options:
            key, text = kind.options[0].name, segment
        else:
            raise JanusError(f"{kind.name} takes no options, got {segment!r}")
        if key in values:
            raise JanusError(f"{kind.name}: option {key!r} is given twice in {item!r}; give its values once, "
                             "comma-separated")
        values[key] = _values(kind, key, text)
    return kind.expand(values, context)


def parse_candidates(specs: Union[SpecLike, Sequence[SpecLike]],
                     context: SpecContext = SpecContext()) -> list[Candidate]:
    """Candidates from spec strings (each may hold several whitespace-separated items) and candidate objects, in
    the order given; repeats are dropped."""
    out: list[Candidate] = []
    for spec in [specs] if isinstance(specs, (str, Candidate)) else list(specs):
        if isinstance(spec, Candidate):
            found = [spec]
        elif isinstance(spec, str):
            found = [c for item in spec.split() for c in parse_item(item, context)]
        else:
            raise JanusError(f"a candidate is a spec string or a Candidate object, got {type(spec).__name__}")
        out += [c for c in found if c not in out]
    if not out:
        raise JanusError("the candidate spec names no candidate; give e.g. 'wise:0.5 janus'")
    return out
