"""Functions the shipped YAML tasks name with ``!function utils.<name>``: lm-eval resolves them relative to this
directory, so they are re-exported here from :mod:`hf_janus.evaluation.local_tasks`, where they live."""

from hf_janus.evaluation.local_tasks import (  # noqa: F401
    completion_prompt,
    completion_target,
    load_completions,
    load_qa,
    process_completion,
    process_qa,
    qa_prompt,
    qa_target,
)
from hf_janus.evaluation.scoring import weighted_nll  # noqa: F401
