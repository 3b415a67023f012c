"""Mutation testing of the connector suite: does it notice when MultiConnector misbehaves?

``catalogue``, ``generate``, ``operators`` and ``targets`` say which mutants a release's files get; ``guard``
swaps one file in the session's own venv and always puts it back; ``session`` composes a run (``context``,
``plan``, ``baseline``, ``score``, ``forked``) and writes its ``record``, results/mutants-<cell>.json.
Harness code: no vLLM import, except ``incell``, the pytest plugins loaded in the session's venv.
"""
