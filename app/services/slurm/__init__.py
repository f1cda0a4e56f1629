"""SLURM: nnui's job script (script.py), its --requeue (requeue.py), folds launched to the
cluster (folds.py) and the controls of a submitted job (control.py)."""
