"""PEFT adapters: from a saved adapter (or a live ``PeftModel``) to the engine, and the rectified update back
into an adapter or full weights."""
