"""Runtime helpers the rewritten graphs call (collectives, process groups)."""
