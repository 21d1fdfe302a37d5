"""An all-reduce of torch tensors over r2ccl, bootstrapped from a torch.distributed gloo group
(the way vLLM's PyNcclCommunicator bootstraps NCCL). Rails come from R2CCL_NICS.

    R2CCL_NICS=127.0.0.11,127.0.0.12 python3 -m torch.distributed.run --nproc_per_node 2 \\
        examples/allreduce.py
"""

import torch
import torch.distributed as dist

import r2ccl

dist.init_process_group("gloo")
comm = r2ccl.Communicator(dist.group.WORLD)
x = torch.full((1 << 20,), float(comm.rank + 1))
y = comm.all_reduce(x)  # out of place: x is untouched
want = comm.world_size * (comm.world_size + 1) / 2
assert torch.equal(y, torch.full_like(x, want)), y
print(f"rank {comm.rank} of {comm.world_size}: all-reduce correct ({want})")

with comm.group():  # both directions posted before either waits
    comm.send(x, (comm.rank + 1) % comm.world_size)
    got = comm.recv(torch.empty_like(x), (comm.rank - 1) % comm.world_size)
comm.close()
dist.destroy_process_group()
