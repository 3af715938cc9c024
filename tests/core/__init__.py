"""Tests of the pure core (sgl_pd.core)."""
