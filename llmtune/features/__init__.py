"""Opt-in training features (chunked loss, Ulysses context parallelism), each plugging in at one point."""
