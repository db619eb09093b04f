"""SpecPilot: the thin layer over the operator packages, and the `specpilot` command line."""

__version__ = "0.1.0"
