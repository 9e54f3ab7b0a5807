"""Tests of one tier (tests/README.md): a package, so that a module may share its name with one of another tier."""
