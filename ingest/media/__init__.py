"""Images and videos: processor geometry, decoding, pixel kernels (C / torch / Triton) and where they run."""
