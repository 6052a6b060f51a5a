"""Offline training of the byte-level Reformer: data (train/data.py), the loop and its phases
(train/loop.py, train/phases.py), the distributed runtime (train/runtime.py) and the checkpoint format
(train/checkpoint.py; read back by export.checkpoint, the one reader)."""
