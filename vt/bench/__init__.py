"""`vt bench`, a serving benchmark: run.py (the command line and the run), client.py (its HTTP
client), stats.py (the figures from recorded requests), plot.py (--plot)."""
