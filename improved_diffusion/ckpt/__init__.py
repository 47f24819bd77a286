"""The checkpoint and resume system (the map is written in the next commit).

Imports nothing at package import time: scripts import ``improved_diffusion.ckpt.preemption`` on
their first lines, before torch.
"""
