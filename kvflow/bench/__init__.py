"""kvflow.bench: benchmark rows, environment capture, timers, and the ``python -m kvflow.bench`` CLI."""
