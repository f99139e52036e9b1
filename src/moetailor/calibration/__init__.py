"""Calibration: one forward pass over calibration text -> per-expert statistics (and fold tables)."""
from .calibrate import GATES, Collector, calibrate, calibrate_batches
from .data import DataSpec, iter_documents, iter_token_batches, iter_token_windows, parse_data_spec
from .stats import BETA_BINS, ExpertStats, LayerStats, StatsMismatch, load_fold_tables

__all__ = ["GATES", "Collector", "calibrate", "calibrate_batches", "DataSpec", "iter_documents",
           "iter_token_batches", "iter_token_windows", "parse_data_spec", "BETA_BINS", "ExpertStats",
           "LayerStats", "StatsMismatch", "load_fold_tables"]
