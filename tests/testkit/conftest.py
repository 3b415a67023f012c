"""Tests of the in-cell package (kvcompat.testkit) that need no vLLM."""

pytest_plugins = ["pytester"]
