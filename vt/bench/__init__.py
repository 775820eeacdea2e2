"""`vt bench`, a serving benchmark that takes `vllm bench serve`'s command lines: run.py (the run
and the entry point), options.py and config.py (the command line and its record), datasets.py
(random and ShareGPT prompts), tokens.py (tokenizer or server tokenization), arrivals.py (when each
request is sent), payload.py (request bodies), client.py (its HTTP client), server.py (the `vt
serve` it starts), progress.py, stats.py (the figures from recorded requests), report.py and
results.py (printed and saved results), plot.py (--plot)."""
