"""The life of a process: the command line, the checks before anything starts, launching processes, the process
group, wiring a run from its recipe, the end-of-run summary, how a process ends; the Python entry point."""
