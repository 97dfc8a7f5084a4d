"""Checkpoints: sharded (torch.distributed.checkpoint), resharding on load, committed atomically.

- :mod:`.commit`: the commit protocol (temp dir, manifest with checksums, rename, rotation, verify).
- :mod:`.chunks`: what a rank holds and owns of each parameter, as rectangles of the full tensor.
- :mod:`.sharded`: DCP planners that write owned chunks and read requested ones, in bounded batches.
- :mod:`.export`: one consolidated file from a checkpoint, offline.
- :mod:`.by_name`: optimizer state by parameter name (the full, unsharded view).
"""

from bigtrain.checkpoint.by_name import load_optimizer_state_by_name, optimizer_state_by_name
from bigtrain.checkpoint.commit import (PREFIX, CorruptCheckpoint, commit_checkpoint, fresh_temp_dir, list_checkpoints,
                                        load_file, newest_valid_checkpoint, save_checkpoint, temp_dir,
                                        verify_checkpoint)

FORMAT = "dcp/1"  # meta.json "format" of the sharded checkpoints this version writes and reads
