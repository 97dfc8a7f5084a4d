"""Checkpoints: sharded (torch.distributed.checkpoint), resharding on load, committed atomically.

- :mod:`.commit`: the commit protocol (temp dir, checksummed manifest, rename, rotation, verify).
- :mod:`.compat`: what a checkpoint's config allows a resumed run to change.
- :mod:`.sharded`: DCP planners that write owned chunks and read requested ones, in bounded batches.
- :mod:`.export`: one consolidated file from a checkpoint, offline.
"""

from bigtrain.checkpoint.commit import (PREFIX, CheckpointWriteError, CorruptCheckpoint, commit_checkpoint,
                                        fresh_temp_dir, is_checkpoint_of, is_disk_full, list_checkpoints, load_file,
                                        newest_valid_checkpoint, read_manifest, remove_temp_dirs, save_checkpoint,
                                        temp_dir, valid_checkpoints, verify_checkpoint)

FORMAT = "dcp/1"  # meta.json "format" of the sharded checkpoints this version writes and reads
