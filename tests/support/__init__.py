"""Helpers shared by tests of several parts."""
