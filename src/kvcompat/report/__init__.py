"""The compatibility report: a model built from results, and one renderer per format.

* model     Report (grid cells, episodes, changes) from results/*.json
* markdown  reports/compat.md      * webpage   reports/compat.html
* junit     reports/compat.xml     * jsonfile  reports/compat.json
* terminal  the grid on stdout     * write     all of them into reports/
"""
