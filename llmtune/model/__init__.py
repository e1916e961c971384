"""The model a run trains: its attention backends, its loss, the tensors checkpoints hold, the shard-by-shard
read of pretrained weights, and the build (meta device, features, checkpointing, compile, fully_shard)."""
