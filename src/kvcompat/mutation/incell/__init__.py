"""The mutation session's in-cell side: pytest plugins loaded with ``-p`` in the session's venv, next to vLLM.

``covplugin`` measures which test runs which line and runs only some tests; ``forkrun`` runs many mutants
in one pytest, each in a forked child.  They import pytest (and, through the suite, vLLM), and of kvcompat
only the vocabulary both worlds share; kvcompat.mutation's other modules are the harness's side.
"""
