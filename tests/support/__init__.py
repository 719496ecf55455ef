"""Test helpers (not fixtures: those are in tests/conftest.py): batch collection and comparison, local S3 and WebHDFS
endpoints, media rows, generated SFT conversations, loopback Ray clusters, and the resume test's consumer script."""
