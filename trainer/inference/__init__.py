"""The inference side: raw images in, segmentations in the images' own geometry out.

predict (nnui-predict: flags, checkpoints, the run) -> cases (list and check the input
folder) -> prepare (the training's preprocessing of one case) -> sliding (Gaussian sliding
window over windows' positions and weights, mirroring TTA, fold averaging) -> export and
region_export (back to the raw geometry, written atomically) -> postprocess; engine streams
the cases with overlap; events is the record the app follows.
"""
