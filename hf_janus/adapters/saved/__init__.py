"""Saved adapters (from disk or the Hub): load the base and the adapter (:mod:`.loading`), build the effective model
and θ0 (:mod:`.effective`), rectify (:mod:`.merger`), and save the result as an adapter or full weights
(:mod:`.delta`, with what was done in :mod:`.merge_report`)."""
