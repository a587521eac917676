"""The runtime's workers: the task loop that clients (and computing servers) run, and per-stage averaging."""
