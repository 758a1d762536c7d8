"""``transformers.Trainer`` integration: ``JanusCallback``, its θ0 snapshot, and publishing on save and push."""
