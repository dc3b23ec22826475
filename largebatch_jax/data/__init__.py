"""Input pipeline: sources (tfds, array_record), transforms (rule 13), loader (rule 8)."""
