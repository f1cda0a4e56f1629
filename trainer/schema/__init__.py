"""The files-and-signals contract between the trainer and the app (docs/contract.md), one
module per topic: tree (roots, run folders, file names), events, status (and job states),
atomic (writes), flags (spelling), exits (exit codes), nnunet (nnU-Net's side of the tree).

Standard library only: this is the one trainer package `app/` may import, so importing any
of its modules stays cheap (no torch, no numpy). Nothing is re-exported here.
"""
