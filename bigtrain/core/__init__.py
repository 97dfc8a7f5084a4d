"""The bottom layer: what every package reads and nothing in bigtrain is needed to define.

- :mod:`.tables`: the embedding tables' configuration (kinds, sizes, sparse optimizers), checked
  without torch.
- :mod:`.targets`: the target id a loss leaves out.
- :mod:`.blocks`: a model's blocks, found from its structure (ZeRO's units, activation planning).
- :mod:`.reference_step`: what one step of an independent reference produced (`bigtrain check`).

It imports nothing of bigtrain (torch at most), so any package may import it (``tests/test_layering.py``).
"""
