"""Data preparation: benchmark readers, the embedded default (corpus + QA), validation, output formats."""
