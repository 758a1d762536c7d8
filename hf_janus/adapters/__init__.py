"""PEFT adapters, in two flows over shared helpers.

- :mod:`.saved`: a saved adapter (disk or Hub) → effective model and θ0 → rectify → adapter or full weights.
- :mod:`.live`: a live ``PeftModel`` at train end → rectify its adapted layers → back into the adapter, or merged.
- Shared: :mod:`.peft_layers` (PEFT's tuner layers: effective weights, θ0 from the initial adapter, a plain view
  for the engine, dense stand-ins for quantized bases) and :mod:`.low_rank` (truncated SVD into LoRA factors).
"""
