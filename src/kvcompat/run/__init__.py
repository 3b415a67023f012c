"""Running one cell: resolve, install, test, record (see :mod:`kvcompat.run.workflow`).

* options     RunOptions, the knobs of a run
* cellfiles   the files one cell owns (log, lock, running marker, pytest reports)
* context     what every phase gets (cell, venv, options, files, progress)
* process     commands in their own process group, streamed, killable
* resolve     phase 1: the lock, the cache key, the unchanged fast path
* install     phase 2: the venv from the lock (and the disk check before it)
* integrity   before the tests: vLLM's connector files match their RECORD hashes, or no verdict
* suites      phase 3: pytest with the in-cell plugin, the import probe
* record      the result file, whatever ended the run
* lock        one run per cell venv at a time
* workflow    the phases in order, and run_cell
"""
