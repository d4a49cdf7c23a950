"""replay_traces: see ../shared/DESIGN.md for what this folder owns."""
