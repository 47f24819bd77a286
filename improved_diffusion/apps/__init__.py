"""The applications, on top of the library (nothing in the library imports them):

    ckpt_tool     the checkpoint doctor (scripts/ckpt.py): inspect, verify, diff, convert,
                  adapt, prune, consolidate, phema
    demo_page     the demo's index.html (scripts/demo.py)

They import nothing at package import time.
"""
