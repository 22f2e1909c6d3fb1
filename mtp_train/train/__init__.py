"""Stage 2: training a draft head on precomputed features."""
