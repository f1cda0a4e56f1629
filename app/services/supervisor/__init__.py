"""The per-job supervisor process (`python -m app.services.supervisor`): waits for free GPUs,
starts the trainer, watches it (stalls, events), restarts it (`--retries`), tells hooks."""
