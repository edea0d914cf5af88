"""Model definitions and their normalised config."""
