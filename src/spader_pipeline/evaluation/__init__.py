"""Evaluation of search agents: metrics and the evaluation runner."""
