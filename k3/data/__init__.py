"""Bundled data (the offline default corpus) and loading of user corpora."""
