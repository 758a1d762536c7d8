"""Replay data: from a Hub id, file or ``Dataset`` to tokenized samples, and from samples to padded batches."""
