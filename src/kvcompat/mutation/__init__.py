"""Mutation testing of the connector suite: does it notice when MultiConnector misbehaves?

``catalogue`` reads tests/mutants/*.toml and decides, by a textual probe of a release's
multi_connector.py, where each mutant applies; ``guard`` swaps that one file in the
session's own venv and always puts it back; ``session`` runs the baseline and one suite
run per mutant and writes results/mutants-<cell>.json.  Harness code: no vLLM import.
"""
