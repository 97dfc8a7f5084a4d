"""Memory: activation checkpointing (full, every k-th, selective), activation offload, int8 activation
compression, the fused linear cross-entropy, and measured accounting."""
