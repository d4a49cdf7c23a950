"""neural_drafters: see ../shared/DESIGN.md for what this folder owns."""
