"""Tests of akv.optimizer."""
