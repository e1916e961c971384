"""The tasks a run trains (pt, sft, dpo, kto): each names its rows, its objective and any extra model; registry.py
lists them."""
