"""Distributed low-precision training: DDP communication hooks, FSDP2 integration, launching."""
