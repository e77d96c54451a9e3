"""Compiled kernels: how they are built and loaded, apart from the code that calls them."""
