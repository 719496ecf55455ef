"""Dev tooling, never imported by the product: benchmarks, the verl oracle, sample data, GPU scripts."""
