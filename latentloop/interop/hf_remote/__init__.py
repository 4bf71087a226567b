"""The modeling files `latentloop export` copies into a Hugging Face folder (trust_remote_code).
They are self-contained (torch + transformers, never latentloop); importing them here is only for
the tests, which check that they stay numerically identical to the package's models."""
