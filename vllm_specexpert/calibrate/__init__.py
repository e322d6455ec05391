"""Offline passes over a model: routing captures (and, later, calibration)."""
