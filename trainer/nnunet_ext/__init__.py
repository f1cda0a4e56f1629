"""The folder nnui puts on `nnUNet_extTrainer` (see nnui_trainers.py).

nnU-Net imports every module of this folder by its bare name while it looks for a `-tr`
class, so the folder holds nothing but the trainer module (and this empty package file).
"""
