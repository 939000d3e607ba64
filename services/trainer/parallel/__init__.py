"""One job on several devices: ranks in step, FSDP2 data parallelism."""
