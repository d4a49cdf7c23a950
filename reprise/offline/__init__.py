"""Offline tools: replay through the target model, the hybrid drafter's threshold tuning, training data
for draft heads, and the tiny model used for smoke runs."""
