"""Publishing a rectified model: provenance, the ``janus_rectification.json`` record, safetensors metadata, the
model card, and the Hub."""
