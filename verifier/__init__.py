"""verifier: see ../shared/DESIGN.md for what this folder owns."""
