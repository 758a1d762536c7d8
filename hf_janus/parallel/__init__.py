"""Running the engine under data parallelism (DDP) and on sharded weights (FSDP2, DeepSpeed ZeRO-3)."""
