"""Training one fold: arguments, configuration, launch and ranks, the worker, the epoch
loop, its events, final validation and the fold lock."""
