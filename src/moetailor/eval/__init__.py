"""Evaluation: task accuracy and output length per configuration, sweeps, reports.

Importing the package registers every configuration: the phase configurations
(``configurations``) and the folding and skipping ones (``technique_configs``).
"""
from . import configurations, technique_configs  # noqa: F401  (registration)
