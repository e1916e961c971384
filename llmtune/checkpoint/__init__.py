"""CheckpointManager (DCP save/load/resume/retention) and the HF export."""
