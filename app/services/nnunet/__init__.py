"""Stock nnU-Net runs nnui did not start (watch-only): the processes and their text logs."""
