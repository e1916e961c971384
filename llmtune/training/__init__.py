"""The training loop (trainer.py), its optimizer and schedules, and the stop on a signal at an agreed step."""
