"""The forgetting benchmark and its studies (see README.md): ``lib`` holds the data, tokenizer, model, training and
evaluation helpers; ``variants`` the post-hoc variants scored beside JANUS."""
