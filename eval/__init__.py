"""Stage 3: speculative decoding with a trained head, acceptance metrics and the release report."""
