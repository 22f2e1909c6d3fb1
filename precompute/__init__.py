"""Stage 1: run the target through the runtime over a dataset and write features to disk."""
