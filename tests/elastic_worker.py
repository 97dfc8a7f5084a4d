"""A rank for tests/test_elastic.py, run by torchrun --max-restarts 1: the smallest restart there is.

Round 0: both ranks join through ``init_distributed``, all-reduce once, and rank 1 SIGKILLs itself.
Round 1 (the agent's restart): rank 0 joins late, as a rank that imports or checks its data slowly
does, so rank 1 reads rank 0's address from the store first. In the store torchrun keeps across
rounds that read returns round 0's dead address at once. Gloo picks which side of a pair dials by
comparing the two addresses (ports, on one machine): rank 1 either dials the dead port (3 immediate
retries, then ``connectFullMesh failed ... timed out connecting: SO_ERROR: Connection refused``) or
waits to be dialled, which works only if rank 0, comparing the true addresses, decides to dial
(otherwise both wait until the group's timeout). Before the fix this failed 4 runs of 5. With a key space per round the read waits for
rank 0's new address. Prints one line per rank and round; the test reads them.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from bigtrain.distributed.elastic import restart_round
from bigtrain.distributed.launch import init_distributed

LATE_JOIN_S = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0

round_, rank = restart_round(), int(os.environ["RANK"])
if round_ > 0 and rank == 0:
    time.sleep(LATE_JOIN_S)  # not a wait for anything: Gloo's 3 retries take milliseconds, so rank 1 reads first
info = init_distributed("cpu", timeout_s=60)
total = torch.ones(1)
dist.all_reduce(total)
sys.stdout.write(f"round {round_} rank {rank}: all_reduce = {total.item():g}\n")  # one write: lines stay whole
sys.stdout.flush()
if round_ == 0 and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()  # round 0's rank 0 fails here: its peer is gone
dist.destroy_process_group()
