"""nnui's jobs as records (the registry) and what is read about them, read-only: events,
views, words, listing, curves, liveness, and the runs nnui adopted."""
