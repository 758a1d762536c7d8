"""Performance benchmarks of the rectification (see RESULTS.md); ``measure`` holds what the scripts share."""
