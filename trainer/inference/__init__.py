"""The inference side: raw images in, segmentations in the images' own geometry out.

cases (list and check the input folder) -> prepare (the training's preprocessing of one
case) -> sliding (Gaussian sliding window, mirroring TTA, fold averaging) -> export (back to
the raw geometry, written atomically) -> engine (streams the cases with overlap).
"""
