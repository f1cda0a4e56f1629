"""Scoring predictions: nnui-evaluate, nnui-ensemble, nnui-find-best-configuration."""
