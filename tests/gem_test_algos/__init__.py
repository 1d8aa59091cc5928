"""Algorithms for tests only, loaded by import path (algorithm=gem_test_algos.<module>), as any user's would be."""
