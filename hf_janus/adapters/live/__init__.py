"""Live PEFT models (``JanusCallback`` at train end): rectify the adapted layers of a ``PeftModel`` in place
(:mod:`.rectify`) and write the result back into its LoRA factors (:mod:`.lora_write`) or merge it."""
