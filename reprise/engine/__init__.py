"""The decode engine's parts."""
