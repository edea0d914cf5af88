"""The measurement lab: calculators, experiments, load generation, traces."""
