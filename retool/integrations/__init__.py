"""Adapters that run retool's rollout, sandbox and grader inside other training frameworks.

Each sub-package imports its framework lazily: ``import retool`` never needs them.
"""
