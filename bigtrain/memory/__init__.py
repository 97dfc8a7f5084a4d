"""Memory: activation checkpointing and measured accounting."""
