"""Constants for the server tests (the fixtures that start servers live in conftest.py)."""

TOKEN = "test-token-123"  # the bearer token `token_server` requires
