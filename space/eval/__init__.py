"""Evaluation: prompt sets, timed runs of every method, execution, reports."""
