"""lm-eval task YAMLs that read local JSONL files (see hf_janus.evaluation.local_tasks)."""
