"""Measuring scripts, one question each: `python -m bench.NAME --help`. Each prints one table last.

bench/ measures; tests/ verifies (the GPU paths' correctness: `python -m pytest -m gpu`). Nothing
here imports tests; what the scripts share is in bench/common.py.
"""
