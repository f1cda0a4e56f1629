"""Stop and kill, the safety-critical path in one folder: who may be signalled (targets),
sending (send), and the verified process tree of a job (proctree)."""
